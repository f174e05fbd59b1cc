"""The contract of the scheduler-side offloading manager, and the small types it speaks.

:class:`OffloadingManager` is what an offload connector's scheduler half talks to; the
implementation kvferry ships is :class:`~kvferry.kv_transfer.offload.manager.TieredOffloadingManager`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvferry.kv_events.events import KVCacheEvent
from kvferry.kv_transfer.offload.policies import Key


class LookupStatus(enum.Enum):
    MISS = "miss"  # nowhere: stop looking
    HIT = "hit"  # on the host and complete: can be loaded now
    PENDING = "pending"  # being written (a store or a promotion): ask again soon
    RETRY = "retry"  # complete on disk only: prefetch it, then ask again


@dataclass
class DiskOps:
    """File work the worker must do: promotions ``(key, host slot)``, checks, deletions."""

    promotions: list[tuple[Key, int]] = field(default_factory=list)
    verifies: list[Key] = field(default_factory=list)
    deletes: list[Key] = field(default_factory=list)


@dataclass
class StorePlan:
    """Keys to copy to the host now and their host slots; which of them also go to disk
    (``disk_keys``, written from the host copy); and keys for which the host had no room,
    written from the engine's blocks straight to disk (``disk_only``)."""

    keys: list[Key] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    disk_keys: list[Key] = field(default_factory=list)
    disk_only: list[Key] = field(default_factory=list)


class OffloadingManager(ABC):
    """Scheduler-side bookkeeping of offloaded chunks. Single-threaded (the scheduler's).

    * ``lookup(key)`` is free of side effects. ``pin(owner, key)`` / ``prefetch(owner, key)``
      hold chunks for a request between its lookup and its allocation; ``release(owner)``
      drops all of an owner's holds (a new lookup of the owner replaces them, so repeated
      lookups are idempotent; the request's end releases them).
    * ``prepare_load(keys)`` pins the chunks for a load and returns their host slots;
      ``complete_load(keys)`` unpins them.
    * ``prepare_store(keys)`` admits the keys not stored yet (threshold, evictions) as pending
      entries and returns the plan; ``complete_store(keys, ok)`` publishes or drops them, and
      ``complete_disk_write(key, ok)`` does the same for a file.
    * ``take_disk_ops()`` returns the queued promotions, checks and file deletions.
    * ``take_events()`` returns the tiers' KV cache events since the last call (typed, with
      medium ``CPU`` or ``STORAGE``); [] unless the connector turned events on.
    """

    @abstractmethod
    def lookup(self, key: Key) -> LookupStatus: ...
    @abstractmethod
    def pin(self, owner: str, key: Key) -> None: ...
    @abstractmethod
    def prefetch(self, owner: str, key: Key) -> bool: ...
    @abstractmethod
    def release(self, owner: str) -> None: ...
    @abstractmethod
    def prepare_load(self, keys: list[Key]) -> list[int | None]: ...
    @abstractmethod
    def complete_load(self, keys: list[Key], slots: list[int | None], ok: bool) -> None: ...
    @abstractmethod
    def prepare_store(self, keys: list[Key]) -> StorePlan: ...
    @abstractmethod
    def complete_store(self, keys: list[Key], ok: bool) -> None: ...
    @abstractmethod
    def complete_disk_write(self, key: Key, ok: bool) -> None: ...
    @abstractmethod
    def complete_promote(self, key: Key, ok: bool) -> None: ...
    @abstractmethod
    def take_disk_ops(self) -> DiskOps: ...
    @abstractmethod
    def take_events(self) -> list[KVCacheEvent]: ...
    @abstractmethod
    def reset(self) -> bool: ...
    @abstractmethod
    def check_integrity(self, idle: bool = False) -> None: ...
