"""The chaos harness: real ``kvferry serve`` / ``kvferry proxy`` processes on loopback, a good
client, and one measured run per attack.

:func:`run_attack` runs one attack the same way every time:

1. **start**: each watched service's KV state (pool usage, requests running / waiting / held
   by the connector) and log length;
2. **baseline**: the good client alone, ``profile.baseline_requests`` requests in a row;
3. **attack**: the attack function runs (bounded in count and time: it loops with
   :meth:`Attack.rounds`) while the good client keeps sending its request in a thread and a
   watcher polls every watched service's ``/health``;
4. **drain**: wait until every watched service is idle again, then count leaked blocks (blocks
   in use beyond those at the start), engine deaths (a process that exited or a ``/health``
   503) and new tracebacks in the logs;
5. **verdict**: the targets below, each broken one a line in ``violations``; the record goes to
   the results file (JSON lines, :func:`results_path`) that ``report.py`` turns into the table
   of ``docs/reliability.md``, and the test asserts that ``violations`` is empty.

Targets: good-request latency during the attack within ``2 x baseline + slack`` (p50 and max,
each against the same statistic of the baseline measured right before, so a loaded machine
moves both), every good request answered with exactly the baseline's greedy tokens, zero
leaked blocks, zero engine deaths, ``/health`` answering within :data:`HEALTH_STALL_S`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from .client import GOOD_TIMEOUT_S, GoodClient, Sample, _Loop, _why
from .services import (
    HEALTH_STALL_S,
    REPO,
    KVState,
    Service,
    _HealthWatch,
    _healthy,
    free_port,
    proxy_service,
    serve_service,
    start_all,
)

MIN_GOOD_DURING = 3  # an attack that repeats goes on until this many good requests answered


@dataclass(frozen=True)
class Profile:
    """How hard and how long each attack runs. ``short`` runs in CI (``make test``), ``long``
    on demand (``make chaos``); pick with ``KVFERRY_CHAOS_PROFILE``."""

    name: str
    baseline_requests: int
    attack_s: float  # how long an attack that repeats keeps repeating
    max_rounds: int  # and at most this many rounds
    slow_clients: int
    idle_cpu_s: float
    kill_streams: int  # streams in flight when a process is killed
    huge_bytes: int = 10 * 1000 * 1000

    @staticmethod
    def current() -> Profile:
        name = os.environ.get("KVFERRY_CHAOS_PROFILE", "short")
        if name not in PROFILES:
            raise ValueError(f"KVFERRY_CHAOS_PROFILE must be one of {sorted(PROFILES)}: {name!r}")
        return PROFILES[name]


PROFILES = {
    "short": Profile(
        "short",
        baseline_requests=4,
        attack_s=2.0,
        max_rounds=8,
        slow_clients=100,
        idle_cpu_s=3.0,
        kill_streams=2,
    ),
    "long": Profile(
        "long",
        baseline_requests=12,
        attack_s=12.0,
        max_rounds=60,
        slow_clients=300,
        idle_cpu_s=30.0,
        kill_streams=6,
    ),
}
PROFILE = Profile.current()
# The long profile (`make chaos`, on a quiet machine) holds the documented target. The short
# one runs inside the whole test suite on a shared 2-core CI machine, where scheduling noise
# alone moves a 0.15 s request by a second: it keeps the 2x ratio with a wider slack, which
# still catches the multi-second stalls the attacks used to cause.
P50_SLACK_S = 0.5 if PROFILE.name == "long" else 2.0
MAX_SLACK_S = 1.5 if PROFILE.name == "long" else 4.0


def results_path() -> Path:
    """``KVFERRY_CHAOS_RESULTS``, else ``.pytest_cache/chaos/results.jsonl`` in the repo."""
    given = os.environ.get("KVFERRY_CHAOS_RESULTS")
    return Path(given) if given else REPO / ".pytest_cache" / "chaos" / "results.jsonl"


# -- one attack -----------------------------------------------------------------------------


@dataclass
class Attack:
    """What an attack function gets: its profile, a place for what it observed (``details``)
    and for the targets it saw broken (``violation``)."""

    name: str
    profile: Profile
    details: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    good_answered: Callable[[], int] = lambda: MIN_GOOD_DURING

    def violation(self, message: str) -> None:
        if message not in self.violations:
            self.violations.append(message)

    def check(self, cond: bool, message: str) -> None:
        if not cond:
            self.violation(message)

    def rounds(
        self,
        min_rounds: int = 1,
        seconds: float | None = None,
        pause: float = 0.1,
        max_rounds: int | None = None,
    ) -> Iterator[int]:
        """Round numbers until ``profile.attack_s`` (or ``seconds``) passed and the good
        client had :data:`MIN_GOOD_DURING` answers meanwhile; at least ``min_rounds`` and at
        most ``profile.max_rounds`` of them, ``pause`` seconds apart (an attacker with a
        budget, not a bandwidth flood, which no HTTP server absorbs on two cores)."""
        limit = self.profile.attack_s if seconds is None else seconds
        t0 = time.monotonic()
        for i in range(self.profile.max_rounds if max_rounds is None else max_rounds):
            if i:
                time.sleep(pause)
            if (
                i >= min_rounds
                and time.monotonic() - t0 >= limit
                and self.good_answered() >= MIN_GOOD_DURING
            ):
                return
            yield i

    def count(self, key: str, n: int = 1) -> None:
        self.details[key] = self.details.get(key, 0) + n


def _stats(samples: Sequence[Sample]) -> dict[str, Any]:
    """Latency of the answered requests (a failure is counted apart, not as a fast answer)."""
    lat = [s.latency for s in samples if s.ok]
    return {
        "n": len(samples),
        "p50_s": round(statistics.median(lat), 4) if lat else None,
        "max_s": round(max(lat), 4) if lat else None,
    }


def _drain(services: Sequence[Service], start: dict[str, KVState], timeout: float) -> dict:
    """Wait until each service is idle with no more blocks in use than at the start; the
    blocks still in use beyond that at the deadline are leaked."""
    leaked: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    for s in services:
        if s.num_blocks is None or not s.alive():
            continue
        base = s.used_blocks(start[s.name]) if s.name in start else 0
        while True:
            try:
                state = s.kv_state()
            except httpx.HTTPError:
                state = None
            used = s.used_blocks(state) if state is not None else None
            if state is not None and used is not None and state.idle and used <= base:
                leaked[s.name] = 0
                break
            if time.monotonic() > deadline:
                leaked[s.name] = max(0, used - base) if used is not None else -1
                break
            time.sleep(0.1)
    return leaked


_commit_cache: list[str] = []


def _commit() -> str:
    if not _commit_cache:
        try:
            rev = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=REPO,
                capture_output=True,
                text=True,
            ).stdout.strip()
            _commit_cache.append(rev + ("+changes" if dirty else "") if rev else "unknown")
        except OSError:
            _commit_cache.append("unknown")
    return _commit_cache[0]


@dataclass
class Result:
    record: dict[str, Any]

    @property
    def violations(self) -> list[str]:
        return list(self.record["violations"])

    def summary(self) -> str:
        r = self.record
        return f"{r['attack']}: " + "; ".join(r["violations"]) + f"\n{json.dumps(r, indent=1)}"


def run_attack(
    name: str,
    title: str,
    attack: Callable[[Attack], None],
    *,
    good: GoodClient | None,
    watch: Sequence[Service],
    drain_s: float = 20.0,
    check_latency: bool = True,
    kill: bool = False,
    remeasure: bool = True,
) -> Result:
    """Measure one attack (see the module docstring). ``kill``: the attack kills processes,
    so a good request may fail cleanly (an HTTP 5xx, or no connection to a dead process)
    while one of them is down; it must still never hang or answer wrong tokens. ``watch``:
    the services that must stay up (the survivors). ``remeasure``: when latency is the only
    target missed, measure once more (baseline and attack) and keep that verdict, so one
    scheduling hiccup on a busy machine does not fail the attack while a real stall, which
    repeats, still does; both records go to the results file."""
    result = _measure(name, title, attack, good, watch, drain_s, check_latency, kill)
    v = result.violations
    if remeasure and v and all(x.startswith(LATENCY_VIOLATIONS) for x in v):
        result = _measure(name, title, attack, good, watch, drain_s, check_latency, kill, v)
    return result


LATENCY_VIOLATIONS = ("good p50 ", "good max ")


def _measure(
    name: str,
    title: str,
    attack: Callable[[Attack], None],
    good: GoodClient | None,
    watch: Sequence[Service],
    drain_s: float,
    check_latency: bool,
    kill: bool,
    first_try: list[str] | None = None,
) -> Result:
    t_begin = time.monotonic()
    ctx = Attack(name, PROFILE)
    start = {s.name: st for s in watch if (st := s.kv_state()) is not None}
    tracebacks0 = {s.name: s.tracebacks() for s in watch}
    baseline = good.run(PROFILE.baseline_requests) if good is not None else []
    health = _HealthWatch(watch)
    loop = _Loop(good) if good is not None else None
    if loop is not None:
        ctx.good_answered = lambda: len(loop.samples)
    health.start()
    if loop is not None:
        loop.start()
    t_attack = time.monotonic()
    try:
        attack(ctx)
    except Exception as e:
        ctx.violation(f"the attack could not run: {e!r}")
        ctx.details["attack_error"] = traceback.format_exc()[-2000:]
    attack_s = time.monotonic() - t_attack
    if loop is not None:
        loop.stop.set()
        loop.join(GOOD_TIMEOUT_S + 5)
    health.stop.set()
    health.join(HEALTH_STALL_S * 2 + 5)
    during = loop.samples if loop is not None else []
    leaked = _drain(watch, start, drain_s)
    deaths = sorted(
        {s.name for s in watch if not s.alive()}
        | health.dead_503
        | {s.name for s in watch if not _healthy(s)}
    )
    new_tracebacks = {s.name: s.tracebacks() - tracebacks0[s.name] for s in watch}

    v = ctx.violations
    base, dur = _stats(baseline), _stats(during)
    wrong = [s for s in baseline + during if good is not None and good.wrong(s)]
    failed = [s for s in baseline + during if not s.ok]
    hung = [s for s in failed if s.status is None and "Timeout" in (s.error or "")]
    clean = [s for s in failed if kill and s not in hung and (s.status is None or s.status >= 500)]
    unclean = [s for s in failed if s not in clean]
    if good is not None and not during:
        v.append("no good request completed during the attack")
    if check_latency and good is not None and during and not dur["n"]:
        v.append("no good request was answered during the attack")
    if wrong:
        v.append(f"{len(wrong)} good requests answered other tokens than the baseline")
    if unclean:
        v.append(f"{len(unclean)} good requests failed: {sorted({_why(s) for s in unclean})}")
    if check_latency and good is not None and base["n"] and dur["n"]:
        limit_p50 = 2 * base["p50_s"] + P50_SLACK_S
        limit_max = 2 * base["max_s"] + MAX_SLACK_S
        if dur["p50_s"] > limit_p50:
            v.append(f"good p50 {dur['p50_s']:.2f}s > 2x baseline + {P50_SLACK_S}s")
        if dur["max_s"] > limit_max:
            v.append(f"good max {dur['max_s']:.2f}s > 2x baseline + {MAX_SLACK_S}s")
    for svc, n in leaked.items():
        if n:
            v.append(
                f"{svc}: {n} blocks not back after {drain_s:.0f}s"
                if n > 0
                else f"{svc}: no KV state"
            )
    if deaths:
        v.append(f"engine deaths: {deaths}")
    for svc, slowest in health.slowest.items():
        if slowest > HEALTH_STALL_S:
            v.append(f"{svc}: /health took {slowest:.1f}s")
    for svc, n in new_tracebacks.items():
        if n:
            v.append(f"{svc}: {n} tracebacks in its log")

    record = {
        "attack": name,
        "title": title,
        "profile": PROFILE.name,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),  # others' work on the machine meanwhile
        "passed": not v,
        "violations": v,
        "latency_checked": check_latency and good is not None,
        "baseline": base,
        "during": dur,
        "good": {
            "requests": len(baseline) + len(during),
            "failed": len(failed),
            "clean_failures": len(clean),
            "wrong": len(wrong),
        },
        "leaked_blocks": leaked,
        "engine_deaths": len(deaths),
        "health": {
            "slowest_s": {k: round(x, 3) for k, x in health.slowest.items()},
            "not_ok": {k: x for k, x in health.bad.items() if x},
        },
        "tracebacks": new_tracebacks,
        "samples": {  # raw: [seconds, HTTP status or the client error], in order
            "baseline": _raw(baseline),
            "during": _raw(during),
        },
        "attack_s": round(attack_s, 2),
        "duration_s": round(time.monotonic() - t_begin, 2),
        "details": ctx.details,
    }
    if first_try is not None:
        record["remeasured_after"] = first_try
    path = results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return Result(record)


def _raw(samples: Sequence[Sample], cap: int = 500) -> list[list[Any]]:
    return [[round(s.latency, 4), s.status or _why(s)] for s in samples[:cap]]


def token_ids(n: int, seed: int) -> list[int]:
    """A deterministic prompt of ``n`` token ids (no tokenizer involved)."""
    return [5 + (seed * 7919 + i * 104729) % 1500 for i in range(n)]


def json_body(obj: Any) -> bytes:
    """JSON as a hostile client writes it: NaN allowed, lone surrogates kept as escapes."""
    return json.dumps(obj, allow_nan=True).encode()


__all__ = [
    "PROFILE",
    "Attack",
    "GoodClient",
    "Profile",
    "Result",
    "Sample",
    "Service",
    "free_port",
    "json_body",
    "proxy_service",
    "results_path",
    "run_attack",
    "serve_service",
    "start_all",
    "token_ids",
]
