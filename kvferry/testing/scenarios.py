"""The conformance scenarios: each drives a connector into one situation of the protocol on a
real engine, then checks token identity with a run without the connector, the call order
(:mod:`kvferry.testing.order`) and that every block is back in the free pool.

A scenario that the connector cannot be driven into (no hit, no deferral, loads that finish
within their step) reports *not exercised* with the reason; it never passes by default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvferry.testing.harness import BLOCK_SIZE, EngineRun
from kvferry.testing.quorum import multi_worker_quorum
from kvferry.testing.report import NOT_EXERCISED
from kvferry.testing.subject import (
    WAITING_FOR_REMOTE_KVS,
    Outcome,
    Subject,
    close_run,
    free_violations,
    hit_run,
    lookups_of,
    positive_hits,
    token_identity,
    verdict,
    warm,
)


# ------------------------------------------------------------------------------ scenarios
def miss(s: Subject) -> Outcome:
    prompts = s.prompts("miss", s.lengths())
    run = s.h.engine(s.kv)
    fins = run.run(prompts, s.h.params)
    problems = token_identity(fins, s.h.reference(prompts, s.h.params))
    more, records = close_run(run)
    offered = {r: a for r, a in positive_hits(lookups_of(records, "miss-")).items()}
    problems += [
        f"{r}: offered {n} tokens for a prompt it never saw" for r, (n, _) in offered.items()
    ]
    return verdict(problems + more, [f"{len(prompts)} fresh prompts, no hit offered"])


def _hit(s: Subject, want_async: bool) -> Outcome:
    tag = "ahit" if want_async else "shit"
    h = hit_run(s, tag, s.lengths())
    problems, hits, fins = h.problems, h.hits, h.fins
    if not hits:
        return Outcome(NOT_EXERCISED, ["the connector offered no hit for prompts it had just run"])
    wanted = {r: n for r, (n, a) in hits.items() if a == want_async}
    if not wanted:
        other = "asynchronous" if not want_async else "synchronous"
        return Outcome(NOT_EXERCISED, [f"the connector answers its hits as {other} loads only"])
    shown = [r for r in wanted if fins.get(r) and fins[r].external_tokens <= 0]
    problems += [f"{r}: a hit of {wanted[r]} tokens but no external cached tokens in its metrics"
                 for r in shown]  # fmt: skip
    return verdict(problems, [f"hits of {sorted(wanted.values())} tokens"])


def sync_hit(s: Subject) -> Outcome:
    return _hit(s, want_async=False)


def async_hit(s: Subject) -> Outcome:
    return _hit(s, want_async=True)


def none_deferral(s: Subject) -> Outcome:
    h = hit_run(s, "defer", s.lengths())
    problems = h.problems
    deferred = [r for r, answers in h.lookups.items() if any(a and a[0] is None for a in answers)]
    if not deferred:
        return Outcome(
            NOT_EXERCISED, ["the connector never answered None (not known yet) to a lookup"]
        )
    return verdict(problems, [f"{len(deferred)} request(s) deferred, then scheduled"])


def full_hit(s: Subject) -> Outcome:
    lengths = [4 * BLOCK_SIZE, 5 * BLOCK_SIZE][: max(1, s.h.profile.prompts)]
    h = hit_run(s, "full", lengths)
    problems, hits = h.problems, h.hits
    if not hits:
        return Outcome(
            NOT_EXERCISED, ["the connector offered no hit for prompts it had fully stored"]
        )
    for rid, (n, _) in hits.items():
        length = lengths[int(rid.rsplit("-", 1)[1])]
        if n >= length:
            problems.append(f"{rid}: offered {n} of {length} prompt tokens (never the last one)")
    return verdict(
        problems, [f"block-multiple prompts, hits of {sorted(n for n, _ in hits.values())} tokens"]
    )


def _preemption(s: Subject, with_load: bool) -> Outcome:
    tag = "pload" if with_load else "psave"
    p = s.h.profile
    prompts = s.prompts(tag, [40] * 4)
    # Decodes that outgrow the pool: each request ends at 104 tokens (7 of the 10 blocks), so
    # any two that run at once preempt, however far apart their loads let them start.
    params = dataclasses.replace(s.h.params, max_tokens=64)
    pool = p.small_pool_blocks
    run = s.h.engine(s.kv, num_kv_blocks=pool, max_model_len=pool * BLOCK_SIZE,
                     max_num_batched_tokens=pool * BLOCK_SIZE)  # fmt: skip
    problems: list[str] = []
    if with_load:
        problems += warm(s, run, prompts)
    in_flight: set[str] = set()

    def watch(r: EngineRun) -> None:
        waiting = {
            rid
            for rid, q in r.engine.scheduler.requests.items()
            if q.status == WAITING_FOR_REMOTE_KVS
        }
        if waiting and r.preempted:
            in_flight.update(waiting)

    fins = run.run(prompts, params, watch)
    problems += token_identity(fins, s.h.reference(prompts, params))
    preempted = {r for r in run.preempted if r in prompts}
    more, records = close_run(run)
    loaded = {rid for rec in records if rec["method"] == "update_state_after_alloc"
              and rec.get("num_external_tokens", 0) > 0 for rid in rec.get("req_ids", [])}  # fmt: skip
    if not preempted:
        return Outcome(NOT_EXERCISED, ["no request was preempted"])
    if with_load:
        hit = preempted & loaded
        if not hit and not in_flight:
            why = "no hit was offered" if not loaded else "no loaded request was preempted"
            return Outcome(NOT_EXERCISED, [f"preemptions happened but {why}"])
        notes = [f"preempted after loading: {sorted(hit)}"] if hit else []
        notes += [f"preempted while loads were in flight: {sorted(in_flight)}"] if in_flight else []
        return verdict(problems + more, notes)
    if s.kv["kv_role"] == "kv_consumer":
        return Outcome(NOT_EXERCISED, ["a kv_consumer saves nothing"])
    return verdict(problems + more, [f"preempted while saving: {sorted(preempted)}"])


def preemption_during_load(s: Subject) -> Outcome:
    return _preemption(s, with_load=True)


def preemption_during_save(s: Subject) -> Outcome:
    return _preemption(s, with_load=False)


def abort_mid_load(s: Subject) -> Outcome:
    prompts = s.prompts("abort", s.lengths()[:2] if s.h.profile.prompts > 1 else [40, 57])
    target, bystander = list(prompts)
    run = s.h.engine(s.kv)
    problems = warm(s, run, prompts)
    for rid, p in prompts.items():
        run.add(p, s.h.params, rid)
    aborted = False
    while bystander not in run.finished and run.steps < 500:
        run.step()
        req = run.engine.scheduler.requests.get(target)
        if not aborted and req is not None and req.status == WAITING_FOR_REMOTE_KVS:
            run.engine.abort_request(target)
            aborted = True
    refs = s.h.reference({bystander: prompts[bystander]}, s.h.params)
    problems += token_identity(run.finished, refs)
    more, records = close_run(run)
    if not aborted:
        return Outcome(NOT_EXERCISED, [
            "no load was in flight across a step (loads are synchronous or no hit was offered), "
            "so no abort can arrive mid-load"])  # fmt: skip
    if not any(r["method"] in ("request_finished", "request_finished_all_groups")
               and target in r.get("req_ids", []) for r in records):  # fmt: skip
        problems.append("request_finished was not called for the request aborted mid-load")
    return verdict(problems + more, ["aborted while WAITING_FOR_REMOTE_KVS"])


def delayed_free(s: Subject) -> Outcome:
    h = hit_run(s, "free", s.lengths())
    kept, problems = free_violations(h.records)
    if not kept:
        return Outcome(
            NOT_EXERCISED, ["request_finished never kept blocks (the connector frees at once)"]
        )
    return verdict(h.problems + problems, [f"{len(kept)} delayed free(s), all blocks returned"])


def _failed_load(s: Subject, policy: str) -> Outcome:
    tag = f"fail{policy[:3]}"
    prompts = s.prompts(tag, s.lengths())
    run = s.h.engine(s.faulty(policy, fail_loads=[0]))
    problems = warm(s, run, prompts)
    fins = run.run(prompts, s.h.params)
    # The kit runs single-worker engines (the executor's only worker holds the connector).
    connector = getattr(getattr(run.engine.executor, "worker", None), "kv_connector", None)
    sabotaged = set(getattr(connector, "sabotaged_req_ids", []))
    expect = sabotaged if policy == "fail" else set()
    problems += token_identity(fins, s.h.reference(prompts, s.h.params), expect)
    more, _ = close_run(run)
    if not sabotaged:
        return Outcome(NOT_EXERCISED, ["no load to fail: the connector offered no hit"])
    what = "ended with 'error'" if policy == "fail" else "recomputed, token-identical"
    return verdict(problems + more, [f"failed load of {sorted(sabotaged)} {what}"])


def failed_load_fail(s: Subject) -> Outcome:
    return _failed_load(s, "fail")


def failed_load_recompute(s: Subject) -> Outcome:
    return _failed_load(s, "recompute")


def restart_reuse(s: Subject) -> Outcome:
    prompts = s.prompts("restart", s.lengths())
    first = s.h.engine(s.kv)
    fins = first.run(prompts, s.h.params)
    refs = s.h.reference(prompts, s.h.params)
    problems = token_identity(fins, refs)
    more, _ = close_run(first)
    second = s.h.engine(s.kv)
    again = {f"r{r}": p for r, p in prompts.items()}
    fins = second.run(again, s.h.params)
    problems += token_identity(fins, {f"r{r}": t for r, t in refs.items()})
    last, records = close_run(second)
    hits = positive_hits(lookups_of(records, "rrestart-"))
    if not hits:
        return Outcome(
            NOT_EXERCISED,
            ["no hit on a fresh engine: the connector does not persist KV across engines"],
        )
    return verdict(
        problems + more + last,
        [f"a new engine loaded {sorted(n for n, _ in hits.values())} tokens"],
    )


SCENARIOS: dict[str, Callable[[Subject], Outcome]] = {
    "miss": miss,
    "sync hit": sync_hit,
    "async hit": async_hit,
    "None deferral": none_deferral,
    "full hit": full_hit,
    "preemption during a load": preemption_during_load,
    "preemption during a save": preemption_during_save,
    "abort mid-load": abort_mid_load,
    "delayed free": delayed_free,
    "failed load, policy fail": failed_load_fail,
    "failed load, policy recompute": failed_load_recompute,
    "restart and reuse": restart_reuse,
    "multi-worker quorum": multi_worker_quorum,
}
