"""KV cache events of a hybrid pool (a full-attention group and a sliding-window group),
driven through the real scheduler: every group's blocks are announced under the group's
``group_idx``, attention type and window, with the request's block hashes; a sliding
group's blocks that left the window are withdrawn for that group alone when they are
evicted; a set-keeping subscriber per group always matches the pool.
"""

from __future__ import annotations

from typing import Any

from kvferry.core.block_pool import BlockPool
from kvferry.kv_events import (
    KV_CACHE_SPEC_FULL_ATTENTION,
    KV_CACHE_SPEC_SLIDING_WINDOW,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    external_block_hash,
)
from kvferry.request import Request
from tests.helpers.scheduler import (
    FakeWorker,
    assert_no_leaks,
    create_request,
    run_until_done,
    step,
)
from tests.kv_events.source_helpers import BS, HashIndex, events_scheduler, ext, gpu_hashes, stored

WINDOW = 20  # a token reads itself and the 19 before it: two blocks of 16 at most


def _hybrid(**kw: Any) -> tuple[Any, Any]:
    return events_scheduler(sliding_window=WINDOW, **kw)


def _both(request: Request, start: int, end: int) -> list[BlockStored]:
    """What the pool announces when it caches blocks [start, end) in both groups."""
    return [stored(request, start, end), stored(request, start, end, group_idx=1, window=WINDOW)]


def _removed(events: list[Any], group_idx: int) -> set[Any]:
    return {
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.group_idx == group_idx
        for h in e.block_hashes
    }


def test_both_groups_announce_their_blocks_with_kind_window_and_the_requests_hashes() -> None:
    s, pub = _hybrid(max_num_batched_tokens=32)
    a = create_request(48, max_tokens=1)
    s.add_request(a)
    step(s)  # 32 prompt tokens: blocks 0 and 1 of each group
    first = pub.take()
    assert first == _both(a, 0, 2)
    full, sliding = first
    assert (full.group_idx, full.kv_cache_spec_kind, full.kv_cache_spec_sliding_window) == (
        0,
        KV_CACHE_SPEC_FULL_ATTENTION,
        None,
    )
    assert (sliding.group_idx, sliding.kv_cache_spec_kind) == (1, KV_CACHE_SPEC_SLIDING_WINDOW)
    assert sliding.kv_cache_spec_sliding_window == WINDOW
    # The same content has the same hash in every group: the request's block hashes.
    assert full.block_hashes == sliding.block_hashes == ext(a, 0, 1)
    step(s)  # the last 16: block 2 of each group, chained to block 1
    assert pub.take() == _both(a, 2, 3)
    run_until_done(s)
    for group in (0, 1):
        assert gpu_hashes(s, group) == set(ext(a, 0, 1, 2))
    assert_no_leaks(s)


def test_sliding_blocks_that_left_the_window_are_withdrawn_for_their_group_on_eviction() -> None:
    # 15 usable blocks: a's prompt takes 6 per group, 3 stay unused.
    s, pub = _hybrid(num_blocks=16, max_num_batched_tokens=32)
    index = HashIndex()
    a = create_request(96, max_tokens=1)
    s.add_request(a)
    run_until_done(s)
    events = pub.take()
    index.apply(events)
    assert not [e for e in events if isinstance(e, BlockRemoved)]  # freed is not evicted
    # Blocks 0 and 1 left the window during the prefill: given back to the pool, still cached.
    assert index.of(MEDIUM_GPU, 1) == gpu_hashes(s, 1) == set(ext(a, *range(6)))
    # New prompts take the unused blocks, then the oldest free ones: a's early sliding blocks.
    removed: list[Any] = []
    while ext(a, 0)[0] not in _removed(removed, 1):
        s.add_request(create_request(32, max_tokens=1))
        run_until_done(s)
        events = pub.take()
        index.apply(events)
        removed += events
        for group in (0, 1):
            assert index.of(MEDIUM_GPU, group) == gpu_hashes(s, group)
    assert BlockRemoved(block_hashes=ext(a, 0), medium=MEDIUM_GPU, group_idx=1) in removed
    # The full-attention copy of the same content is untouched: announced, still cached.
    assert ext(a, 0)[0] not in _removed(removed, 0)
    assert ext(a, 0)[0] in index.of(MEDIUM_GPU, 0) and ext(a, 0)[0] in gpu_hashes(s, 0)
    assert_no_leaks(s)


def test_a_subscriber_per_group_matches_the_pool_through_hits_and_preemption() -> None:
    s, pub = _hybrid(num_blocks=16, max_num_batched_tokens=64, max_model_len=128)
    worker = FakeWorker(s)
    index = HashIndex()
    system = list(range(7000, 7040))
    for i in range(10):
        tail = list(range(100 * i, 100 * i + 10 + 7 * i))
        s.add_request(create_request(prompt_token_ids=system + tail, max_tokens=12))
    while s.has_requests():
        step(s, worker)
        index.apply(pub.take())
        for group in (0, 1):
            assert index.of(MEDIUM_GPU, group) == gpu_hashes(s, group)
    assert s.num_preemptions > 0  # the pool was tight: evictions and preemptions happened
    assert index.of(MEDIUM_GPU, 1)  # the sliding group published too
    assert_no_leaks(s)


def test_a_null_block_ends_a_run_of_announced_blocks() -> None:
    pool = BlockPool(
        8,
        enable_kv_cache_events=True,
        block_size=BS,
        num_groups=2,
        reserve_null_block=True,
        group_event_specs=[
            (KV_CACHE_SPEC_FULL_ATTENTION, None),
            (KV_CACHE_SPEC_SLIDING_WINDOW, 20),
        ],
    )
    blocks = pool.get_new_blocks(3)
    null = pool.null_block
    assert null is not None
    hashes = [bytes([i]) * 32 for i in range(4)]
    tokens = list(range(4 * BS))
    table = [blocks[0], null, blocks[1], blocks[2]]
    pool.cache_full_blocks(table, hashes, 0, 4, tokens, group_id=1)
    first, second = pool.take_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == [external_block_hash(hashes[0])]
    assert first.token_ids == tokens[:BS] and first.parent_block_hash is None
    assert second.block_hashes == [external_block_hash(h) for h in hashes[2:]]
    assert second.token_ids == tokens[2 * BS :]
    assert second.parent_block_hash == external_block_hash(hashes[1])
    assert {first.group_idx, second.group_idx} == {1}
    assert second.kv_cache_spec_sliding_window == 20
    # Eviction withdraws each hash from the group that held it.
    pool.free_blocks(blocks)
    pool.get_new_blocks(7)
    (removed,) = pool.take_events()
    assert removed == BlockRemoved(
        block_hashes=[external_block_hash(hashes[i]) for i in (0, 2, 3)],
        medium=MEDIUM_GPU,
        group_idx=1,
    )
    pool.check_integrity()
