"""The scheduler's side of the KV-connector protocol when requests finish or are preempted,
without a model: blocks held through aborts mid-load and delayed frees, the params handed
back, lookups again after preemption, and pending frees instead of preemption.

A scripted scheduler-role connector answers lookups and ``request_finished`` as each scenario
says and records every call; the tests hand-make the workers' ``KVConnectorOutput``s. Every
lifecycle test ends with ``assert_no_leaks`` once all transfers have been reported.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvferry.request import RequestStatus
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from tests.helpers.connector_setup import setup
from tests.helpers.scheduler import (
    assert_no_leaks,
    create_request,
    drive,
    out_of,
    run_until_done,
    step,
    table,
)
from tests.helpers.transfer_sim import TransferSim

# -- finishing and freeing ----------------------------------------------------------------


def test_abort_mid_load_keeps_blocks_until_finished_recving() -> None:
    s, conn, worker = setup()
    a = create_request(60)
    conn.external[a.request_id] = (48, True)
    s.add_request(a)
    step(s, worker)
    free = s.kv_cache_manager.get_num_free_blocks()
    (out,) = s.finish_requests(a.request_id, RequestStatus.FINISHED_ABORTED)
    assert out.finish_reason == "abort" and out.new_token_ids == []
    assert conn.finished == [(a.request_id, RequestStatus.FINISHED_ABORTED, table(s, a))]
    # The transfer may still write into the blocks: they stay until it reports.
    assert s.kv_cache_manager.get_num_free_blocks() == free and s.get_request(a.request_id)
    assert s.get_num_unfinished_requests() == 0 and s.has_unfinished_requests()
    so, _ = step(s, worker)
    assert so.finished_req_ids == {a.request_id} and so.is_empty
    step(s, worker, kv_output=KVConnectorOutput(finished_recving={a.request_id}))
    assert_no_leaks(s)

    # Aborted after the load reported but before promotion: freed at once.
    b = create_request(60)
    conn.external[b.request_id] = (48, True)
    s.add_request(b)
    step(s, worker, kv_output=TransferSim(conn))
    s.finish_requests(b.request_id, RequestStatus.FINISHED_ABORTED)
    assert s.get_request(b.request_id) is None
    step(s, worker)
    assert_no_leaks(s)


def test_delayed_free_until_finished_sending() -> None:
    s, conn, worker = setup()
    a = create_request(20, max_tokens=1)
    conn.delay_free.add(a.request_id)
    conn.params_for.add(a.request_id)
    s.add_request(a)
    _, outs = step(s, worker)
    out = out_of(outs, a)
    assert out.finish_reason == "length"
    assert out.kv_transfer_params == {"remote_block_ids": table(s, a)}
    assert a.request_id in s.requests and len(table(s, a)) == 2
    assert s.has_unfinished_requests() and not s.running
    stats = s.make_stats()
    assert stats is not None and stats.num_held_by_connector == 1
    assert s.finish_requests(a.request_id, RequestStatus.FINISHED_ABORTED) == []  # no-op
    so, outs = step(s, worker)
    assert so.finished_req_ids == {a.request_id} and so.is_empty and outs == []
    assert so.kv_connector_metadata is not None
    step(s, worker, kv_output=KVConnectorOutput(finished_sending={a.request_id}))
    assert_no_leaks(s)


def test_finish_requests_returns_kv_transfer_params() -> None:
    s, conn, worker = setup()
    a = create_request(20, max_tokens=8)
    conn.params_for.add(a.request_id)
    s.add_request(a)
    step(s, worker)
    # e.g. a stop string found by the engine's detokenizer
    (out,) = s.finish_requests([a.request_id, "unknown"], RequestStatus.FINISHED_STOPPED)
    assert out.finish_reason == "stop" and out.kv_transfer_params == {"remote_block_ids": [0, 1]}
    assert s.get_request(a.request_id) is None
    step(s, worker)
    assert_no_leaks(s)


# -- preemption ---------------------------------------------------------------------------


def test_preempted_requests_are_looked_up_again() -> None:
    s, conn, worker = setup(block_size=4, num_blocks=3, max_model_len=32)
    reqs = [create_request(4, block_size=4, max_tokens=3) for _ in range(3)]
    for r in reqs:
        s.add_request(r)
    step(s, worker)
    so, _ = step(s, worker)
    assert so.preempted_req_ids == {reqs[1].request_id, reqs[2].request_id}
    run_until_done(s, worker)
    lookups = Counter(rid for rid, _ in conn.lookups)
    allocs = Counter(rid for rid, _, _ in conn.allocs)
    for r in reqs:
        # Asked again after each preemption (and after each admission that found no room).
        assert allocs[r.request_id] == 1 + r.num_preemptions <= lookups[r.request_id]
    assert reqs[1].num_preemptions > 0
    assert all(n % 4 == 0 for _, n in conn.lookups)  # always asked at a block boundary
    assert_no_leaks(s)


@pytest.mark.parametrize("pending_frees", [True, False])
def test_pending_block_frees_wait_instead_of_preempting(pending_frees: bool) -> None:
    s, conn, worker = setup(block_size=4, num_blocks=3, max_model_len=12)
    conn.pending_block_frees = pending_frees
    d = create_request(4, block_size=4, max_tokens=1)
    a = create_request(8, block_size=4, max_tokens=3)
    conn.delay_free.add(d.request_id)
    s.add_request(d)
    s.add_request(a)
    sim = TransferSim(conn, delay=2)
    step(s, worker, kv_output=sim)  # d finishes, its free is delayed; a has 2 blocks
    so, _ = step(s, worker, kv_output=sim)  # a needs a 3rd block, d still holds one
    assert so.is_empty
    if pending_frees:
        assert not so.preempted_req_ids and a.status == RequestStatus.RUNNING
        assert a.num_computed_tokens == 8
    else:
        assert so.preempted_req_ids == {a.request_id}
    final = drive(s, worker, sim)
    assert final[a.request_id].finish_reason == "length" and len(a.output_token_ids) == 3
    assert_no_leaks(s)
