"""EvictionPolicy: which stored keys an offload tier gives up first when it needs room."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

# Chunk keys are the engine's chained block hashes (bytes), stable across processes.
Key = bytes


class EvictionPolicy(ABC):
    """Orders the keys of one tier for eviction.

    Contract (the tier calls these; a policy never decides on its own to drop a key):

    * :meth:`insert` once when a key is admitted (its data may still be in flight),
    * :meth:`touch` on every use of a present key (a lookup hit or a repeated store offer),
    * :meth:`remove` when the tier drops a key for another reason than eviction (a failed
      store, a corrupt file, a reset),
    * :meth:`evict` to choose ``n`` victims among the keys ``can_evict`` accepts. It is atomic:
      either it returns exactly ``n`` keys, already forgotten by the policy, or None and
      changes nothing. Keys the tier pins (being read or written) are never accepted.

    A policy holds no data, only keys, and is used from one thread (the scheduler's).
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"an eviction policy needs a positive capacity, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key) -> None: ...

    @abstractmethod
    def touch(self, key: Key) -> None: ...

    @abstractmethod
    def remove(self, key: Key) -> None: ...

    @abstractmethod
    def evict(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key] | None: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def keys(self) -> Iterator[Key]:
        """Resident keys (ghost entries excluded), in no particular order."""
