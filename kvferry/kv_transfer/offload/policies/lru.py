"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvferry.kv_transfer.offload.policies.base import EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    """Evicts the key used longest ago. Inserts and touches move a key to the young end."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key] | None:
        if n <= 0:
            return []
        victims: list[Key] = []
        for key in self._order:  # oldest first
            if can_evict(key):
                victims.append(key)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def keys(self) -> Iterator[Key]:
        return iter(self._order)
