"""The scheduler driven step by step with fake runner outputs (no model).

Every lifecycle test ends with ``assert_no_leaks``: pool invariants hold, every block is
free, and no request is left in the scheduler.
"""

from __future__ import annotations

import random

import pytest

from kvferry.config import ConfigError
from kvferry.request import RequestStatus
from kvferry.step_types.runner_output import ModelRunnerOutput
from tests.helpers.scheduler import (
    EOS_TOKEN,
    SAMPLED_TOKEN,
    FakeWorker,
    assert_no_leaks,
    create_request,
    create_requests,
    create_scheduler,
    make_runner_output,
    run_until_done,
    step,
)

# -- basic lifecycle ----------------------------------------------------------------------


def test_single_request_lifecycle() -> None:
    s = create_scheduler()
    r = create_request(20, max_tokens=5)
    rid = r.request_id
    s.add_request(r)
    assert s.has_unfinished_requests() and s.get_num_unfinished_requests() == 1

    so, outs = step(s)
    assert so.num_scheduled_tokens == {rid: 20} and so.total_num_scheduled_tokens == 20
    (new,) = so.scheduled_new_reqs
    assert new.token_ids == r.prompt_token_ids and new.num_prompt_tokens == 20
    assert new.num_computed_tokens == 0 and new.block_ids == ([0, 1],)
    assert [(o.request_id, o.new_token_ids, o.finished) for o in outs] == [
        (rid, [SAMPLED_TOKEN], False)
    ]
    assert r.prefill_stats is not None and r.prefill_stats.num_prompt_tokens == 20
    assert r.prefill_stats.num_cached_tokens == 0

    for k in range(4):
        so, outs = step(s)
        assert so.scheduled_new_reqs == []
        assert so.scheduled_cached_reqs.req_ids == [rid]
        assert so.scheduled_cached_reqs.num_computed_tokens == [20 + k]
        assert so.num_scheduled_tokens == {rid: 1}
        assert len(outs) == 1 and outs[0].new_token_ids == [SAMPLED_TOKEN]
    assert outs[0].finish_reason == "length" and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.output_token_ids == [SAMPLED_TOKEN] * 5
    assert s.get_request(rid) is None and s.has_finished_requests()

    # The finished id reaches the workers with the next (empty) step.
    so = s.schedule()
    assert so.finished_req_ids == {rid} and so.is_empty
    assert not s.has_finished_requests()
    assert s.schedule().finished_req_ids == set()
    assert_no_leaks(s)


def test_add_request_validation() -> None:
    s = create_scheduler(max_model_len=64)
    r = create_request(10, request_id="dup")
    s.add_request(r)
    with pytest.raises(ValueError, match="already"):
        s.add_request(create_request(10, request_id="dup"))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(create_request(prompt_token_ids=[]))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(create_request(65))
    s.finish_requests("dup", RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(s)


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="chunked prefill off"):
        create_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=32)


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


# -- prefix caching -----------------------------------------------------------------------


def test_prefix_hit_between_requests() -> None:
    s = create_scheduler()
    worker = FakeWorker(s)
    a = create_request(prompt_token_ids=list(range(40)), max_tokens=4)
    s.add_request(a)
    so_a, _ = step(s, worker)
    b = create_request(prompt_token_ids=list(range(32)) + [9999] * 8, max_tokens=4)
    s.add_request(b)
    so, outs = step(s, worker)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 32 and so.num_scheduled_tokens[b.request_id] == 8
    assert new.block_ids[0][:2] == so_a.scheduled_new_reqs[0].block_ids[0][:2]
    assert b.prefill_stats is not None and b.prefill_stats.num_local_cached_tokens == 32
    out_b = next(o for o in outs if o.request_id == b.request_id)
    assert out_b.num_local_cached_tokens == 32 and out_b.num_external_cached_tokens == 0
    stats = s.make_stats()
    assert stats is not None
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)
    assert stats.prefix_cache_hit_rate == pytest.approx(0.4)
    res = run_until_done(s, worker)
    assert len(res.tokens[b.request_id]) == 3
    assert_no_leaks(s)


@pytest.mark.parametrize(("length", "expect_hit"), [(32, 16), (33, 32), (48, 32)])
def test_full_hit_recomputes_last_token(length: int, expect_hit: int) -> None:
    s = create_scheduler()
    s.add_request(create_request(prompt_token_ids=list(range(48)), max_tokens=2))
    run_until_done(s)
    b = create_request(prompt_token_ids=list(range(length)), max_tokens=2)
    s.add_request(b)
    so, outs = step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == expect_hit
    assert so.num_scheduled_tokens[b.request_id] == length - expect_hit
    assert outs[0].new_token_ids == [SAMPLED_TOKEN]  # the recomputed tail produced logits
    run_until_done(s)
    assert_no_leaks(s)


def test_cache_salt_isolates_prefixes() -> None:
    s = create_scheduler()
    prompt = list(range(40))
    s.add_request(create_request(prompt_token_ids=prompt, cache_salt="x", max_tokens=1))
    run_until_done(s)
    hits = {}
    for salt in ("y", None, "x"):
        r = create_request(prompt_token_ids=prompt, cache_salt=salt, max_tokens=1)
        s.add_request(r)
        step(s)
        assert r.prefill_stats is not None
        hits[salt] = r.prefill_stats.num_local_cached_tokens
    assert hits == {"y": 0, None: 0, "x": 32}
    assert_no_leaks(s)


def test_prefix_caching_disabled() -> None:
    s = create_scheduler(enable_prefix_caching=False)
    for _ in range(2):
        r = create_request(prompt_token_ids=list(range(40)), max_tokens=2)
        s.add_request(r)
        run_until_done(s)
        assert r.prefill_stats is not None and r.prefill_stats.num_local_cached_tokens == 0
    assert_no_leaks(s)


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


# -- aborts and external finishes ---------------------------------------------------------


def test_abort_waiting_request() -> None:
    s = create_scheduler(max_num_seqs=1)
    a, b = create_request(10, max_tokens=3), create_request(10, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert b.status == RequestStatus.WAITING
    s.finish_requests(b.request_id, RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED and s.get_request(b.request_id) is None
    so, _ = step(s)
    assert so.finished_req_ids == {b.request_id}
    res = run_until_done(s)
    assert b.request_id not in res.tokens
    assert_no_leaks(s)


def test_abort_running_mid_prefill() -> None:
    s = create_scheduler(max_num_batched_tokens=16)
    r = create_request(40)
    s.add_request(r)
    step(s)
    assert s.kv_cache_manager.get_num_free_blocks() < s.kv_cache_manager.num_blocks
    s.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    so = s.schedule()
    assert so.is_empty and so.finished_req_ids == {r.request_id}
    assert_no_leaks(s)


def test_abort_while_step_in_flight() -> None:
    s = create_scheduler()
    a, b = create_request(10), create_request(10)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    ro = make_runner_output(s, so)
    s.finish_requests(a.request_id, RequestStatus.FINISHED_ABORTED)
    outs = s.update_from_output(so, ro)
    assert [o.request_id for o in outs] == [b.request_id]
    assert a.output_token_ids == []
    s.finish_requests(b.request_id, RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(s)


def test_finish_requests_edge_cases() -> None:
    s = create_scheduler()
    r = create_request(10, max_tokens=2)
    s.add_request(r)
    step(s)
    with pytest.raises(ValueError):
        s.finish_requests(r.request_id, RequestStatus.RUNNING)
    s.finish_requests(["nope", r.request_id], RequestStatus.FINISHED_STOPPED)  # stop string
    assert r.status == RequestStatus.FINISHED_STOPPED
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)  # already finished: no-op
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert s.schedule().finished_req_ids == {r.request_id}
    assert_no_leaks(s)


# -- stop conditions ----------------------------------------------------------------------


def _run_one(token, max_model_len: int = 256, num_tokens: int = 10, **kwargs):  # type: ignore[no-untyped-def]
    s = create_scheduler(max_model_len=max_model_len)
    r = create_request(num_tokens, **kwargs)
    s.add_request(r)
    res = run_until_done(s, token=token)
    assert_no_leaks(s)
    return (
        res.tokens[r.request_id],
        res.finish_reasons[r.request_id],
        res.stop_reasons[r.request_id],
    )


def test_stop_on_eos() -> None:
    toks, reason, stop = _run_one(lambda rid, i: EOS_TOKEN if i == 2 else 7)
    assert (toks, reason, stop) == ([7, 7, EOS_TOKEN], "stop", None)


def test_ignore_eos() -> None:
    toks, reason, _ = _run_one(EOS_TOKEN, ignore_eos=True, max_tokens=5)
    assert (toks, reason) == ([EOS_TOKEN] * 5, "length")


def test_min_tokens_holds_back_eos_and_stop_tokens() -> None:
    toks, reason, _ = _run_one(EOS_TOKEN, min_tokens=3)
    assert (toks, reason) == ([EOS_TOKEN] * 3, "stop")
    toks, reason, stop = _run_one(42, min_tokens=2, stop_token_ids=[42])
    assert (toks, reason, stop) == ([42, 42], "stop", 42)


def test_stop_token_ids() -> None:
    toks, reason, stop = _run_one(lambda rid, i: 42 if i == 1 else 7, stop_token_ids=[42])
    assert (toks, reason, stop) == ([7, 42], "stop", 42)


def test_max_tokens() -> None:
    assert _run_one(7, max_tokens=4)[:2] == ([7] * 4, "length")


def test_max_model_len_caps_output() -> None:
    toks, reason, _ = _run_one(7, max_model_len=32, num_tokens=30, max_tokens=None)
    assert (toks, reason) == ([7, 7], "length")
    # A prompt of exactly max_model_len still yields one token.
    toks, reason, _ = _run_one(7, max_model_len=32, num_tokens=32, max_tokens=None)
    assert (toks, reason) == ([7], "length")


def test_tokens_after_a_stop_are_dropped() -> None:
    s = create_scheduler()
    r = create_request(10)
    s.add_request(r)
    so = s.schedule()
    ro = ModelRunnerOutput(req_ids=[r.request_id], sampled_token_ids=[[7, EOS_TOKEN, 7]])
    (out,) = s.update_from_output(so, ro)
    assert out.new_token_ids == [7, EOS_TOKEN] and out.finish_reason == "stop"
    assert_no_leaks(s)


# -- runner output handling, stats --------------------------------------------------------


def test_partial_chunk_never_appends_and_logprobs_pass_through() -> None:
    s = create_scheduler(max_num_batched_tokens=8)
    r = create_request(10, max_tokens=2)
    s.add_request(r)
    so = s.schedule()
    # A misbehaving runner samples on a partial chunk: ignored.
    outs = s.update_from_output(so, ModelRunnerOutput([r.request_id], [[7]], [None]))
    assert outs == [] and r.output_token_ids == []
    so = s.schedule()
    lp = [{7: -0.5, 3: -1.5}]
    (out,) = s.update_from_output(so, ModelRunnerOutput([r.request_id], [[7]], [lp]))
    assert out.new_token_ids == [7] and out.new_logprobs == lp and r.output_logprobs == lp
    # A request missing from the runner output (e.g. nothing sampled) yields nothing.
    so = s.schedule()
    assert s.update_from_output(so, ModelRunnerOutput()) == []
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(s)


def test_make_stats() -> None:
    assert create_scheduler(log_stats=False).make_stats() is None
    s = create_scheduler(max_num_seqs=1, num_blocks=10)
    for r in create_requests(2, 20):
        s.add_request(r)
    step(s)
    stats = s.make_stats()
    assert stats is not None
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(0.2)
    assert stats.num_preemptions == 0
    run_until_done(s)
    assert s.reset_prefix_cache() is True
    s.shutdown()
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
