"""KVCacheManager and BlockPool: allocation, prefix hits, LRU eviction, invariants."""

from __future__ import annotations

import pytest
import torch

from kvferry.config import ConfigError
from kvferry.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvferry.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvferry.request import Request
from tests.helpers.scheduler import create_request, make_kv_cache_config

BS = 16


def make_manager(
    num_blocks: int = 10, enable_caching: bool = True, max_model_len: int = 1024
) -> KVCacheManager:
    return KVCacheManager(make_kv_cache_config(num_blocks, BS), max_model_len, enable_caching)


def admit(mgr: KVCacheManager, req: Request, num_new: int | None = None) -> KVCacheBlocks | None:
    """What the scheduler does for a waiting request: lookup, allocate, advance."""
    hits, num_hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new is None else num_new
    blocks = mgr.allocate_slots(req, n, num_hit, hits)
    if blocks is not None:
        req.num_computed_tokens = num_hit + n
    return blocks


def assert_all_free(mgr: KVCacheManager) -> None:
    mgr.check_integrity()
    assert mgr.get_num_free_blocks() == mgr.num_blocks
    assert not mgr.req_to_blocks


# -- free queue and pool ------------------------------------------------------------------


def test_free_queue_order_and_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q.blocks()] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # middle
    q.remove(blocks[0])  # head
    q.remove(blocks[4])  # tail
    assert [b.block_id for b in q.blocks()] == [1, 3]
    q.append(blocks[0])
    assert q.popleft() is blocks[1]
    assert [b.block_id for b in q.blocks()] == [3, 0]
    assert q.num_free_blocks == 2
    q.popleft()
    q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


def test_pool_allocate_free_lru() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.usage == pytest.approx(0.75)
    pool.free_blocks(reversed(a))  # tail first
    pool.check_integrity()
    # Queue is now 3, 2, 1, 0: block 3 was never used, then the freed tail first.
    assert [b.block_id for b in pool.free_queue.blocks()] == [3, 2, 1, 0]
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    with pytest.raises(AssertionError):
        pool.free_blocks([pool.blocks[0]])  # double free


def test_pool_touch_revives_from_middle_and_eviction_drops_hash() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"a" * 32, b"b" * 32, b"c" * 32], 0, 3)
    pool.free_blocks(blocks)
    hit = pool.get_cached_block(b"b" * 32)
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert [b.block_id for b in pool.free_queue.blocks()] == [0, 2]
    pool.check_integrity()
    # Reusing a free cached block evicts its content.
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[0] and reused.block_hash is None
    assert pool.get_cached_block(b"a" * 32) is None
    pool.free_blocks([hit, reused])
    pool.check_integrity()


def test_groups_of_different_block_sizes_rejected() -> None:
    g = KVCacheGroupSpec(("l0",), BS, 1, 8, torch.float32)
    h = KVCacheGroupSpec(("l1",), 2 * BS, 1, 8, torch.float32, sliding_window=8)
    with pytest.raises(ConfigError, match="block_size"):
        KVCacheManager(KVCacheConfig(num_blocks=4, groups=(g, h)), 64)


# -- allocation ---------------------------------------------------------------------------


def test_allocate_grow_and_free() -> None:
    mgr = make_manager(10)
    req = create_request(prompt_token_ids=list(range(20)))
    blocks = admit(mgr, req)
    assert blocks is not None and blocks.get_block_ids() == ([0, 1],)
    assert mgr.get_num_free_blocks() == 8
    # Decode tokens until a third block is needed.
    for t in range(20, 33):
        req.append_output_token_ids([t])
        new = mgr.allocate_slots(req, 1)
        assert new is not None
        req.num_computed_tokens += 1
        assert new.get_block_ids() == (([2],) if t == 32 else ([],))
    assert mgr.get_block_ids(req.request_id) == ([0, 1, 2],)
    mgr.check_integrity()
    mgr.free(req)
    assert_all_free(mgr)
    mgr.free(req)  # no-op
    assert_all_free(mgr)


def test_allocate_fails_without_side_effects() -> None:
    mgr = make_manager(4)
    a = create_request(prompt_token_ids=list(range(40)))  # 3 blocks
    assert admit(mgr, a) is not None
    b = create_request(prompt_token_ids=list(range(100, 140)))
    assert admit(mgr, b) is None
    assert b.request_id not in mgr.req_to_blocks
    assert mgr.get_num_free_blocks() == 1
    # Reserved blocks must stay free.
    c = create_request(prompt_token_ids=list(range(200, 210)))
    hits, n = mgr.get_computed_blocks(c)
    assert mgr.allocate_slots(c, 10, n, hits, num_reserved_blocks=1) is None
    assert mgr.allocate_slots(c, 10, n, hits) is not None
    mgr.free(a)
    mgr.free(c)
    assert_all_free(mgr)


def test_allocate_argument_checks() -> None:
    mgr = make_manager()
    req = create_request(prompt_token_ids=list(range(40)))
    with pytest.raises(ValueError):
        mgr.allocate_slots(req, 0)
    with pytest.raises(ValueError):
        mgr.allocate_slots(req, -1)
    with pytest.raises(ValueError):
        mgr.allocate_slots(req, 8, num_new_computed_tokens=16)  # no blocks given
    mgr.check_integrity()


def test_lookahead_and_max_model_len_cap() -> None:
    mgr = make_manager(20, max_model_len=40)
    req = create_request(prompt_token_ids=list(range(30)))
    blocks = mgr.allocate_slots(req, 30, num_lookahead_tokens=40)
    # 70 slots wanted, capped at max_model_len 40 -> 3 blocks.
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 3
    mgr.free(req)
    assert_all_free(mgr)


def test_external_tokens_get_blocks_and_delay_cache() -> None:
    mgr = make_manager(10)
    req = create_request(prompt_token_ids=list(range(50)))
    # A connector will load 48 tokens asynchronously: blocks now, no compute, no hashes yet.
    blocks = mgr.allocate_slots(req, 0, num_external_computed_tokens=48, delay_cache_blocks=True)
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 3
    assert blocks.get_unhashed_block_ids() == blocks.get_block_ids()[0]
    other = create_request(prompt_token_ids=list(range(50)))
    assert mgr.get_computed_blocks(other)[1] == 0  # nothing hit while the load is in flight
    req.num_computed_tokens = 48
    mgr.cache_blocks(req, 48)  # load succeeded
    hits, n = mgr.get_computed_blocks(other)
    assert n == 48 and hits.get_block_ids() == mgr.get_block_ids(req.request_id)
    # Sync external tokens are published at allocation.
    sync = create_request(prompt_token_ids=list(range(500, 550)))
    assert mgr.allocate_slots(sync, 2, num_external_computed_tokens=48) is not None
    assert len(mgr.get_blocks(sync.request_id).get_unhashed_block_ids()) == 1
    mgr.free(req)
    mgr.free(sync)
    assert_all_free(mgr)


# -- prefix caching -----------------------------------------------------------------------


def test_prefix_hit_shares_blocks() -> None:
    mgr = make_manager(10)
    a = create_request(prompt_token_ids=list(range(40)))
    admit(mgr, a)
    b = create_request(prompt_token_ids=list(range(32)) + [999] * 10)
    hits, n = mgr.get_computed_blocks(b)
    assert n == 32 and hits.get_block_ids() == ([0, 1],)
    new = mgr.allocate_slots(b, 10, n, hits)
    assert new is not None and new.get_block_ids() == ([3],)
    assert [blk.ref_cnt for blk in mgr.block_pool.blocks[:4]] == [2, 2, 1, 1]
    mgr.check_integrity()
    stats = mgr.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 82, 32)
    assert stats.hit_rate == pytest.approx(32 / 82)
    mgr.free(a)
    mgr.free(b)
    assert_all_free(mgr)
    stats.reset()
    assert stats.queries == 0 and stats.hit_rate == 0.0


@pytest.mark.parametrize(("num_tokens", "expect_hit"), [(32, 16), (33, 32), (47, 32), (48, 32)])
def test_full_hit_recomputes_last_token(num_tokens: int, expect_hit: int) -> None:
    mgr = make_manager(10)
    a = create_request(prompt_token_ids=list(range(64)))
    admit(mgr, a)
    b = create_request(prompt_token_ids=list(range(num_tokens)))
    assert mgr.get_computed_blocks(b)[1] == expect_hit
    mgr.free(a)
    assert_all_free(mgr)


def test_free_cached_blocks_revived_and_counted_as_needed() -> None:
    mgr = make_manager(4)
    a = create_request(prompt_token_ids=list(range(64)))  # exactly 4 blocks
    admit(mgr, a)
    mgr.free(a)
    assert_all_free(mgr)
    # All 4 blocks are free but cached. A request hitting 3 of them needs 1 new block: it
    # must fit, and the new block must not be taken from the hit blocks.
    b = create_request(prompt_token_ids=list(range(63)) + [999])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 48
    new = mgr.allocate_slots(b, 16, n, hits)
    assert new is not None
    assert set(new.get_block_ids()[0]).isdisjoint(hits.get_block_ids()[0])
    mgr.check_integrity()
    mgr.free(b)
    assert_all_free(mgr)


def test_eviction_order_tail_first() -> None:
    mgr = make_manager(4)
    a = create_request(prompt_token_ids=list(range(48)))  # blocks 0,1,2 hashed
    admit(mgr, a)
    mgr.free(a)  # freed 2,1,0 after the never-used block 3
    c = create_request(prompt_token_ids=list(range(1000, 1032)))  # needs 2 blocks
    admit(mgr, c)
    # Block 3 (never used) and block 2 (a's tail) are taken; a's first two blocks survive.
    assert mgr.get_block_ids(c.request_id) == ([3, 2],)
    d = create_request(prompt_token_ids=list(range(48)) + [5])
    assert mgr.get_computed_blocks(d)[1] == 32
    mgr.free(c)
    assert_all_free(mgr)


def test_duplicate_content_blocks() -> None:
    mgr = make_manager(10)
    a = create_request(prompt_token_ids=list(range(33)))
    # a's blocks are loading (not published) while b computes the same prefix.
    mgr.allocate_slots(a, 1, num_external_computed_tokens=32, delay_cache_blocks=True)
    b = create_request(prompt_token_ids=list(range(33)))
    admit(mgr, b)
    mgr.cache_blocks(a, 32)  # now two blocks hold each hash
    assert len(mgr.block_pool.cached_blocks[b.block_hashes[0]]) == 2
    mgr.check_integrity()
    mgr.free(b)
    c = create_request(prompt_token_ids=list(range(33)))
    assert mgr.get_computed_blocks(c)[1] == 32
    mgr.free(a)
    assert_all_free(mgr)


def test_caching_disabled() -> None:
    mgr = make_manager(10, enable_caching=False)
    a = create_request(prompt_token_ids=list(range(40)))
    admit(mgr, a)
    b = create_request(prompt_token_ids=list(range(40)))
    hits, n = mgr.get_computed_blocks(b)
    assert n == 0 and hits.get_block_ids() == ([],)
    assert all(blk.block_hash is None for blk in mgr.block_pool.blocks)
    mgr.free(a)
    assert_all_free(mgr)


def test_evict_blocks() -> None:
    mgr = make_manager(10)
    a = create_request(prompt_token_ids=list(range(50)))
    admit(mgr, a)
    ids = mgr.get_block_ids(a.request_id)[0]
    mgr.evict_blocks(ids[1:])
    mgr.check_integrity()
    b = create_request(prompt_token_ids=list(range(50)))
    assert mgr.get_computed_blocks(b)[1] == 16  # stops at the first evicted block
    assert mgr.get_blocks(a.request_id).get_unhashed_block_ids() == ids[1:]
    mgr.free(a)
    assert_all_free(mgr)


def test_reset_prefix_cache() -> None:
    mgr = make_manager(10)
    a = create_request(prompt_token_ids=list(range(40)))
    admit(mgr, a)
    assert mgr.reset_prefix_cache() is False
    assert mgr.block_pool.cached_blocks
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert not mgr.block_pool.cached_blocks
    assert mgr.get_computed_blocks(create_request(prompt_token_ids=list(range(40))))[1] == 0
    assert_all_free(mgr)


def test_preempted_lookups_not_in_hit_rate() -> None:
    mgr = make_manager(10)
    a = create_request(prompt_token_ids=list(range(40)))
    admit(mgr, a)
    mgr.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    assert admit(mgr, a) is not None
    s = mgr.prefix_cache_stats
    assert (s.requests, s.queries, s.hits, s.preempted_requests) == (1, 40, 0, 1)
    mgr.free(a)
    assert_all_free(mgr)


def test_failed_allocations_not_in_stats() -> None:
    mgr = make_manager(2)
    a = create_request(prompt_token_ids=list(range(40)))  # needs 3 blocks: never fits
    for _ in range(3):
        assert admit(mgr, a) is None
    assert mgr.prefix_cache_stats.requests == 0
    b = create_request(prompt_token_ids=list(range(20)))
    assert admit(mgr, b) is not None
    new = mgr.allocate_slots(b, 1)  # growing an admitted request is not a lookup
    assert new is not None
    assert (mgr.prefix_cache_stats.requests, mgr.prefix_cache_stats.queries) == (1, 20)
    mgr.free(b)
    assert_all_free(mgr)


# -- blocks view and integrity ------------------------------------------------------------


def test_kv_cache_blocks_view() -> None:
    pool = BlockPool(4)
    b = pool.get_new_blocks(3)
    pool.cache_full_blocks(b, [b"x" * 32], 0, 1)
    x = KVCacheBlocks((b[:2],))
    y = KVCacheBlocks((b[2:],))
    assert (x + y).get_block_ids() == ([0, 1, 2],)
    assert (x + y).get_unhashed_block_ids() == [1, 2]
    assert KVCacheBlocks.empty().get_block_ids() == ([],)
    assert (x + y).num_blocks == 3


def test_check_integrity_catches_corruption() -> None:
    mgr = make_manager(6)
    a = create_request(prompt_token_ids=list(range(40)))
    admit(mgr, a)
    mgr.check_integrity()
    blk = mgr.req_to_blocks[a.request_id][0]
    blk.ref_cnt += 1  # a leaked reference
    with pytest.raises(AssertionError):
        mgr.check_integrity()
    blk.ref_cnt -= 1
    blk.block_hash = b"z" * 32  # hash map out of sync
    with pytest.raises(AssertionError):
        mgr.check_integrity()
