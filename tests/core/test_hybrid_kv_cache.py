"""Hybrid KV cache groups (full attention + sliding window) in the real scheduler, step by
step: sliding-window blocks given back once no window reads them, block usage bounded by the
window, prefix hits every group can serve, budgets over both groups, preemption, and a
randomized soak whose fake worker checks the KV every window reads. Lifecycle tests end
with ``assert_no_leaks`` (both groups)."""

from __future__ import annotations

import random

import pytest

from kvferry.core.scheduler import Scheduler
from kvferry.request import Request, RequestStatus
from tests.helpers.hybrid import KVContentWorker
from tests.helpers.scheduler import (
    FakeWorker,
    assert_no_leaks,
    create_request,
    create_scheduler,
    make_runner_output,
    run_until_done,
    step,
)

BS = 4
WINDOW = 6  # a token reads itself and the 5 before: 2 or 3 blocks of 4


def _sched(num_blocks: int = 64, **kw: object) -> Scheduler:
    args: dict[str, object] = {"block_size": BS, "num_blocks": num_blocks, "max_model_len": 256,
                               "sliding_window": WINDOW}  # fmt: skip
    args.update(kw)
    return create_scheduler(**args)  # type: ignore[arg-type]


def _tables(s: Scheduler, req: Request) -> tuple[list[int], list[int]]:
    full, sliding = s.kv_cache_manager.get_block_ids(req.request_id)
    return full, sliding


def _held_sliding(s: Scheduler, req: Request) -> int:
    return s.kv_cache_manager.managers[1].get_num_held_blocks(req.request_id)


def _null(s: Scheduler) -> int:
    null = s.kv_cache_manager.block_pool.null_block
    assert null is not None
    return null.block_id


def test_hybrid_config_makes_two_groups_and_a_null_block() -> None:
    s = _sched(num_blocks=10)
    kvm = s.kv_cache_manager
    assert kvm.num_groups == 2 and [m.spec.sliding_window for m in kvm.managers] == [None, 6]
    assert kvm.num_usable_blocks == 9 and kvm.get_num_free_blocks() == 9
    assert _null(s) not in [b.block_id for b in kvm.block_pool.free_queue.blocks()]


def test_sliding_group_gives_back_blocks_outside_the_window() -> None:
    s = _sched(max_num_batched_tokens=8)
    req = create_request(30, block_size=BS, max_tokens=12, ignore_eos=True)
    s.add_request(req)
    worker = KVContentWorker(s)
    null = _null(s)
    while s.has_unfinished_requests():
        computed = req.num_computed_tokens
        step(s, worker)
        if req.is_finished():
            break
        full, sliding = _tables(s, req)
        assert len(full) == len(sliding)
        assert null not in full
        # Allocating for the step nulled exactly the blocks wholly before the window of its
        # first token.
        first = max(0, computed - WINDOW + 1) // BS
        assert sliding[:first] == [null] * first
        assert null not in sliding[first:]
        # A chunk of up to 8 tokens reads 5 more: at most ceil(13 / 4) + 1 blocks.
        assert _held_sliding(s, req) <= 5
    assert worker.checked_positions > 0
    assert_no_leaks(s)


def test_decode_block_usage_is_bounded_by_the_window() -> None:
    s = _sched()
    req = create_request(10, block_size=BS, max_tokens=60, ignore_eos=True)
    s.add_request(req)
    worker = KVContentWorker(s)
    most = 0
    while not req.is_finished():
        step(s, worker)
        most = max(most, _held_sliding(s, req))
        full_blocks = s.kv_cache_manager.managers[0].get_num_held_blocks(req.request_id)
        if not req.is_finished():
            assert full_blocks == -(-req.num_computed_tokens // BS)
    # The window of 6 spans at most 3 blocks of 4, and the block being filled is one of them.
    assert most == 3
    assert_no_leaks(s)


def test_admission_counts_the_blocks_of_both_groups() -> None:
    # A 12-token prompt needs 3 full + 3 sliding blocks in its first step (it computes all
    # its tokens at once); 5 usable blocks are not enough, 6 are.
    for usable, admitted in ((5, False), (6, True)):
        s = _sched(num_blocks=usable + 1)
        req = create_request(12, block_size=BS, max_tokens=1)
        s.add_request(req)
        so = s.schedule()
        assert (req.request_id in so.num_scheduled_tokens) is admitted
        assert s.kv_cache_manager.get_num_free_blocks() == (0 if admitted else usable)
        s.update_from_output(so, make_runner_output(s, so))
        if admitted:
            assert_no_leaks(s)


def test_prefix_hit_covers_what_both_groups_serve() -> None:
    s = _sched(max_num_batched_tokens=64)
    prompt = list(range(1000, 1030))  # 7 full blocks and 2 tokens
    a = create_request(prompt_token_ids=prompt, block_size=BS, max_tokens=1)
    s.add_request(a)
    worker = KVContentWorker(s)
    run_until_done(s, worker)
    b = create_request(prompt_token_ids=prompt + [5, 6, 7], block_size=BS, max_tokens=4)
    s.add_request(b)
    so, _ = step(s, worker)
    # All 7 full blocks hit in both groups (a's freed sliding blocks kept their content);
    # the sliding table holds only the blocks the window of token 28 reads.
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 28
    full, sliding = new.block_ids
    first = (28 - WINDOW + 1) // BS  # 5
    assert sliding[:first] == [_null(s)] * first and _null(s) not in sliding[first:]
    assert s.kv_cache_manager.prefix_cache_stats.hits == 28
    run_until_done(s, worker)
    assert worker.checked_positions > 0
    assert_no_leaks(s)


def test_prefix_hit_shortened_to_where_the_sliding_window_is_cached() -> None:
    s = _sched(max_num_batched_tokens=64)
    prompt = list(range(2000, 2030))
    a = create_request(prompt_token_ids=prompt, block_size=BS, max_tokens=1)
    s.add_request(a)
    worker = KVContentWorker(s)
    run_until_done(s, worker)
    kvm = s.kv_cache_manager
    # Drop the sliding group's copy of block 5 (tokens 20..23): a hit of 7 blocks needs
    # blocks 5 and 6 of the window, a hit of 6 blocks needs blocks 4 and 5; 5 blocks need
    # blocks 3 and 4, all cached.
    hashes = a.block_hashes
    sliding_block = kvm.block_pool.get_cached_block(hashes[5], group_id=1)
    assert sliding_block is not None
    kvm.evict_blocks([sliding_block.block_id])
    assert kvm.block_pool.get_cached_block(hashes[5], group_id=0) is not None
    b = create_request(prompt_token_ids=prompt + [9], block_size=BS, max_tokens=2)
    s.add_request(b)
    so, _ = step(s, worker)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20
    run_until_done(s, worker)
    assert_no_leaks(s)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_and_resume_on_a_hybrid_pool(caching: bool) -> None:
    # 12 usable blocks; two requests admitted with 2 + 2 blocks each, growing to 30 tokens:
    # 8 + 3 blocks each.
    s = _sched(num_blocks=13, enable_prefix_caching=caching, max_num_batched_tokens=32)
    reqs = [create_request(6, block_size=BS, max_tokens=24, ignore_eos=True) for _ in range(2)]
    for r in reqs:
        s.add_request(r)
    worker = KVContentWorker(s)
    result = run_until_done(s, worker)
    assert s.num_preemptions > 0
    assert all(len(result.tokens[r.request_id]) == 24 for r in reqs)
    assert_no_leaks(s)


def test_integrity_check_covers_the_sliding_group() -> None:
    s = _sched()
    req = create_request(20, block_size=BS, max_tokens=4)
    s.add_request(req)
    step(s, FakeWorker(s))
    block = s.kv_cache_manager.managers[1].req_to_blocks[req.request_id][-1]
    block.ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        s.check_integrity()
    block.ref_cnt -= 1
    s.kv_cache_manager.managers[1].req_to_blocks[req.request_id].pop()
    with pytest.raises(AssertionError):
        s.check_integrity()


def test_randomized_soak_keeps_every_window_intact() -> None:
    """Shared prefixes, chunking, preemption and aborts on a tight hybrid pool; the worker
    checks the KV of every position each step reads, in both groups."""
    rng = random.Random(17)
    s = _sched(num_blocks=40, max_num_batched_tokens=24, max_num_seqs=6)
    worker = KVContentWorker(s)
    prefixes = [[rng.randrange(10, 500) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    pending = []
    for _ in range(40):
        prompt = rng.choice(prefixes) + [
            rng.randrange(10, 500) for _ in range(rng.randrange(1, 20))
        ]
        pending.append(create_request(prompt_token_ids=prompt, block_size=BS,
                                      max_tokens=rng.randrange(1, 25), ignore_eos=True))  # fmt: skip
    steps = 0
    while pending or s.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                s.add_request(pending.pop())
        if s.has_unfinished_requests():
            step(s, worker)
        if rng.random() < 0.05 and s.running:
            s.finish_requests([rng.choice(s.running).request_id], RequestStatus.FINISHED_ABORTED)
        steps += 1
        assert steps < 3000
    assert s.num_preemptions > 0 and worker.checked_positions > 1000
    assert s.kv_cache_manager.prefix_cache_stats.hits > 0
    assert_no_leaks(s)
