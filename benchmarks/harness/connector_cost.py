"""Noise-resistant measures of what a KV connector costs an engine.

``HookTimer`` adds up the wall time of every protocol call the engine makes on a connector
(both roles, per-layer hooks included), per method; ``side_thread_cpu`` reads the CPU time of
the process's Python threads other than the main one (a connector's own copy or I/O threads).
Neither depends much on how loaded the machine is, unlike end-to-end throughput.
``paired_summary`` turns per-round paired ratios into a median and a bootstrap interval.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from kvferry.kv_transfer.base import KVConnectorBase


def _protocol_methods() -> list[str]:
    names = []
    for name in dir(KVConnectorBase):
        if name.startswith("_") or isinstance(
            inspect.getattr_static(KVConnectorBase, name), property
        ):
            continue
        if callable(getattr(KVConnectorBase, name)):
            names.append(name)
    return names


PROTOCOL_METHODS = tuple(_protocol_methods())


class HookTimer:
    """Wraps every protocol method of an engine's connectors (instance attributes, so calls
    through the attention layers count too). Only the outermost call on a thread is timed:
    an alias calling its twin, or a default calling another hook, is not counted twice."""

    def __init__(self, llm: Any) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._depth = threading.local()
        engine = llm.engine
        seen: set[int] = set()
        for connector in (engine.scheduler.connector, engine.executor.worker.kv_connector):
            if connector is None or id(connector) in seen:
                continue
            seen.add(id(connector))
            for name in PROTOCOL_METHODS:
                setattr(connector, name, self._wrap(name, getattr(connector, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:
                    self.seconds[name] += time.perf_counter() - t0
                    self.calls[name] += 1

        return timed

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def side_thread_cpu() -> dict[int, float]:
    """CPU seconds so far of each live Python thread other than the main one."""
    main = threading.main_thread().ident
    out: dict[int, float] = {}
    for t in threading.enumerate():
        if t.ident is None or t.ident == main:
            continue
        with contextlib.suppress(OSError, AttributeError):  # ended meanwhile, or not Linux
            out[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return out


def side_cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the side threads spent between two ``side_thread_cpu`` readings (threads
    that ended in between are lost; a thread born in between counts from zero)."""
    return sum(max(0.0, s - before.get(tid, 0.0)) for tid, s in after.items())


def bootstrap_median(
    values: Sequence[float], resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of ``values`` (resampling rounds)."""
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def paired_summary(losses: Sequence[float]) -> dict[str, Any]:
    """Median and 95% bootstrap interval of per-round paired losses."""
    lo, hi = bootstrap_median(losses)
    return {"median": statistics.median(losses), "ci95": [lo, hi], "per_round": list(losses)}
