"""Cross-worker aggregation of KV cache events: vLLM's ``KVEventAggregator`` and
``KVConnectorKVEvents``, and the merge the executor applies to the workers' reports.

With tensor parallelism each worker's connector holds one shard of every block, so a block is
in a tier only once every worker has stored (or dropped) its part: by default an event is
published when every worker of the step reported it. A connector whose workers write
different blocks (sharded puts) returns :class:`UnionKVEvents`, which keeps every event any
worker reported.

Two deliberate differences from vLLM's counting, both keeping results vLLM would also keep:
an event reported ``k`` times by every worker is kept ``k`` times (vLLM drops it unless
``k == 1``), and kept events stay in the order the first worker reported them, so
"stored, removed, stored again" within one step still ends with the block stored.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

__all__ = [
    "CommonKVEvents",
    "KVConnectorKVEvents",
    "KVEventAggregator",
    "UnionKVEvents",
    "merge_worker_events",
]


def _key(event: Any) -> Hashable:
    try:
        hash(event)
    except TypeError:
        # A connector's own unhashable event type: equal reprs count as the same event.
        return (type(event), repr(event))
    return event  # type: ignore[no-any-return]


class KVEventAggregator:
    """Counts events reported by ``num_workers`` workers (one ``add_events`` per worker batch)."""

    __slots__ = ("_counts", "_events", "_num_workers")

    def __init__(self, num_workers: int) -> None:
        if num_workers <= 0:
            raise ValueError("num_workers must be greater than zero")
        self._num_workers = num_workers
        self._events: list[Any] = []
        self._counts: Counter[Hashable] = Counter()

    def add_events(self, events: list[Any]) -> None:
        if not isinstance(events, list):
            raise TypeError("events must be a list of KVCacheEvent")
        self._events.extend(events)
        self._counts.update(_key(e) for e in events)

    def _select(self, times: dict[Hashable, int]) -> list[Any]:
        left = dict(times)
        out: list[Any] = []
        for event in self._events:
            key = _key(event)
            if left.get(key, 0) > 0:
                left[key] -= 1
                out.append(event)
        return out

    def get_common_events(self) -> list[Any]:
        """Events every worker reported (as often as each worker reported them)."""
        n = self._num_workers
        return self._select({k: c // n for k, c in self._counts.items() if c >= n})

    def get_union_events(self) -> list[Any]:
        """Events any worker reported, duplicates across workers folded into one."""
        n = self._num_workers
        return self._select({k: max(1, c // n) for k, c in self._counts.items()})

    def get_all_events(self) -> list[Any]:
        """Every reported event, in arrival order, duplicates included."""
        return list(self._events)

    def clear_events(self) -> None:
        self._events.clear()
        self._counts.clear()

    def increment_workers(self, count: int = 1) -> None:
        if count <= 0:
            raise ValueError("count must be positive")
        self._num_workers += count

    def reset_workers(self) -> None:
        self._num_workers = 1

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def __repr__(self) -> str:
        return f"<KVEventAggregator workers={self._num_workers}, events={len(self._events)}>"


class KVConnectorKVEvents(ABC):
    """A connector's KV cache events as one worker (or several, once merged) reported them.

    A worker connector returns one from ``get_kv_connector_kv_cache_events()``. The executor
    folds the workers' objects into the first with ``merge`` + ``increment_workers`` and then
    calls ``aggregate()``, which leaves only the events to publish and one worker:
    ``get_all_events()`` after ``aggregate()`` is what subscribers receive. ``aggregate`` must
    be idempotent (a vLLM-style connector may call it again in ``take_events``).
    """

    @abstractmethod
    def add_events(self, events: list[Any]) -> None:
        """Add one worker's batch of events."""

    @abstractmethod
    def aggregate(self) -> KVConnectorKVEvents:
        """Keep only the events to publish, count one worker, and return ``self``."""

    @abstractmethod
    def increment_workers(self, count: int = 1) -> None:
        """Count ``count`` more contributing workers."""

    @abstractmethod
    def get_all_events(self) -> list[Any]:
        """Every event held, in order."""

    @abstractmethod
    def get_number_of_workers(self) -> int:
        """How many workers' reports this holds."""

    @abstractmethod
    def clear_events(self) -> None:
        """Forget every event (and count one worker again)."""

    def merge(self, other: KVConnectorKVEvents) -> KVConnectorKVEvents:
        """Add ``other``'s events (as vLLM does, the worker count is the caller's to raise)."""
        self.add_events(other.get_all_events())
        return self


class CommonKVEvents(KVConnectorKVEvents):
    """The default: after ``aggregate()`` only the events every worker reported remain."""

    def __init__(self, events: Iterable[Any] = (), num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)
        events = list(events)
        if events:
            self._aggregator.add_events(events)

    def _kept(self) -> list[Any]:
        return self._aggregator.get_common_events()

    def add_events(self, events: list[Any]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> KVConnectorKVEvents:
        kept = self._kept()
        self._aggregator.clear_events()
        self._aggregator.add_events(kept)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[Any]:
        return self._aggregator.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._aggregator.get_number_of_workers()

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} workers={self.get_number_of_workers()} " + (
            f"events={self.get_all_events()}>"
        )


class UnionKVEvents(CommonKVEvents):
    """For sharded writes: after ``aggregate()`` every event any worker reported remains."""

    def _kept(self) -> list[Any]:
        return self._aggregator.get_union_events()


def merge_worker_events(
    reports: Sequence[KVConnectorKVEvents | Sequence[Any] | None],
) -> KVConnectorKVEvents | list[Any] | None:
    """One step's events to publish from every worker's ``kv_cache_events`` (one per worker;
    None when a worker reported none).

    Plain lists give the list of events every worker reported. ``KVConnectorKVEvents`` are
    merged into the first one, with each worker that reported nothing (or a plain list)
    counted, then aggregated; that object is returned, so a connector that checks the type
    in ``update_connector_output`` still sees its own class.
    """
    if all(r is None for r in reports):
        return None
    objects = [r for r in reports if isinstance(r, KVConnectorKVEvents)]
    if not objects:
        lists = [
            list(r) for r in reports if r is not None and not isinstance(r, KVConnectorKVEvents)
        ]
        if len(reports) == 1:
            return lists[0] or None
        agg = KVEventAggregator(len(reports))
        for events in lists:
            agg.add_events(events)
        return agg.get_common_events() or None
    base = objects[0]
    for other in objects[1:]:
        base.merge(other)
        base.increment_workers(other.get_number_of_workers())
    for report in reports:
        if not isinstance(report, KVConnectorKVEvents):
            # A worker that sent a plain list, or nothing: it still counts as a worker.
            if report:
                base.add_events(list(report))
            base.increment_workers(1)
    return base.aggregate()
