"""Repeated measurements on a shared machine: alternating order and best-of timing.

This machine's speed drifts over minutes; configurations measured in a fixed order would
turn that drift into a bias for whichever always runs first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def alternating(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` in their order on even rounds and reversed on odd ones."""
    return list(items) if round_index % 2 == 0 else list(reversed(items))


def best_time(
    fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None
) -> float:
    """Fastest of ``reps`` timed calls of ``fn``, after one untimed call (which also faults
    pages in); ``before`` runs untimed ahead of every call (e.g. to evict caches)."""
    times = []
    for _ in range(reps + 1):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times[1:])
