"""The scheduler's step budget (no model): the token budget, ``max_num_seqs``, chunked prefill
and FCFS order when prefills are not split.

Every lifecycle test ends with ``assert_no_leaks``: pool invariants hold, every block is
free, and no request is left in the scheduler.
"""

from __future__ import annotations

from tests.helpers.scheduler import (
    SAMPLED_TOKEN,
    assert_no_leaks,
    create_request,
    create_requests,
    create_scheduler,
    run_until_done,
    step,
)

# -- token budget, max_num_seqs, chunking -------------------------------------------------


def test_chunked_prefill_over_several_steps() -> None:
    s = create_scheduler(max_num_batched_tokens=32)
    r = create_request(100, max_tokens=3)
    rid = r.request_id
    s.add_request(r)
    scheduled, positions, new_blocks, outputs = [], [], [], []
    while s.has_unfinished_requests():
        so, outs = step(s)
        scheduled.append(so.num_scheduled_tokens[rid])
        if so.scheduled_cached_reqs.num_reqs:
            positions.append(so.scheduled_cached_reqs.num_computed_tokens[0])
            new_blocks.append(so.scheduled_cached_reqs.new_block_ids[0])
        else:
            new_blocks.append(so.scheduled_new_reqs[0].block_ids)
        outputs.append([o.new_token_ids for o in outs])
    assert scheduled == [32, 32, 32, 4, 1, 1]
    assert positions == [32, 64, 96, 100, 101]
    # Partial chunks produce no output at all; the last chunk samples the first token.
    assert outputs == [[], [], [], [[7]], [[7]], [[7]]]
    assert new_blocks == [([0, 1],), ([2, 3],), ([4, 5],), ([6],), None, None]
    assert_no_leaks(s)


def test_running_first_then_waiting_within_budget() -> None:
    s = create_scheduler(max_num_batched_tokens=32)
    a, b, c = create_request(10), create_request(40), create_request(20)
    s.add_request(a)
    s.add_request(b)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 10, b.request_id: 22}
    s.add_request(c)
    so, outs = step(s)
    # Running first (a's decode, b's rest of prefill), then the newcomer gets what is left.
    assert list(so.num_scheduled_tokens.items()) == [
        (a.request_id, 1),
        (b.request_id, 18),
        (c.request_id, 13),
    ]
    assert {o.request_id for o in outs} == {a.request_id, b.request_id}
    run_until_done(s)
    assert_no_leaks(s)


def test_max_num_seqs() -> None:
    s = create_scheduler(max_num_seqs=2)
    reqs = create_requests(4, 10, max_tokens=3)
    for r in reqs:
        s.add_request(r)
    res = run_until_done(s)
    assert all(len(so.num_scheduled_tokens) <= 2 for so in res.sched_outputs)
    assert list(res.sched_outputs[0].num_scheduled_tokens) == [r.request_id for r in reqs[:2]]
    assert res.tokens == {r.request_id: [SAMPLED_TOKEN] * 3 for r in reqs}
    assert_no_leaks(s)


def test_prefill_waits_without_chunking() -> None:
    s = create_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    a = create_request(60, max_tokens=3)
    b = create_request(10, max_tokens=3)
    c = create_request(3, max_tokens=3)
    for r in (a, b, c):
        s.add_request(r)
    so, _ = step(s)
    # b does not fit the 4 tokens left and is not split; c may not overtake it (FCFS).
    assert so.num_scheduled_tokens == {a.request_id: 60}
    so, _ = step(s)
    assert so.num_scheduled_tokens == {a.request_id: 1, b.request_id: 10, c.request_id: 3}
    run_until_done(s)
    assert_no_leaks(s)
