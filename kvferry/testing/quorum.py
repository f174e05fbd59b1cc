"""The multi-worker quorum scenario: the connector on a tensor-parallel engine
(:data:`QUORUM_TP` worker processes, each with its own worker-side connector and its shard of
the KV heads).

The connector stores prompts and loads them again on that engine (for a P/D connector: a
prefill and a decode engine of that size), so that its ``finished_sending`` and
``finished_recving`` reports go through the executor's ``KVOutputAggregator``, which counts a
request finished once ``get_finished_count()`` workers (None: every rank) reported it. The kit
taps the aggregator of the real executor and checks, besides token identity with a
tensor-parallel run without the connector, each rank's call order and the leak check:

* each quorum the connector asked for is reached: a request reported by some ranks only is
  never finished (its blocks are held, or its load never ends);
* a request reaches the scheduler once per direction, exactly at the step its quorum closed;
* the executor waits for the count the connector asked for (``get_finished_count()``, the
  same on every rank).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvferry.config import ConfigError
from kvferry.testing.harness import EngineRun
from kvferry.testing.report import NOT_EXERCISED
from kvferry.testing.subject import (
    Outcome,
    Subject,
    close_run,
    lookups_of,
    positive_hits,
    token_identity,
    verdict,
    warm,
)

QUORUM_TP = 2  # the kit's model (4 heads, 2 KV heads, MLP 128) divides by it
DIRECTIONS = ("finished_sending", "finished_recving")

# Connectors the kit does not run under tensor parallelism, and why (none at present: every
# built-in is adapted to it).
NOT_ON_TP: dict[str, str] = {}


def _finished_count(worker: Any) -> int | None:
    """On a rank (through ``collective_rpc``): its worker-side connector's count."""
    connector = getattr(worker, "kv_connector", None)
    return None if connector is None else connector.get_finished_count()


@dataclass
class QuorumTap:
    """Records what the ranks report and what the executor's aggregator hands on, per step."""

    run: EngineRun
    # per step: per rank {direction: ids}, and the aggregated {direction: ids}
    steps: list[tuple[list[dict[str, set[str]]], dict[str, set[str]]]] = field(default_factory=list)
    counts: list[int | None] = field(default_factory=list)
    expected: int = 0
    dynamic: bool = False  # a worker output named its own expected_finished_count

    def __post_init__(self) -> None:
        executor = self.run.engine.executor
        self.world = int(executor.world_size)
        self.counts = list(executor.collective_rpc(_finished_count))
        aggregator = executor.aggregator
        if aggregator is None:  # an engine built with a connector always has one
            raise RuntimeError("the tensor-parallel executor has no KVOutputAggregator")
        self.expected = aggregator.expected
        inner = aggregator.aggregate

        def aggregate(outputs: list[Any]) -> Any:
            result = inner(outputs)
            self.dynamic |= any(getattr(o, "expected_finished_count", 0) > 0 for o in outputs)
            ranks = [{d: set(getattr(o, d, None) or ()) for d in DIRECTIONS} for o in outputs]
            self.steps.append((ranks, {d: set(getattr(result, d) or ()) for d in DIRECTIONS}))
            self.expected = aggregator.expected
            return result

        # An instance attribute: this engine's aggregator only.
        aggregator.aggregate = aggregate  # type: ignore[method-assign]

    def delivered(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {d: set() for d in DIRECTIONS}
        for _, agg in self.steps:
            for d in DIRECTIONS:
                out[d] |= agg[d]
        return out

    def check(self) -> list[str]:
        problems: list[str] = []
        # A worker output's own expected_finished_count overrides the count for good.
        want = self.expected if self.dynamic else self.counts[0] or self.world
        if len(set(self.counts)) > 1:
            problems.append(f"the ranks' get_finished_count() disagree: {self.counts}")
        if self.expected != want:
            problems.append(f"the executor waited for {self.expected} reports per request, the "
                            f"connector asked for {want} (get_finished_count() "
                            f"{self.counts[0]}, {self.world} ranks)")  # fmt: skip
        for d in DIRECTIONS:
            problems += self._check_direction(d, want)
        return problems

    def _check_direction(self, d: str, want: int) -> list[str]:
        problems: list[str] = []
        voters: dict[str, list[int]] = defaultdict(list)  # open quorums: id -> ranks so far
        seen: set[str] = set()
        for n, (ranks, agg) in enumerate(self.steps, 1):
            closed: set[str] = set()
            for rank, r in enumerate(ranks):
                for rid in r[d]:
                    if rank in voters[rid]:
                        problems.append(f"rank {rank} reported {d} of {rid} again before its "
                                        "quorum closed (the executor counts reports, so one "
                                        "rank's repeats pass for other ranks')")  # fmt: skip
                    voters[rid].append(rank)
                    if len(voters[rid]) >= want:
                        closed.add(rid)
                        del voters[rid]
            for rid in sorted(agg[d] - closed):
                problems.append(f"{d} of {rid} reached the scheduler at step {n} before "
                                f"{want} rank(s) reported it")  # fmt: skip
            for rid in sorted(closed - agg[d]):
                problems.append(f"{d} of {rid}: {want} rank(s) reported it at step {n} but the "
                                "scheduler was not told")  # fmt: skip
            for rid in sorted(agg[d] & seen):
                problems.append(f"{d} of {rid} reached the scheduler twice (a rank beyond the "
                                f"quorum of {want} reported it again)")  # fmt: skip
            seen |= agg[d]
        for rid, by in sorted(voters.items()):
            problems.append(
                f"{d} of {rid} was reported by rank(s) {sorted(set(by))} of {self.world} "
                f"only; its quorum of {want} (get_finished_count() {self.counts[0]}) was never "
                "reached, so the scheduler never saw it finish"
            )
        return list(dict.fromkeys(problems))[:6]


def _skip_reason(kv: dict[str, Any]) -> str | None:
    """Why the kit does not run this config under TP (a composite counts its children)."""
    if kv.get("kv_connector") in NOT_ON_TP:
        return NOT_ON_TP[str(kv["kv_connector"])]
    extra = kv.get("kv_connector_extra_config") or {}
    for child in [*extra.get("connectors", []), extra.get("inner")]:
        if isinstance(child, dict) and (why := _skip_reason(child)):
            return why
    return None


def _summary(tap: QuorumTap, label: str = "") -> tuple[list[str], int]:
    """What went through the quorum of one engine (notes), and for how many requests."""
    got = tap.delivered()
    parts = [f"{d} of {len(ids)} request(s)" for d, ids in got.items() if ids]
    notes = []
    if parts:
        notes.append(f"{label}{' and '.join(parts)} after reports from {tap.expected} of "
                     f"{tap.world} ranks")  # fmt: skip
    if tap.counts[0] is not None and tap.counts[0] != tap.world:
        notes.append(f"{label}get_finished_count() {tap.counts[0]} of {tap.world} ranks honoured")
    return notes, sum(len(ids) for ids in got.values())


def multi_worker_quorum(s: Subject) -> Outcome:
    why = _skip_reason(s.kv)
    if why:
        return Outcome(NOT_EXERCISED, [why])
    try:
        return _pd_quorum(s) if s.pd else _store_load_quorum(s)
    except ConfigError as e:
        return Outcome(NOT_EXERCISED, [f"the connector refused tensor_parallel_size="
                                       f"{QUORUM_TP}: {e}"])  # fmt: skip


def _store_load_quorum(s: Subject) -> Outcome:
    prompts = s.prompts("quorum", s.lengths())
    params = s.h.params
    refs = s.h.reference(prompts, params, QUORUM_TP)
    run = s.h.engine(s.kv, tensor_parallel_size=QUORUM_TP)
    try:
        tap = QuorumTap(run)
    except BaseException:
        run.shutdown()
        raise
    # The stores (first run), then the loads (the same prompts again, the engine's own prefix
    # cache dropped); both against a tensor-parallel engine without the connector.
    problems = warm(s, run, prompts, refs)
    fins = run.run(prompts, params)
    problems += token_identity(fins, refs)
    more, records = close_run(run)
    problems += more + tap.check()
    hits = positive_hits(lookups_of(records, "quorum-"))
    notes, total = _summary(tap)
    seen = f"TP={QUORUM_TP}: hits of {sorted(n for n, _ in hits.values())} tokens"
    if problems:
        return verdict(problems, notes)
    if not hits:
        return Outcome(NOT_EXERCISED, [f"the connector offered no hit under TP={QUORUM_TP} for "
                                       "prompts it had just run"])  # fmt: skip
    if not total:
        return Outcome(NOT_EXERCISED, [
            f"no worker reported finished_sending or finished_recving (synchronous loads, "
            f"blocks freed at once), so no quorum was needed; {seen}, token-identical"])  # fmt: skip
    return verdict([], [seen, *notes])


def _pd_quorum(s: Subject) -> Outcome:
    from kvferry.testing.pd import close_both, decode, prefill

    taps: dict[str, QuorumTap] = {}

    def tap(role: str) -> Callable[[EngineRun], None]:
        return lambda run: taps.__setitem__(role, QuorumTap(run))

    h = prefill(s, "quorum", s.lengths(), tap("prefill"), tensor_parallel_size=QUORUM_TP)
    try:
        run, fins = decode(s, h, on_engine=tap("decode"), tensor_parallel_size=QUORUM_TP)
    except BaseException:
        h.prefill.shutdown()
        raise
    problems = h.problems + token_identity(fins, s.h.reference(h.prompts, s.h.params, QUORUM_TP))
    more, records, _ = close_both(run, h)
    problems += more
    notes, total = [f"TP={QUORUM_TP} prefill and decode engines"], 0
    for role, t in taps.items():
        problems += [f"{role} engine: {p}" for p in t.check()]
        n, k = _summary(t, f"{role} engine: ")
        notes, total = notes + n, total + k
    hits = positive_hits(lookups_of(records, "quorum-"))
    if problems:
        return verdict(problems, notes)
    if not hits:
        return Outcome(NOT_EXERCISED, [f"the TP={QUORUM_TP} decode engine was offered no hit"])
    if not total:
        return Outcome(NOT_EXERCISED, ["no worker reported finished_sending or finished_recving"])
    notes.insert(1, f"the decode engine read {sorted(n for n, _ in hits.values())} tokens")
    return verdict([], notes)


__all__ = ["NOT_ON_TP", "QUORUM_TP", "QuorumTap", "multi_worker_quorum"]
