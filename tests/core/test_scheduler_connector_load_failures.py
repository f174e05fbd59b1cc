"""The scheduler's side of the KV-connector protocol when loads fail, without a model: invalid
blocks of sync and async loads under the ``fail`` and ``recompute`` policies, and failed
receives.

A scripted scheduler-role connector answers lookups and ``request_finished`` as each scenario
says and records every call; the tests hand-make the workers' ``KVConnectorOutput``s. Every
lifecycle test ends with ``assert_no_leaks`` once all transfers have been reported.
"""

from __future__ import annotations

from kvferry.core.outputs import EngineCoreOutput
from kvferry.request import PrefillStats, Request, RequestStatus
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from tests.helpers.connector_setup import WAITING_FOR_REMOTE_KVS, setup
from tests.helpers.scheduler import (
    assert_no_leaks,
    create_request,
    is_cached,
    out_of,
    run_until_done,
    step,
    table,
)
from tests.helpers.transfer_sim import bad_block

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


# -- prompt-token sources after a failed load ---------------------------------------------
# The split (local hit, external, computed) a request reports: tokens whose load failed and
# were computed again count as computed; the valid prefix keeps its source.


def _sources(out: EngineCoreOutput, n_prompt: int) -> tuple[int, int, int]:
    local, external = out.num_local_cached_tokens, out.num_external_cached_tokens
    return n_prompt - local - external, local, external


def _stats(req: Request) -> tuple[int, int]:
    """``req``'s (local hit, external) prompt tokens as its PrefillStats says now."""
    assert req.prefill_stats is not None
    return req.prefill_stats.num_local_cached_tokens, req.prefill_stats.num_external_cached_tokens


def test_failed_async_load_counts_the_prompt_as_computed() -> None:
    s, conn, worker = setup("recompute")
    a = create_request(60, max_tokens=2)
    rid = a.request_id
    conn.external[rid] = (48, True)
    s.add_request(a)
    step(s, worker)
    assert a.prefill_stats is not None and a.prefill_stats.num_external_cached_tokens == 48
    step(s, worker, kv_output=KVConnectorOutput(finished_recving={rid}, failed_recving={rid}))
    assert (
        a.prefill_stats.num_local_cached_tokens,
        a.prefill_stats.num_external_cached_tokens,
    ) == (
        0,
        0,
    )
    del conn.external[rid]  # the fresh lookup finds nothing: the whole prompt is computed
    res_outs: list[EngineCoreOutput] = []
    while s.has_unfinished_requests():
        res_outs += step(s, worker)[1]
    final = res_outs[-1]
    assert final.finished and final.finish_reason == "length"
    assert _sources(final, 60) == (60, 0, 0)
    assert final.external_cache_hit_sources == {}
    assert all(o.num_external_cached_tokens == 0 for o in res_outs)
    assert_no_leaks(s)


def test_failed_async_load_takes_the_fresh_lookups_sources() -> None:
    s, conn, worker = setup("recompute")
    a = create_request(60, max_tokens=2)
    rid = a.request_id
    conn.external[rid] = (48, True)
    s.add_request(a)
    step(s, worker)
    t0 = a.prefill_stats.scheduled_time if a.prefill_stats else None
    step(s, worker, kv_output=KVConnectorOutput(finished_recving={rid}, failed_recving={rid}))
    conn.external[rid] = (32, False)  # a retry loads 32 tokens synchronously
    step(s, worker)
    assert a.prefill_stats is not None and a.prefill_stats.scheduled_time == t0
    res = run_until_done(s, worker)
    assert res.finish_reasons[rid] == "length"
    assert (
        a.prefill_stats.num_local_cached_tokens,
        a.prefill_stats.num_external_cached_tokens,
    ) == (
        0,
        32,
    )
    assert a.prefill_stats.external_cache_hit_sources == {"external_unspecified": 32}
    assert_no_leaks(s)


def test_partly_failed_async_load_keeps_the_valid_prefix_external() -> None:
    s, conn, worker = setup("recompute")
    a = create_request(60, max_tokens=2)
    rid = a.request_id
    conn.external[rid] = (48, True)
    s.add_request(a)
    step(s, worker)
    bad = table(s, a)[1]
    kv_out = KVConnectorOutput(finished_recving={rid}, invalid_block_ids={bad})
    step(s, worker, kv_output=kv_out)
    outs: list[EngineCoreOutput] = []
    while s.has_unfinished_requests():
        outs += step(s, worker)[1]
    # Block 0 (16 tokens) loaded fine; the 32 tokens of blocks 1-2 were computed here.
    assert _sources(outs[-1], 60) == (44, 0, 16)
    assert outs[-1].external_cache_hit_sources == {"external_unspecified": 16}
    assert_no_leaks(s)


def test_partly_failed_sync_load_keeps_the_local_hit_and_the_valid_external_prefix() -> None:
    s, conn, worker = setup("recompute")
    warm = create_request(20, max_tokens=1)
    s.add_request(warm)
    run_until_done(s, worker)
    # b shares warm's first block (16 tokens, a local hit); the connector has 48 tokens.
    b = create_request(
        prompt_token_ids=[*warm.prompt_token_ids[:16], *range(900_000, 900_044)], max_tokens=2
    )
    conn.external[b.request_id] = (48, False)
    s.add_request(b)
    so, outs = step(s, worker, kv_output=bad_block(s, b, 2))
    assert outs == [] and b.num_computed_tokens == 32
    assert _stats(b) == (16, 16)
    res = run_until_done(s, worker)
    assert res.finish_reasons[b.request_id] == "length"
    assert _stats(b) == (16, 16)
    assert_no_leaks(s)


def test_failed_sync_load_under_fail_reports_no_external_tokens() -> None:
    s, conn, worker = setup("fail")
    a = create_request(40, max_tokens=2)
    conn.external[a.request_id] = (32, False)
    s.add_request(a)
    _, outs = step(s, worker, kv_output=bad_block(s, a, 0))
    out = out_of(outs, a)
    assert out.finish_reason == "error"
    assert _sources(out, 40) == (40, 0, 0)
    assert_no_leaks(s)


def test_keep_valid_prefix_drops_external_first_and_trims_the_last_tiers() -> None:
    reported = {"host": 16, "disk": 24}
    stats = PrefillStats(60, 16, 40, reported)
    stats.keep_valid_prefix(40)
    assert (stats.num_local_cached_tokens, stats.num_external_cached_tokens) == (16, 24)
    assert stats.external_cache_hit_sources == {"host": 16, "disk": 8}
    assert reported == {"host": 16, "disk": 24}  # outputs already out keep what they said
    stats.keep_valid_prefix(8)
    assert (stats.num_local_cached_tokens, stats.num_external_cached_tokens) == (8, 0)
    assert stats.external_cache_hit_sources == {}
