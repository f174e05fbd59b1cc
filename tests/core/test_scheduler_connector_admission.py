"""The scheduler's side of the KV-connector protocol at admission, without a model: sync and
async hits on top of local ones, full hits, deferred lookups, the partial-tail rule and the
connector contract checks.

A scripted scheduler-role connector answers lookups and ``request_finished`` as each scenario
says and records every call; the tests hand-make the workers' ``KVConnectorOutput``s. Every
lifecycle test ends with ``assert_no_leaks`` once all transfers have been reported.
"""

from __future__ import annotations

from typing import cast

import pytest

from kvferry.config import ConfigError
from kvferry.core.connector_state import apply_partial_tail_rule
from kvferry.request import RequestStatus
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from tests.helpers.connector_setup import WAITING_FOR_REMOTE_KVS, setup
from tests.helpers.scheduler import (
    BLOCK_SIZE,
    assert_no_leaks,
    create_request,
    create_scheduler,
    is_cached,
    out_of,
    run_until_done,
    step,
    table,
)
from tests.helpers.scripted_connector import ScriptedMeta

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
