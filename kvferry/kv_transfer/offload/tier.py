"""TierIndex: the scheduler's view of one offload medium (host memory or a disk folder).

The index knows which chunk keys the medium holds, where (a slot of the host buffer; files
need none), whether each one's bytes are complete (``ready``) and how many readers or writers
pin it. It never touches data: the worker moves bytes, and the scheduler calls :meth:`commit`
or :meth:`discard` when the worker reports a write done or failed.

Invariants (checked by :meth:`check_integrity`): every entry is known to the policy and vice
versa; slots are unique, in range and disjoint from the free list; at most ``capacity``
entries. Only ready, unpinned entries are ever evicted.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvferry.kv_transfer.offload.policies import EvictionPolicy, Key


@dataclass
class TierEntry:
    """``slot``: host-buffer chunk index (None for media without slots, e.g. files).
    ``ready``: the bytes are complete and may be read. ``pins``: readers (loads, promotions,
    disk writes) and lookups holding the entry; a pinned entry is never evicted.
    ``verified``: the bytes were checked since this engine started (files written by it, or
    read back and checksummed); only verified files are loaded straight into the engine."""

    slot: int | None
    ready: bool = False
    pins: int = 0
    verified: bool = False


class TierIndex:
    def __init__(
        self, name: str, capacity: int, policy: EvictionPolicy, with_slots: bool = True
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"tier {name!r} needs a positive capacity, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self.with_slots = with_slots
        self._entries: dict[Key, TierEntry] = {}
        # A min-heap, so allocations favour low, adjacent slots: adjacent host chunks copy
        # as one slice instead of many small ones.
        self._free_slots: list[int] = list(range(capacity)) if with_slots else []

    # -- queries --------------------------------------------------------------------------

    def get(self, key: Key) -> TierEntry | None:
        return self._entries.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._entries)

    def is_ready(self, key: Key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    @property
    def num_free(self) -> int:
        return self.capacity - len(self._entries)

    def num_pinned(self) -> int:
        return sum(1 for e in self._entries.values() if e.pins)

    def num_pending(self) -> int:
        return sum(1 for e in self._entries.values() if not e.ready)

    def slot(self, key: Key) -> int:
        entry = self._entries[key]
        assert entry.slot is not None, f"tier {self.name} has no slots"
        return entry.slot

    def evictable(self, key: Key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready and entry.pins == 0

    # -- changes --------------------------------------------------------------------------

    def pin(self, key: Key) -> None:
        self._entries[key].pins += 1

    def unpin(self, key: Key) -> None:
        entry = self._entries.get(key)
        assert entry is not None and entry.pins > 0, f"unpin of unpinned key in {self.name}"
        entry.pins -= 1

    def touch(self, key: Key) -> None:
        if key in self._entries:
            self.policy.touch(key)

    def reserve(
        self, keys: list[Key], protect: Iterable[Key] = ()
    ) -> tuple[list[int | None], list[Key]] | None:
        """Admit ``keys`` (not present yet) as not-ready entries, evicting as needed.

        Returns ``(slots, evicted keys)``, or None when not enough entries can be evicted
        (then nothing changed). Keys in ``protect`` are never evicted here."""
        assert all(k not in self._entries for k in keys), "reserve of a present key"
        need = len(keys) - self.num_free
        evicted: list[Key] = []
        if need > 0:
            guarded = set(protect)
            victims = self.policy.evict(need, lambda k: k not in guarded and self.evictable(k))
            if victims is None:
                return None
            for key in victims:
                self._release(key)
            evicted = victims
        slots: list[int | None] = []
        for key in keys:
            slot = heapq.heappop(self._free_slots) if self.with_slots else None
            self._entries[key] = TierEntry(slot)
            self.policy.insert(key)
            slots.append(slot)
        return slots, evicted

    def insert_ready(self, key: Key) -> bool:
        """Register an existing, complete entry (a file found at start); False when full."""
        if key in self._entries or self.num_free == 0:
            return False
        slot = heapq.heappop(self._free_slots) if self.with_slots else None
        self._entries[key] = TierEntry(slot, ready=True)
        self.policy.insert(key)
        return True

    def commit(self, key: Key, verified: bool = False) -> None:
        """The entry's bytes are complete (and, with ``verified``, known good)."""
        entry = self._entries[key]
        entry.ready = True
        entry.verified = entry.verified or verified

    def discard(self, key: Key) -> None:
        """Drop an entry whose write failed or whose data is bad (not an eviction)."""
        if key in self._entries:
            self.policy.remove(key)
            self._release(key)

    def evict_unpinned(self) -> list[Key]:
        """Drop every ready, unpinned entry (a cache reset); returns them."""
        victims = [k for k in self._entries if self.evictable(k)]
        for key in victims:
            self.discard(key)
        return victims

    def _release(self, key: Key) -> None:
        entry = self._entries.pop(key)
        if entry.slot is not None:
            heapq.heappush(self._free_slots, entry.slot)

    # -- invariants -----------------------------------------------------------------------

    def check_integrity(self) -> None:
        entries = self._entries
        assert len(entries) <= self.capacity, f"{self.name}: over capacity"
        assert set(self.policy.keys()) == set(entries), f"{self.name}: policy and index differ"
        assert all(e.pins >= 0 for e in entries.values()), f"{self.name}: negative pins"
        if self.with_slots:
            used = [e.slot for e in entries.values()]
            assert len(set(used)) == len(used), f"{self.name}: a slot is used twice"
            assert not set(used) & set(self._free_slots), f"{self.name}: used slot is free"
            assert len(used) + len(self._free_slots) == self.capacity, f"{self.name}: lost slot"
            assert all(s is not None and 0 <= s < self.capacity for s in used)
