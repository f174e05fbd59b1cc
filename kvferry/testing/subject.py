"""What every conformance scenario shares: the connector under test (:class:`Subject`), a
scenario's :class:`Outcome`, and the checks (token identity, leaks, call order) and runs
(warm the connector, then hit it) the scenarios are built from."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvferry.request import RequestStatus
from kvferry.testing.harness import EngineRun, Finished, Harness
from kvferry.testing.order import FINISH, check_order
from kvferry.testing.report import FAILED, PASSED

WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


@dataclass
class Outcome:
    status: str
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Subject:
    """The connector under test (its KV transfer config as a dict) on a harness; ``pd``: it
    loads what a prefill engine hands over (the P/D scenarios of :mod:`kvferry.testing.pd`)."""

    def __init__(self, harness: Harness, kv: dict[str, Any], pd: bool = False) -> None:
        self.h = harness
        self.kv = dict(kv)
        self.kv.setdefault("kv_role", "kv_both")
        self.pd = pd
        self._salt = random.randrange(1 << 30)  # fresh prompts on every run of the kit

    def config(self, **fields: Any) -> dict[str, Any]:
        return {**self.kv, **fields}

    def faulty(self, policy: str, **options: Any) -> dict[str, Any]:
        """The connector wrapped in a FaultInjectionConnector with ``options``."""
        inner = {k: v for k, v in self.kv.items() if k != "kv_load_failure_policy"}
        return {
            "kv_connector": "FaultInjectionConnector",
            "kv_role": self.kv["kv_role"],
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"inner": inner, **options},
        }

    def prompts(self, tag: str, lengths: list[int]) -> dict[str, list[int]]:
        rng = random.Random(f"{self._salt}-{tag}")
        return {f"{tag}-{i}": [rng.randrange(5, 500) for _ in range(n)]
                for i, n in enumerate(lengths)}  # fmt: skip

    def lengths(self) -> list[int]:
        return [40 + 17 * i for i in range(self.h.profile.prompts)]


def lookups_of(records: list[dict[str, Any]], prefix: str) -> dict[str, list[Any]]:
    """Each request's lookup answers ``[tokens, async]`` in trace order."""
    out: dict[str, list[Any]] = {}
    for r in records:
        if r["method"] == "get_num_new_matched_tokens" and r.get("req_ids"):
            rid = r["req_ids"][0]
            if rid.startswith(prefix):
                out.setdefault(rid, []).append(r.get("result"))
    return out


def positive_hits(lookups: dict[str, list[Any]]) -> dict[str, tuple[int, bool]]:
    """Per request, its first positive answer."""
    hits = {}
    for rid, answers in lookups.items():
        for a in answers:
            if isinstance(a, list) and a and isinstance(a[0], int) and a[0] > 0:
                hits[rid] = (a[0], bool(a[1]))
                break
    return hits


def token_identity(
    fins: dict[str, Finished],
    refs: dict[str, list[int]],
    expect_error: set[str] = frozenset(),  # type: ignore[assignment]
) -> list[str]:
    problems = []
    for rid, ref in refs.items():
        fin = fins.get(rid)
        if fin is None:
            problems.append(f"{rid} did not finish")
        elif rid in expect_error:
            if fin.finish_reason != "error":
                problems.append(f"{rid}: its load failed under policy 'fail' but it finished "
                                f"with {fin.finish_reason!r}, not 'error'")  # fmt: skip
        elif fin.finish_reason == "error":
            problems.append(f"{rid} ended in error: {fin.error}")
        elif fin.token_ids != ref:
            problems.append(f"{rid}: tokens differ from the run without the connector "
                            f"({fin.token_ids[:6]}... vs {ref[:6]}...)")  # fmt: skip
    return problems


def close_run(run: EngineRun) -> tuple[list[str], list[dict[str, Any]]]:
    """Drain, check for leaks, shut down; then the call order of the whole run."""
    problems: list[str] = []
    try:
        run.drain()
        problems += run.leaks()
    except TimeoutError as e:
        problems.append(str(e))
    run.shutdown()
    records = run.records()
    # Per rank (a tensor-parallel engine's workers each run the worker side's sequence).
    for rank, recs in run.rank_records().items():
        where = f"rank {rank}: " if run.world_size > 1 else ""
        problems += [f"call order: {where}{v}" for v in check_order(recs)]
    return problems, records


def verdict(problems: list[str], notes: list[str]) -> Outcome:
    return Outcome(FAILED, problems, notes) if problems else Outcome(PASSED, [], notes)


def warm(
    s: Subject,
    run: EngineRun,
    prompts: dict[str, list[int]],
    refs: dict[str, list[int]] | None = None,
) -> list[str]:
    """Run ``prompts`` once so the connector can store them, then drop the engine's own
    prefix cache so that any hit afterwards must come from the connector. ``refs``: the
    prompts' reference outputs (default: a one-worker engine's)."""
    fins = run.run({f"w{r}": p for r, p in prompts.items()}, s.h.params)
    if refs is None:
        refs = s.h.reference(prompts, s.h.params)
    problems = token_identity(fins, {f"w{r}": t for r, t in refs.items()})
    try:
        run.drain()
    except TimeoutError as e:  # e.g. blocks a delayed free never releases; reported, not raised
        problems.append(f"after the first run: {e}")
    run.engine.scheduler.kv_cache_manager.reset_prefix_cache()
    return problems


def hit_run(s: Subject, tag: str, lengths: list[int], kv: dict[str, Any] | None = None,
             **overrides: Any) -> HitRun:  # fmt: skip
    """Warm the connector with prompts, then run them again on the same engine."""
    prompts = s.prompts(tag, lengths)
    run = s.h.engine(kv or s.kv, **overrides)
    problems = warm(s, run, prompts)
    fins = run.run(prompts, s.h.params)
    problems += token_identity(fins, s.h.reference(prompts, s.h.params))
    more, records = close_run(run)
    lookups = lookups_of(records, f"{tag}-")
    return HitRun(problems + more, positive_hits(lookups), lookups, fins, records)


@dataclass
class HitRun:
    problems: list[str]
    hits: dict[str, tuple[int, bool]]
    lookups: dict[str, list[Any]]
    fins: dict[str, Finished]
    records: list[dict[str, Any]]


def free_violations(records: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The requests whose blocks ``request_finished`` kept, and the ways their release broke
    the protocol: a ``finished_sending`` before the request finished (the scheduler ignores
    it, the blocks are never freed) or none after it (the blocks are held forever)."""
    kept: dict[str, bool] = {}  # request id -> finished_sending seen since request_finished
    early: set[str] = set()
    sent_before: set[str] = set()
    for r in records:
        m = r["method"]
        if m in FINISH:
            result = r.get("result")
            if isinstance(result, list) and result and result[0] is True:
                for rid in r.get("req_ids", []):
                    kept[rid] = False
                    if rid in sent_before:
                        early.add(rid)
        elif m == "get_finished" and r.get("role") == "worker":
            result = r.get("result")
            sending = result[0] if isinstance(result, list) and result else None
            for rid in sending or []:
                if rid in kept:
                    kept[rid] = True
                else:
                    sent_before.add(rid)
        elif m == "get_transfer_results" and r.get("role") == "worker":
            # Its result is not in the trace: any id it names may be the free (lenient).
            for rid in r.get("req_ids", []):
                if rid in kept:
                    kept[rid] = True
    problems = []
    if early:
        problems.append(f"finished_sending reported {sorted(early)[:4]} before request_finished "
                        "kept their blocks (the free came early, so it was ignored)")  # fmt: skip
    never = sorted(rid for rid, sent in kept.items() if not sent and rid not in early)
    if never:
        problems.append(f"request_finished kept the blocks of {never[:4]} but no get_finished "
                        "reported them in finished_sending (they are never freed)")  # fmt: skip
    return sorted(kept), problems
