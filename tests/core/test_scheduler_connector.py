"""The scheduler's side of the KV-connector protocol, driven step by step without a model.

A scripted scheduler-role connector answers lookups and ``request_finished`` as each scenario
says and records every call; the tests hand-make the workers' ``KVConnectorOutput``s. Every
lifecycle test ends with ``assert_no_leaks`` once all transfers have been reported.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, cast

import pytest

from kvferry.config import ConfigError
from kvferry.core.connector_state import apply_partial_tail_rule
from kvferry.core.outputs import EngineCoreOutput
from kvferry.core.scheduler import Scheduler
from kvferry.kv_transfer.aggregator import KVOutputAggregator
from kvferry.kv_transfer.base import KVConnectorStats
from kvferry.request import Request, RequestStatus
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from tests.helpers.scheduler import (
    BLOCK_SIZE,
    FakeWorker,
    assert_no_leaks,
    create_request,
    create_scheduler,
    drive,
    is_cached,
    out_of,
    run_until_done,
    step,
    table,
)
from tests.helpers.scripted_connector import ScriptedConnector, ScriptedMeta
from tests.helpers.transfer_sim import RandomTransfers, TransferSim, bad_block

WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


def setup(policy: str = "fail", **kwargs: Any) -> tuple[Scheduler, ScriptedConnector, FakeWorker]:
    conn = ScriptedConnector()
    s = create_scheduler(connector=conn, kv_load_failure_policy=policy, **kwargs)
    return s, conn, FakeWorker(s)


# -- admission ----------------------------------------------------------------------------


def test_sync_hit_on_top_of_local_hit() -> None:
    s, conn, worker = setup()
    a = create_request(40, max_tokens=2)
    s.add_request(a)
    run_until_done(s, worker)
    b = create_request(prompt_token_ids=a.prompt_token_ids[:32] + list(range(500, 530)))
    conn.external[b.request_id] = (48, False)
    s.add_request(b)
    so, outs = step(s, worker)
    # The connector is asked beyond the (block-aligned) local hit and adds 16 tokens.
    assert conn.lookups[-1] == (b.request_id, 32)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 48 and so.num_scheduled_tokens == {b.request_id: 14}
    assert so.has_sync_kv_loads
    assert conn.allocs[-1] == (b.request_id, table(s, b), 16)
    assert cast(ScriptedMeta, so.kv_connector_metadata).loads == [(b.request_id, 16)]
    # Sync loads land before this step's forward, so their blocks are published right away.
    assert all(is_cached(s, bid) for bid in table(s, b)[:3])
    out = out_of(outs, b)
    assert (out.num_local_cached_tokens, out.num_external_cached_tokens) == (32, 16)
    stats = s.make_stats()
    assert stats is not None
    assert (stats.connector_prefix_cache_queries, stats.connector_prefix_cache_hits) == (70, 16)
    run_until_done(s, worker)
    assert [(rid, st) for rid, st, _ in conn.finished] == [
        (a.request_id, RequestStatus.FINISHED_LENGTH_CAPPED),
        (b.request_id, RequestStatus.FINISHED_LENGTH_CAPPED),
    ]
    assert_no_leaks(s)


def test_async_hit_lifecycle_and_no_spurious_prefix_hits() -> None:
    s, conn, worker = setup()
    a = create_request(60, max_tokens=2)
    conn.external[a.request_id] = (48, True)
    s.add_request(a)
    so, outs = step(s, worker)
    assert so.is_empty and not so.has_sync_kv_loads and outs == []
    assert a.status == WAITING_FOR_REMOTE_KVS and a.num_computed_tokens == 48
    assert list(s.kv_holding) == [a] and not s.waiting and not s.running
    assert len(table(s, a)) == 3 and not any(is_cached(s, b) for b in table(s, a))
    assert cast(ScriptedMeta, so.kv_connector_metadata).loads == [(a.request_id, 48)]
    assert s.has_unfinished_requests() and s.get_num_unfinished_requests() == 1
    stats = s.make_stats()
    assert stats is not None and stats.num_waiting_for_remote_kvs == 1

    # A request with the same prefix gets no hit on blocks whose KV is still in flight.
    b = create_request(prompt_token_ids=a.prompt_token_ids[:48] + [9] * 10, max_tokens=2)
    s.add_request(b)
    so, _ = step(s, worker)
    assert so.num_scheduled_tokens == {b.request_id: 58}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0

    # The load finishes; the request is promoted at the next schedule, not before.
    step(s, worker, kv_output=KVConnectorOutput(finished_recving={a.request_id}))
    assert a.status == WAITING_FOR_REMOTE_KVS
    so, outs = step(s, worker)
    (new,) = so.scheduled_new_reqs
    assert new.req_id == a.request_id and new.num_computed_tokens == 48
    assert so.num_scheduled_tokens[a.request_id] == 12 and not so.has_sync_kv_loads
    assert all(is_cached(s, bid) for bid in table(s, a)[:3])
    # update_state_after_alloc again, now with 0 external tokens.
    assert conn.allocs[-1] == (a.request_id, table(s, a), 0)
    out = out_of(outs, a)
    assert (out.num_local_cached_tokens, out.num_external_cached_tokens) == (0, 48)
    run_until_done(s, worker)
    assert_no_leaks(s)


def test_full_hit_recomputes_last_token() -> None:
    s, conn, worker = setup()
    a = create_request(48, max_tokens=1)  # exactly 3 blocks, all loaded asynchronously
    conn.external[a.request_id] = (48, True)
    s.add_request(a)
    step(s, worker)
    assert a.num_computed_tokens == 48 and len(table(s, a)) == 3
    step(s, worker, kv_output=KVConnectorOutput(finished_recving={a.request_id}))
    so, outs = step(s, worker)
    assert so.num_scheduled_tokens == {a.request_id: 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 47
    assert out_of(outs, a).finish_reason == "length"  # the recomputed token gave logits

    b = create_request(32, max_tokens=1)  # the same for a synchronous full hit
    conn.external[b.request_id] = (32, False)
    s.add_request(b)
    so, outs = step(s, worker)
    assert so.num_scheduled_tokens == {b.request_id: 1} and so.has_sync_kv_loads
    assert so.scheduled_new_reqs[0].num_computed_tokens == 31
    assert len(so.scheduled_new_reqs[0].block_ids[0]) == 2  # no extra block
    assert out_of(outs, b).num_external_cached_tokens == 32
    assert_no_leaks(s)


def test_deferred_lookup_does_not_block_others() -> None:
    s, conn, worker = setup()
    loader = create_request(40, max_tokens=2)
    conn.external[loader.request_id] = (32, True)
    s.add_request(loader)
    step(s, worker)
    a, b = create_request(20, max_tokens=2), create_request(20, max_tokens=2)
    conn.defer[a.request_id] = 2
    s.add_request(a)
    s.add_request(b)
    so, _ = step(s, worker, kv_output=KVConnectorOutput(finished_recving={loader.request_id}))
    assert so.num_scheduled_tokens == {b.request_id: 20}  # b overtakes the deferred a
    assert s.waiting[0] is a and s.kv_cache_manager.get_num_held_blocks(a.request_id) == 0
    # The parked load is promoted although a is still deferred.
    so, _ = step(s, worker)
    assert set(so.num_scheduled_tokens) == {loader.request_id, b.request_id}
    so, _ = step(s, worker)
    assert so.num_scheduled_tokens[a.request_id] == 20
    assert [n for rid, n in conn.lookups if rid == a.request_id] == [0, 0, 0]
    run_until_done(s, worker)
    assert_no_leaks(s)


@pytest.mark.parametrize(
    ("local", "external", "load_async", "expected"),
    [
        (32, 20, True, (32, 20, True)),  # block-aligned local hit: nothing to do
        (40, 20, True, (32, 20, True)),  # the load covers the partial tail: drop the tail
        (40, 8, True, (40, 0, False)),  # the load adds nothing beyond the tail: ignore it
        (40, 5, False, (40, 0, False)),
    ],
)
def test_partial_local_tail_rule(
    local: int, external: int, load_async: bool, expected: tuple[int, int, bool]
) -> None:
    assert apply_partial_tail_rule(local, BLOCK_SIZE, external, load_async) == expected


def test_connector_contract_checks() -> None:
    # An over-offering lookup is that request's fault: it alone ends with an error.
    s, conn, worker = setup()
    r, ok = create_request(20), create_request(20)
    conn.external[r.request_id] = (21, False)
    s.add_request(r)
    s.add_request(ok)
    _, outs = step(s, worker)
    (failed,) = [o for o in outs if o.request_id == r.request_id]
    assert failed.finish_reason == "error" and "only 20" in (failed.error or "")
    assert run_until_done(s, worker).finish_reasons == {ok.request_id: "length"}
    assert_no_leaks(s)
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        create_scheduler(kv_load_failure_policy="retry")


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


# -- load failures ------------------------------------------------------------------------


def test_invalid_sync_blocks_fail_only_the_affected_request() -> None:
    s, conn, worker = setup()
    a, b = create_request(40, max_tokens=2), create_request(20, max_tokens=2)
    conn.external[a.request_id] = (32, False)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    blocks = table(s, a)
    ro = worker.execute(so)
    ro.kv_connector_output = KVConnectorOutput(invalid_block_ids={blocks[1]})
    outs = s.update_from_output(so, ro)
    out = out_of(outs, a)
    assert out.finish_reason == "error" and out.new_token_ids == []
    assert out.error is not None and f"block {blocks[1]}" in out.error and "'fail'" in out.error
    assert a.status == RequestStatus.FINISHED_ERROR
    assert conn.finished == [(a.request_id, RequestStatus.FINISHED_ERROR, blocks)]
    assert out_of(outs, b).new_token_ids == [7] and b.status == RequestStatus.RUNNING
    # The bad block and everything computed on top of it left the prefix cache.
    assert is_cached(s, blocks[0]) and not is_cached(s, blocks[1]) and not is_cached(s, blocks[2])
    c = create_request(prompt_token_ids=a.prompt_token_ids, max_tokens=1)
    s.add_request(c)
    step(s, worker)
    assert c.prefill_stats is not None and c.prefill_stats.num_local_cached_tokens == 16
    run_until_done(s, worker)
    assert_no_leaks(s)


def test_invalid_async_blocks_fail_and_hold_blocks_until_recv() -> None:
    s, conn, worker = setup()
    a, b = create_request(60), create_request(20, max_tokens=3)
    conn.external[a.request_id] = (48, True)
    s.add_request(a)
    s.add_request(b)
    step(s, worker)
    _, outs = step(s, worker, kv_output=bad_block(s, a, 1))
    assert out_of(outs, a).finish_reason == "error"
    assert out_of(outs, b).finish_reason is None
    assert a.request_id in s.requests and len(table(s, a)) == 3  # load still in flight
    step(s, worker, kv_output=KVConnectorOutput(finished_recving={a.request_id}))
    assert a.request_id not in s.requests
    run_until_done(s, worker)
    assert_no_leaks(s)


def test_invalid_sync_blocks_recompute() -> None:
    s, conn, worker = setup("recompute")
    a, b = create_request(40, max_tokens=3), create_request(20, max_tokens=3)
    conn.external[a.request_id] = (32, False)
    s.add_request(a)
    s.add_request(b)
    _, outs = step(s, worker, kv_output=bad_block(s, a, 1))
    # a's token of this step was sampled on bad KV: discarded; a rewinds to block 1.
    assert [o.request_id for o in outs] == [b.request_id]
    assert a.status == RequestStatus.RUNNING and a.num_computed_tokens == 16
    assert a.output_token_ids == [] and len(table(s, a)) == 3
    so, outs = step(s, worker)
    cached = so.scheduled_cached_reqs
    i = cached.req_ids.index(a.request_id)
    assert (cached.num_computed_tokens[i], cached.num_output_tokens[i]) == (16, 0)
    assert so.num_scheduled_tokens[a.request_id] == 24
    assert out_of(outs, a).new_token_ids == [7]
    res = run_until_done(s, worker)
    assert res.finish_reasons[a.request_id] == "length" and len(a.output_token_ids) == 3
    assert [rid for rid, _, _ in conn.finished].count(a.request_id) == 1
    assert_no_leaks(s)


def test_invalid_async_blocks_recompute_caches_only_the_valid_prefix() -> None:
    s, conn, worker = setup("recompute")
    a = create_request(60, max_tokens=2)
    conn.external[a.request_id] = (48, True)
    s.add_request(a)
    step(s, worker)
    blocks = table(s, a)
    kv_out = KVConnectorOutput(finished_recving={a.request_id}, invalid_block_ids={blocks[1]})
    step(s, worker, kv_output=kv_out)
    assert a.status == WAITING_FOR_REMOTE_KVS and a.num_computed_tokens == 16
    # Promotion publishes only the valid block; a recomputes from token 16.
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {a.request_id: 44}
    s.update_from_output(so, worker.execute(so))
    res = run_until_done(s, worker)
    assert res.finish_reasons[a.request_id] == "length"
    assert_no_leaks(s)


def test_failed_recving_recompute_starts_over_with_a_fresh_lookup() -> None:
    s, conn, worker = setup("recompute")
    a = create_request(60, max_tokens=2)
    conn.external[a.request_id] = (48, True)
    s.add_request(a)
    step(s, worker)
    rid = a.request_id
    step(s, worker, kv_output=KVConnectorOutput(finished_recving={rid}, failed_recving={rid}))
    assert a.num_computed_tokens == 0
    del conn.external[rid]  # the source is gone: the second lookup finds nothing
    so, _ = step(s, worker)
    assert so.num_scheduled_tokens == {rid: 60}
    assert [r for r, _ in conn.lookups] == [rid, rid]
    res = run_until_done(s, worker)
    assert res.finish_reasons[rid] == "length" and len(a.output_token_ids) == 2
    assert_no_leaks(s)


# -- steps, stats, reservations, several workers ------------------------------------------


def test_zero_token_steps_build_metadata_and_process_output() -> None:
    s, conn, worker = setup()
    a = create_request(60, max_tokens=1)
    conn.external[a.request_id] = (48, True)
    s.add_request(a)
    for k in range(3):
        kv_out = KVConnectorOutput(
            kv_connector_stats=KVConnectorStats({"bytes": 10 * (k + 1)}),
            kv_cache_events=[f"worker-event-{k}"],
        )
        so, outs = step(s, worker, kv_output=kv_out)
        assert so.is_empty and outs == [] and so.kv_connector_metadata is conn.metas[-1]
        assert conn.outputs[-1] is kv_out
    assert len(conn.metas) == 3
    stats = s.take_kv_connector_stats()
    assert stats is not None and stats.data == {"bytes": 60}
    assert s.take_kv_connector_stats() is None
    events = s.take_kv_cache_events()
    assert events.count("scheduler-event") == 3 and "worker-event-2" in events
    step(s, worker)  # no connector output this step: update_connector_output is not called
    assert len(conn.outputs) == 3 and len(conn.metas) == 4
    drive(s, worker, TransferSim(conn))
    assert_no_leaks(s)


def test_has_unfinished_requests_follows_connector_work() -> None:
    s, conn, _ = setup()
    assert not s.has_requests()
    conn.pending_work = True
    assert s.has_unfinished_requests() and s.has_requests()
    so = s.schedule()
    assert so.is_empty and so.kv_connector_metadata is not None
    conn.pending_work = False
    assert not s.has_unfinished_requests()
    s.shutdown()
    assert_no_leaks(s)


def test_unknown_ids_and_block_ids_from_workers_are_ignored() -> None:
    s, _, worker = setup()
    bogus = KVConnectorOutput(
        finished_sending={"nope"}, finished_recving={"nope"}, invalid_block_ids={-1, 10_000}
    )
    step(s, worker, kv_output=bogus)
    assert_no_leaks(s)


@pytest.mark.parametrize("num_blocks", [6, 12])
def test_async_loads_reserve_blocks_and_cannot_deadlock(num_blocks: int) -> None:
    # Each request: 4 blocks of prompt, 3 of them loaded asynchronously. With 6 blocks, two
    # parked loads would hold all 6 and neither could then get its 4th block.
    s, conn, worker = setup(num_blocks=num_blocks, max_model_len=96)
    a, b = create_request(64, max_tokens=1), create_request(64, max_tokens=1)
    for r in (a, b):
        conn.external[r.request_id] = (48, True)
        s.add_request(r)
    sim = TransferSim(conn, delay=1)
    step(s, worker, kv_output=sim)
    if num_blocks == 6:
        assert a.status == WAITING_FOR_REMOTE_KVS and b.status == RequestStatus.WAITING
        assert s.kv_cache_manager.get_num_held_blocks(b.request_id) == 0
    else:
        assert a.status == b.status == WAITING_FOR_REMOTE_KVS
    final = drive(s, worker, sim)
    assert final[a.request_id].finish_reason == final[b.request_id].finish_reason == "length"
    assert final[b.request_id].num_external_cached_tokens == 48
    assert_no_leaks(s)


def test_multi_worker_quorum() -> None:
    s, conn, worker = setup()
    agg = KVOutputAggregator(expected_finished_count=2)
    a, b = create_request(60, max_tokens=2), create_request(60, max_tokens=2)
    for r in (a, b):
        conn.external[r.request_id] = (48, True)
        s.add_request(r)
    ra, rb = a.request_id, b.request_id

    def workers(w0: KVConnectorOutput, w1: KVConnectorOutput) -> KVConnectorOutput:
        return agg.aggregate([w0, w1])

    step(s, worker)
    # Worker 0 finished both loads (b's failed); worker 1 has not: nothing surfaces.
    w0 = KVConnectorOutput(finished_recving={ra, rb}, failed_recving={rb})
    _, outs = step(s, worker, kv_output=workers(w0, KVConnectorOutput()))
    assert outs == [] and a.status == b.status == WAITING_FOR_REMOTE_KVS
    step(s, worker, kv_output=workers(KVConnectorOutput(), KVConnectorOutput()))
    # Worker 1 reports a: a completes its quorum and is promoted at the next step.
    step(
        s, worker, kv_output=workers(KVConnectorOutput(), KVConnectorOutput(finished_recving={ra}))
    )
    assert a.status == WAITING_FOR_REMOTE_KVS and b.status == WAITING_FOR_REMOTE_KVS
    # Worker 1 reports b: its failure surfaces with the completed quorum (policy fail).
    so, outs = step(
        s, worker, kv_output=workers(KVConnectorOutput(), KVConnectorOutput(finished_recving={rb}))
    )
    assert so.num_scheduled_tokens == {ra: 12}
    assert out_of(outs, b).finish_reason == "error" and rb not in s.requests
    assert out_of(outs, a).finish_reason is None
    run_until_done(s, worker)
    assert agg.pending() == {}
    assert_no_leaks(s)


# -- randomized soak ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_connector_workload(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    s, conn, worker = setup(
        policy, num_blocks=10, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=6
    )
    bases = [[rng.randrange(1000, 5000) for _ in range(96)] for _ in range(3)]
    sim = RandomTransfers(s, conn, rng)
    finals: dict[str, EngineCoreOutput] = {}
    added: list[Request] = []
    for _ in range(1000):
        if len(added) < 40 and rng.random() < 0.4:
            length = rng.randint(4, 100)
            prompt = rng.choice(bases)[: rng.randint(0, length)]
            prompt += [rng.randrange(5000, 9000) for _ in range(length - len(prompt))]
            r = create_request(prompt_token_ids=prompt, max_tokens=rng.randint(1, 24))
            if rng.random() < 0.6:
                conn.external[r.request_id] = (rng.randint(0, length), rng.random() < 0.6)
            conn.defer[r.request_id] = rng.choice([0, 0, 0, 1, 2])
            if rng.random() < 0.3:
                conn.delay_free.add(r.request_id)
            s.add_request(r)
            added.append(r)
        if s.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(s.requests))
            finals.update(
                {o.request_id: o for o in s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)}
            )
        if not s.has_requests() and len(added) >= 40:
            break
        _, outs = step(s, worker, kv_output=sim)
        for o in outs:
            if o.finished:
                assert o.request_id not in finals, "two final outputs"
                finals[o.request_id] = o
    assert not s.has_requests(), "did not drain"
    assert sorted(finals) == sorted(r.request_id for r in added)
    finished_ids = [rid for rid, _, _ in conn.finished]
    assert sorted(finished_ids) == sorted(finals), "request_finished exactly once each"
    if policy == "recompute":
        assert all(o.finish_reason != "error" for o in finals.values())
    assert_no_leaks(s)
