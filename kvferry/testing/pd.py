"""The scenarios of a prefill/decode connector (NixlConnector, or any whose hits are handed
over in ``kv_transfer_params``): a prefill engine (``kv_producer``) and a decode engine
(``kv_consumer``) in this process. The prefill engine runs each prompt for one token with
``{"do_remote_decode": True}``; its output's params go to the decode engine with the same
prompt, which loads the KV from the prefill engine. Both engines are stepped in turn and both
are checked: tokens, call order, leaks, and that the prefill engine kept the blocks until the
decode engine had read them (its delayed frees)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvferry.sampling_params import SamplingParams
from kvferry.testing.harness import BLOCK_SIZE, EngineRun, Finished
from kvferry.testing.report import NOT_EXERCISED
from kvferry.testing.subject import (
    WAITING_FOR_REMOTE_KVS,
    Outcome,
    Subject,
    close_run,
    free_violations,
    lookups_of,
    positive_hits,
    token_identity,
    verdict,
)


@dataclass
class Handoff:
    """Prompts prefilled on the prefill engine and their params for the decode engine."""

    prefill: EngineRun
    prompts: dict[str, list[int]]
    params: dict[str, dict[str, Any]]
    problems: list[str]
    held_blocks: int  # the prefill engine's blocks in use once its requests finished

    def step_prefill(self, _: EngineRun | None = None) -> None:
        if self.prefill.engine.has_unfinished_requests():
            self.prefill.step()


def prefill(
    s: Subject,
    tag: str,
    lengths: list[int],
    on_engine: Callable[[EngineRun], None] | None = None,
    **overrides: Any,
) -> Handoff:
    """Prefill the prompts; ``on_engine`` sees the engine before its first step."""
    prompts = s.prompts(tag, lengths)
    run = s.h.engine(s.config(kv_role="kv_producer"), **overrides)
    if on_engine is not None:
        try:
            on_engine(run)
        except BaseException:
            run.shutdown()
            raise
    one = dataclasses.replace(s.h.params, max_tokens=1)
    remote = dataclasses.replace(one, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    fins = run.run(prompts, remote)
    problems = token_identity(fins, s.h.reference(prompts, one))
    params = {r: f.kv_transfer_params for r, f in fins.items() if f.kv_transfer_params}
    problems += [f"{r}: the prefill engine returned no kv_transfer_params" for r in fins
                 if r not in params]  # fmt: skip
    held = run.engine.kv_cache_config.num_blocks - (
        run.engine.scheduler.kv_cache_manager.get_num_free_blocks()
    )
    if params and held == 0:
        problems.append("the prefill engine freed its blocks before the decode engine read them")
    return Handoff(run, prompts, params, problems, held)  # type: ignore[arg-type]


def decode(
    s: Subject,
    h: Handoff,
    kv: dict[str, Any] | None = None,
    params: SamplingParams | None = None,
    on_step: Callable[[EngineRun], None] | None = None,
    on_engine: Callable[[EngineRun], None] | None = None,
    **overrides: Any,
) -> tuple[EngineRun, dict[str, Finished]]:
    """Run every handed-over prompt on a decode engine, stepping the prefill engine along;
    ``on_engine`` sees the decode engine before its first step."""
    run = s.h.engine(kv or s.config(kv_role="kv_consumer"), **overrides)
    if on_engine is not None:
        try:
            on_engine(run)
        except BaseException:
            run.shutdown()
            raise
    for rid, prompt in h.prompts.items():
        extra = {"kv_transfer_params": h.params.get(rid)}
        run.add(prompt, dataclasses.replace(params or s.h.params, extra_args=extra), rid)

    def both(r: EngineRun) -> None:
        h.step_prefill()
        if on_step is not None:
            on_step(r)

    return run, run.wait(list(h.prompts), both)


def close_both(
    run: EngineRun, h: Handoff
) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """Drain and check the decode engine, then the prefill engine (whose delayed frees the
    decode engine's reads release): problems, decode records, prefill records."""
    d_problems, d_records = close_run(run)
    p_problems, p_records = close_run(h.prefill)
    _, frees = free_violations(p_records)
    return d_problems + [f"prefill engine: {p}" for p in p_problems + frees], d_records, p_records


def _hits(records: list[dict[str, Any]], tag: str) -> dict[str, tuple[int, bool]]:
    return positive_hits(lookups_of(records, f"{tag}-"))


# ------------------------------------------------------------------------------ scenarios
def _hit(s: Subject, want_async: bool) -> Outcome:
    tag = "ahit" if want_async else "shit"
    h = prefill(s, tag, s.lengths())
    run, fins = decode(s, h)
    problems = h.problems + token_identity(fins, s.h.reference(h.prompts, s.h.params))
    more, records, _ = close_both(run, h)
    hits = _hits(records, tag)
    if not hits:
        return Outcome(NOT_EXERCISED, ["the decode engine was offered no hit for handed-over "
                                       "prompts", *problems, *more])  # fmt: skip
    wanted = {r: n for r, (n, a) in hits.items() if a == want_async}
    if not wanted:
        other = "asynchronous" if not want_async else "synchronous"
        return Outcome(NOT_EXERCISED, [f"the connector answers its hits as {other} loads only"])
    problems += [f"{r}: a hit but no external cached tokens in its metrics" for r in wanted
                 if fins[r].external_tokens <= 0]  # fmt: skip
    return verdict(problems + more, [
        f"the decode engine read {sorted(wanted.values())} tokens from the prefill engine"])  # fmt: skip


def sync_hit(s: Subject) -> Outcome:
    return _hit(s, want_async=False)


def async_hit(s: Subject) -> Outcome:
    return _hit(s, want_async=True)


def full_hit(s: Subject) -> Outcome:
    lengths = [4 * BLOCK_SIZE, 5 * BLOCK_SIZE][: max(1, s.h.profile.prompts)]
    h = prefill(s, "full", lengths)
    run, fins = decode(s, h)
    problems = h.problems + token_identity(fins, s.h.reference(h.prompts, s.h.params))
    more, records, _ = close_both(run, h)
    hits = _hits(records, "full")
    if not hits:
        return Outcome(NOT_EXERCISED, ["no hit for block-multiple handed-over prompts"])
    whole = [r for r, (n, _) in hits.items() if n >= len(h.prompts[r])]
    # vLLM's NixlConnector offers the whole prompt too: the engine recomputes the last token.
    what = ", the whole prompt (the last token recomputed)" if whole else ""
    return verdict(problems + more, [
        f"block-multiple prompts {lengths}, hits of {sorted(n for n, _ in hits.values())} "
        f"tokens{what}"])  # fmt: skip


def delayed_free(s: Subject) -> Outcome:
    h = prefill(s, "free", s.lengths())
    run, fins = decode(s, h)
    problems = h.problems + token_identity(fins, s.h.reference(h.prompts, s.h.params))
    more, _, p_records = close_both(run, h)
    kept, _ = free_violations(p_records)  # its problems are in `more` already
    if not kept:
        return Outcome(NOT_EXERCISED, ["the prefill engine's request_finished never kept "
                                       "blocks"] + problems + more)  # fmt: skip
    return verdict(problems + more, [
        f"the prefill engine kept {h.held_blocks} blocks of {len(kept)} request(s) until the "
        "decode engine read them, then freed all"])  # fmt: skip


def abort_mid_load(s: Subject) -> Outcome:
    h = prefill(s, "abort", [40, 57])
    target, bystander = list(h.prompts)
    aborted: list[str] = []

    def watch(r: EngineRun) -> None:
        req = r.engine.scheduler.requests.get(target)
        if not aborted and req is not None and req.status == WAITING_FOR_REMOTE_KVS:
            r.engine.abort_request(target)
            aborted.append(target)

    run = s.h.engine(s.config(kv_role="kv_consumer"))
    for rid, prompt in h.prompts.items():
        extra = {"kv_transfer_params": h.params.get(rid)}
        run.add(prompt, dataclasses.replace(s.h.params, extra_args=extra), rid)
    watch(run)  # the load starts with the first step: abort right after it
    while bystander not in run.finished and run.steps < 500:
        run.step()
        h.step_prefill()
        watch(run)
    refs = s.h.reference({bystander: h.prompts[bystander]}, s.h.params)
    problems = h.problems + token_identity(run.finished, refs)
    more, records, _ = close_both(run, h)
    if not aborted:
        return Outcome(NOT_EXERCISED, ["no load was in flight across a step"])
    if not any(r["method"] in ("request_finished", "request_finished_all_groups")
               and target in r.get("req_ids", []) for r in records):  # fmt: skip
        problems.append("request_finished was not called for the request aborted mid-load")
    return verdict(problems + more, [
        "aborted on the decode engine while WAITING_FOR_REMOTE_KVS; the prefill engine "
        "freed its blocks"])  # fmt: skip


def _failed_load(s: Subject, policy: str) -> Outcome:
    h = prefill(s, f"fail{policy[:3]}", s.lengths())
    kv = s.faulty(policy, fail_loads=[0])
    kv["kv_role"] = "kv_consumer"
    kv["kv_connector_extra_config"]["inner"]["kv_role"] = "kv_consumer"
    run, fins = decode(s, h, kv)
    # The kit runs single-worker engines (the executor's only worker holds the connector).
    connector = getattr(getattr(run.engine.executor, "worker", None), "kv_connector", None)
    sabotaged = set(getattr(connector, "sabotaged_req_ids", []))
    expect = sabotaged if policy == "fail" else set()
    problems = h.problems + token_identity(fins, s.h.reference(h.prompts, s.h.params), expect)
    more, _, _ = close_both(run, h)
    if not sabotaged:
        return Outcome(NOT_EXERCISED, ["no load to fail: the decode engine loaded nothing"])
    what = "ended with 'error'" if policy == "fail" else "recomputed, token-identical"
    return verdict(problems + more, [
        f"the decode engine's load of {sorted(sabotaged)} failed and {what}; the prefill "
        "engine freed its blocks"])  # fmt: skip


def failed_load_fail(s: Subject) -> Outcome:
    return _failed_load(s, "fail")


def failed_load_recompute(s: Subject) -> Outcome:
    return _failed_load(s, "recompute")


def preemption_during_load(s: Subject) -> Outcome:
    h = prefill(s, "pload", [40] * 4)
    pool = s.h.profile.small_pool_blocks
    params = dataclasses.replace(s.h.params, max_tokens=24)  # decodes that outgrow the pool
    run, fins = decode(s, h, params=params, num_kv_blocks=pool,
                       max_model_len=pool * BLOCK_SIZE, max_num_batched_tokens=pool * BLOCK_SIZE)  # fmt: skip
    problems = h.problems + token_identity(fins, s.h.reference(h.prompts, params))
    preempted = {r for r in run.preempted if r in h.prompts}
    more, records, _ = close_both(run, h)
    hit = preempted & set(_hits(records, "pload"))
    if not hit:
        why = "no request was preempted" if not preempted else "no loaded request was preempted"
        return Outcome(NOT_EXERCISED, [why])
    return verdict(problems + more, [f"preempted after loading from the prefill engine: "
                                     f"{sorted(hit)}"])  # fmt: skip


PD_SCENARIOS: dict[str, Callable[[Subject], Outcome]] = {
    "sync hit": sync_hit,
    "async hit": async_hit,
    "full hit": full_hit,
    "preemption during a load": preemption_during_load,
    "abort mid-load": abort_mid_load,
    "delayed free": delayed_free,
    "failed load, policy fail": failed_load_fail,
    "failed load, policy recompute": failed_load_recompute,
}
