"""Preemption in the scheduler (no model): who is preempted, how a resumed request is sent
again in full, and a randomized soak of prefixes, salts, chunking, preemption and aborts.

Every lifecycle test ends with ``assert_no_leaks``: pool invariants hold, every block is
free, and no request is left in the scheduler.
"""

from __future__ import annotations

import random

import pytest

from kvferry.request import RequestStatus
from tests.helpers.scheduler import (
    SAMPLED_TOKEN,
    FakeWorker,
    assert_no_leaks,
    create_request,
    create_scheduler,
    run_until_done,
    step,
)

# -- preemption ---------------------------------------------------------------------------


def test_preempts_last_admitted_and_resumes() -> None:
    # 3 blocks of 4 tokens; each request fills one block with its prompt.
    s = create_scheduler(block_size=4, num_blocks=3, max_model_len=32)
    reqs = [create_request(4, block_size=4, max_tokens=3) for _ in range(3)]
    a, b, c = reqs
    for r in reqs:
        s.add_request(r)
    worker = FakeWorker(s)
    so, _ = step(s, worker)
    assert so.num_scheduled_tokens == {r.request_id: 4 for r in reqs}
    # a needs a second block: c (last admitted) goes; then b needs one and preempts itself.
    so, outs = step(s, worker)
    assert so.num_scheduled_tokens == {a.request_id: 1}
    assert so.preempted_req_ids == {b.request_id, c.request_id}
    assert [o.request_id for o in outs] == [a.request_id]
    assert [r.request_id for r in s.waiting] == [b.request_id, c.request_id]
    assert b.status == c.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    stats = s.make_stats()
    assert stats is not None and stats.num_preemptions == 2
    res = run_until_done(s, worker)
    # Every request still gets exactly its tokens, each once.
    for r in reqs:
        assert r.output_token_ids == [SAMPLED_TOKEN] * 3
    assert len(res.tokens[b.request_id]) == 2  # its first token came before the preemption
    assert_no_leaks(s)


def test_preemption_resume_sends_full_state() -> None:
    s = create_scheduler(block_size=4, num_blocks=7, max_model_len=64)
    a = create_request(8, block_size=4, max_tokens=12)
    b = create_request(8, block_size=4, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    token = lambda rid, i: 1000 + i  # noqa: E731
    res = run_until_done(s, FakeWorker(s, token=token))
    preempted = [i for i, so in enumerate(res.sched_outputs) if so.preempted_req_ids]
    assert preempted and all(
        res.sched_outputs[i].preempted_req_ids == {b.request_id} for i in preempted
    )
    # The preemption step admits nobody; b comes back as a new request with everything.
    first = preempted[0]
    assert not res.sched_outputs[first].scheduled_new_reqs
    resumed = [
        nr
        for so in res.sched_outputs[first + 1 :]
        for nr in so.scheduled_new_reqs
        if nr.req_id == b.request_id
    ]
    assert len(resumed) == 1
    nr = resumed[0]
    n_out = len(nr.token_ids) - 8
    assert nr.token_ids == b.prompt_token_ids + [1000 + i for i in range(n_out)] and n_out > 0
    assert nr.num_computed_tokens % 4 == 0 and nr.num_computed_tokens < len(nr.token_ids)
    assert len(nr.block_ids[0]) * 4 >= len(nr.token_ids)
    expected = [1000 + i for i in range(12)]
    assert res.tokens == {a.request_id: expected, b.request_id: expected}
    assert b.num_preemptions == 1 and res.finish_reasons[b.request_id] == "length"
    assert_no_leaks(s)


# -- randomized soak ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload(seed: int) -> None:
    """Shared prefixes, salts, chunking, preemption and aborts all at once; the fake worker
    checks every plan against its own mirror, and the pool is checked after every step."""
    rng = random.Random(seed)
    s = create_scheduler(
        block_size=4, num_blocks=24, max_num_batched_tokens=20, max_num_seqs=6, max_model_len=64
    )
    worker = FakeWorker(s)
    bases = [[rng.randrange(50, 90) for _ in range(40)] for _ in range(3)]
    expected: dict[str, int] = {}
    aborted: set[str] = set()
    res_tokens: dict[str, list[int]] = {}
    for i in range(300):
        if i < 200 and rng.random() < 0.3:
            n = rng.randrange(1, 41)
            prompt = rng.choice(bases)[:n] if rng.random() < 0.7 else [rng.randrange(90, 99)] * n
            r = create_request(
                prompt_token_ids=prompt,
                block_size=4,
                max_tokens=rng.randrange(1, 20),
                ignore_eos=True,
                cache_salt=rng.choice([None, None, "t"]),
            )
            s.add_request(r)
            expected[r.request_id] = r.sampling_params.max_tokens or 0
        if s.running and rng.random() < 0.03:
            victim = rng.choice(s.running + list(s.waiting)).request_id
            s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        _, outs = step(s, worker)
        for o in outs:
            res_tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    while s.has_unfinished_requests():
        _, outs = step(s, worker)
        for o in outs:
            res_tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    stats = s.make_stats()
    # The workload really exercised what it claims to.
    assert stats is not None and stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert aborted
    for rid, n in expected.items():
        if rid not in aborted:
            assert res_tokens[rid] == [SAMPLED_TOKEN] * n, rid
    assert_no_leaks(s)
