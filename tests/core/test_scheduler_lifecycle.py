"""The scheduler driven step by step with fake runner outputs (no model): one request from
admission to its finished id, request validation, aborts and external finishes, how runner
outputs are read, and the stats.

Every lifecycle test ends with ``assert_no_leaks``: pool invariants hold, every block is
free, and no request is left in the scheduler.
"""

from __future__ import annotations

import pytest

from kvferry.config import ConfigError
from kvferry.request import RequestStatus
from kvferry.step_types.runner_output import ModelRunnerOutput
from tests.helpers.scheduler import (
    SAMPLED_TOKEN,
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
