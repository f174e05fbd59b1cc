"""The scheduler's side of the KV-connector protocol step by step, without a model: zero-token
steps, connector stats and events, unfinished work, bogus worker reports, block
reservations for async loads, several workers' quorum, and a randomized soak.

A scripted scheduler-role connector answers lookups and ``request_finished`` as each scenario
says and records every call; the tests hand-make the workers' ``KVConnectorOutput``s. Every
lifecycle test ends with ``assert_no_leaks`` once all transfers have been reported.
"""

from __future__ import annotations

import random

import pytest

from kvferry.core.outputs import EngineCoreOutput
from kvferry.kv_transfer.aggregator import KVOutputAggregator
from kvferry.kv_transfer.base import KVConnectorStats
from kvferry.request import Request, RequestStatus
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from tests.helpers.connector_setup import WAITING_FOR_REMOTE_KVS, setup
from tests.helpers.kv_events import RecordingPublisher, events_on
from tests.helpers.scheduler import (
    assert_no_leaks,
    create_request,
    drive,
    out_of,
    run_until_done,
    step,
)
from tests.helpers.transfer_sim import RandomTransfers, TransferSim

# -- steps, stats, reservations, several workers ------------------------------------------


def test_zero_token_steps_build_metadata_and_process_output() -> None:
    publisher = RecordingPublisher()
    s, conn, worker = setup(kv_events_config=events_on(), kv_event_publisher=publisher)
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
    # One batch per step, with the connector's take_events(); the workers' events are the
    # connector's to consume in update_connector_output (this one ignores them).
    assert [b.events for b in publisher.batches] == [["scheduler-event"]] * 3
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
