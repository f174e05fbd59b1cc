"""Adaptive replacement cache (ARC, Megiddo and Modha 2003) as an eviction policy.

Resident keys live in T1 (seen once recently) or T2 (seen at least twice); evicted keys are
remembered, without data, in the ghost lists B1 and B2. ``target_t1`` is the size T1 should
have: a key coming back from B1 means T1 was evicted too eagerly (grow it), one coming back
from B2 means T2 was (shrink T1). A scan of one-off prefixes therefore cannot flush the
prefixes that are reused, which plain LRU lets happen.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvferry.kv_transfer.offload.policies.base import EvictionPolicy, Key


class ARCPolicy(EvictionPolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self.target_t1 = 0.0

    def insert(self, key: Key) -> None:
        if key in self.t1 or key in self.t2:
            self.touch(key)
            return
        if key in self.b1:
            # T1 lost this key too early: make T1 bigger.
            self.target_t1 = min(
                float(self.capacity), self.target_t1 + max(1.0, len(self.b2) / len(self.b1))
            )
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.target_t1 = max(0.0, self.target_t1 - max(1.0, len(self.b1) / len(self.b2)))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        if n <= 0:
            return []
        t1 = (k for k in self.t1 if can_evict(k))
        t2 = (k for k in self.t2 if can_evict(k))
        size_t1, size_t2 = len(self.t1), len(self.t2)
        victims: list[tuple[Key, bool]] = []  # (key, came from T1)
        while len(victims) < n:
            prefer_t1 = size_t1 > 0 and (size_t1 > self.target_t1 or size_t2 == 0)
            first, second = (t1, t2) if prefer_t1 else (t2, t1)
            key = next(first, None)
            from_t1 = prefer_t1
            if key is None:
                key, from_t1 = next(second, None), not prefer_t1
            if key is None:
                return None  # fewer than n evictable keys: change nothing
            victims.append((key, from_t1))
            if from_t1:
                size_t1 -= 1
            else:
                size_t2 -= 1
        for key, from_t1 in victims:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        self._trim_ghosts()
        return [k for k, _ in victims]

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def keys(self) -> Iterator[Key]:
        yield from self.t1
        yield from self.t2
