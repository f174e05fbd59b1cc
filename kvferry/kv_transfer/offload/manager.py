"""The scheduler side of offloading: which chunks are stored where, and what to move next.

:class:`TieredOffloadingManager` implements :class:`OffloadingManager` (``manager_base``)
over a host-memory tier and an optional disk tier (:class:`TierIndex` each, with its own
eviction policy). The manager plans, the worker
moves bytes: every change whose bytes are not in place yet stays *pending* until the
connector reports the job done (``complete_*``).

Tiering: every chunk stored on the host is also written to disk (write-through), and a host
chunk stays pinned until its file is written, so evicting it from the host never loses data.
When the host has no room at all, chunks are written from the engine straight to disk.

A chunk found only on disk answers RETRY. A file this engine wrote or already checked
(*verified*) can be loaded straight into the engine. Any other file (one found at start) is
first read and checksummed: :meth:`prefetch` copies it into a host slot (PROMOTE) when there
is room, else :meth:`request_verify` just checks it (VERIFY); only then is it offered. A
corrupt or truncated file therefore turns into a miss before any engine block was promised.
A loader still checks every file it reads, so bytes that went bad later fail that load (the
engine's ``kv_load_failure_policy`` applies) and never reach the engine's KV.

KV cache events (when the connector sets :attr:`TieredOffloadingManager.events`): a chunk is
announced in a tier when its bytes there are complete (a store, a disk write, a promotion, a
file that checked out) and withdrawn when the tier evicts or drops it; see
:mod:`kvferry.kv_transfer.offload.events`.
"""

from __future__ import annotations

from collections import OrderedDict

from kvferry.kv_events.events import KVCacheEvent
from kvferry.kv_transfer.offload.events import ChunkEvents
from kvferry.kv_transfer.offload.manager_base import (
    DiskOps,
    LookupStatus,
    OffloadingManager,
    StorePlan,
)
from kvferry.kv_transfer.offload.policies import Key
from kvferry.kv_transfer.offload.stats import LookupStats
from kvferry.kv_transfer.offload.tier import TierIndex


class TieredOffloadingManager(OffloadingManager):
    def __init__(
        self,
        host: TierIndex,
        disk: TierIndex | None,
        stats: LookupStats,
        store_threshold: int = 1,
        max_tracker_size: int = 64000,
    ) -> None:
        self.host = host
        self.disk = disk
        self.stats = stats
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._offers: OrderedDict[Key, int] = OrderedDict()  # store threshold counter
        # owner -> {(tier name, key): holds}
        self._owners: dict[str, dict[tuple[str, Key], int]] = {}
        self._from_disk: set[Key] = set()  # host chunks that were promoted from disk
        self._writing: set[Key] = set()  # host chunks pinned until their file is written
        self._verifying: set[Key] = set()  # files being checked (pinned meanwhile)
        self._ops = DiskOps()
        # Set by the connector when KV cache events are on; None: nothing is recorded.
        self.events: ChunkEvents | None = None

    # -- lookups and holds ----------------------------------------------------------------

    def lookup(self, key: Key) -> LookupStatus:
        entry = self.host.get(key)
        if entry is not None:
            return LookupStatus.HIT if entry.ready else LookupStatus.PENDING
        if self.disk is not None:
            d = self.disk.get(key)
            if d is not None:
                return LookupStatus.RETRY if d.ready else LookupStatus.PENDING
        return LookupStatus.MISS

    def _tier(self, name: str) -> TierIndex:
        if name == self.host.name:
            return self.host
        assert self.disk is not None
        return self.disk

    def pin(self, owner: str, key: Key, tier: str = "cpu") -> None:
        """Hold ``key`` in ``tier`` ("cpu" or "disk") for ``owner``."""
        self._tier(tier).pin(key)
        held = self._owners.setdefault(owner, {})
        held[(tier, key)] = held.get((tier, key), 0) + 1

    def holds(self, owner: str, key: Key) -> bool:
        held = self._owners.get(owner, {})
        return ("cpu", key) in held or ("disk", key) in held

    def on_host(self, key: Key) -> bool:
        """In the host tier, complete or still being written."""
        return key in self.host

    def disk_loadable(self, key: Key) -> bool:
        """On disk, complete and verified: a load may read the file straight away."""
        if self.disk is None:
            return False
        entry = self.disk.get(key)
        return entry is not None and entry.ready and entry.verified

    def request_verify(self, key: Key) -> bool:
        """Queue a check of an unverified disk chunk (once); False without a disk entry."""
        if self.disk is None or not self.disk.is_ready(key):
            return False
        if key not in self._verifying:
            self._verifying.add(key)
            self.disk.pin(key)
            self._ops.verifies.append(key)
        return True

    def complete_verify(self, key: Key, ok: bool) -> None:
        assert self.disk is not None
        entry = self.disk.get(key)
        if key not in self._verifying or entry is None:
            return
        self._verifying.discard(key)
        self.disk.unpin(key)
        if ok:
            entry.verified = True
            self._stored("disk", key)
        else:
            self._drop_file(key)

    def prefetch(self, owner: str, key: Key) -> bool:
        assert self.disk is not None and self.disk.is_ready(key) and key not in self.host
        reserved = self.host.reserve([key])
        if reserved is None:
            return False
        slots, evicted = reserved
        self._host_evicted(evicted)
        self.disk.pin(key)
        self.disk.touch(key)
        self.pin(owner, key)
        assert slots[0] is not None
        self._ops.promotions.append((key, slots[0]))
        self._from_disk.add(key)
        return True

    def release(self, owner: str) -> None:
        self.drop_holds(self.take_holds(owner))

    def take_holds(self, owner: str) -> dict[tuple[str, Key], int]:
        """Detach an owner's holds without unpinning (so a new lookup can pin first and
        nothing it needs is evicted in between); pass them to :meth:`drop_holds` after."""
        return self._owners.pop(owner, {})

    def drop_holds(self, holds: dict[tuple[str, Key], int]) -> None:
        for (tier_name, key), n in holds.items():
            tier = self._tier(tier_name)
            if key in tier:
                for _ in range(n):
                    tier.unpin(key)

    def came_from_disk(self, key: Key) -> bool:
        return key in self._from_disk

    # -- loads ----------------------------------------------------------------------------

    def prepare_load(self, keys: list[Key]) -> list[int | None]:
        """Pin each chunk where it will be read from: its host slot, or None for a file."""
        slots: list[int | None] = []
        for key in keys:
            if self.host.is_ready(key):
                self.host.pin(key)
                self.host.touch(key)
                slots.append(self.host.slot(key))
            else:
                assert self.disk_loadable(key), "load of a chunk that is not ready"
                slots.append(None)
            if self.disk is not None and key in self.disk:
                self.disk.touch(key)
                if slots[-1] is None:
                    self.disk.pin(key)
        return slots

    def complete_load(self, keys: list[Key], slots: list[int | None], ok: bool) -> None:
        for key, slot in zip(keys, slots, strict=True):
            if slot is not None:
                self.host.unpin(key)
                continue
            assert self.disk is not None
            if key in self.disk:
                self.disk.unpin(key)
                if not ok:  # one of the job's files did not check out: drop them all
                    self._drop_file(key)

    # -- stores ---------------------------------------------------------------------------

    def _admitted(self, key: Key) -> bool:
        if self.store_threshold <= 1:
            return True
        n = self._offers.pop(key, 0) + 1
        if n >= self.store_threshold:
            return True
        self._offers[key] = n
        if len(self._offers) > self.max_tracker_size:
            self._offers.popitem(last=False)
        return False

    def prepare_store(self, keys: list[Key]) -> StorePlan:
        new: list[Key] = []
        for key in keys:
            if key in self.host:
                self.host.touch(key)
            elif self._admitted(key):
                new.append(key)
            else:
                self.stats.add("store_below_threshold")
        if not new:
            return StorePlan()
        guarded = set(keys)
        direct: list[Key] = []
        reserved = self.host.reserve(new, protect=guarded)
        if reserved is None:
            # Not all fit: as many as free slots plus evictable chunks allow, in order; the
            # rest go straight to disk when there is one.
            room = self.host.num_free + sum(
                1 for k in self.host if k not in guarded and self.host.evictable(k)
            )
            new, direct = new[:room], new[room:]
            reserved = self.host.reserve(new, protect=guarded) if new else ([], [])
            assert reserved is not None
        slots, evicted = reserved
        self._host_evicted(evicted)
        plan = StorePlan(new, [s for s in slots if s is not None])
        if self.disk is None:
            self.stats.add("store_skipped", len(direct))
            return plan
        direct_set = set(direct)
        for key in new + direct:
            if key in self.disk:
                self.disk.touch(key)
                continue
            got = self.disk.reserve([key], protect=guarded)
            if got is None:
                self.stats.add("store_skipped")
                continue
            self._disk_evicted(got[1])
            if key in direct_set:
                plan.disk_only.append(key)
            else:
                self.host.pin(key)
                self._writing.add(key)
                plan.disk_keys.append(key)
        return plan

    def complete_store(self, keys: list[Key], ok: bool) -> None:
        for key in keys:
            if key not in self.host:
                continue
            if ok:
                self.host.commit(key)
                self._stored("cpu", key)
            else:
                self._drop_host(key)

    def complete_disk_write(self, key: Key, ok: bool) -> None:
        if key in self._writing:
            self._writing.discard(key)
            if key in self.host:
                self.host.unpin(key)
        assert self.disk is not None
        if key not in self.disk:
            return
        if ok:
            self.disk.commit(key, verified=True)
            self._stored("disk", key)
        else:
            self.disk.discard(key)
            self._removed("disk", key)

    def complete_promote(self, key: Key, ok: bool) -> None:
        assert self.disk is not None
        if key in self.disk:
            self.disk.unpin(key)
        if not ok:  # the file did not check out: forget it everywhere, and remove it
            self._drop_host(key)
            self._drop_file(key)
        elif key in self.host:
            self.host.commit(key, verified=True)
            self._stored("cpu", key)
            entry = self.disk.get(key)
            if entry is not None:
                entry.verified = True
                self._stored("disk", key)

    # -- housekeeping ---------------------------------------------------------------------

    def _drop_host(self, key: Key) -> None:
        """Forget a host entry that never became valid, with every hold on it."""
        for held in self._owners.values():
            held.pop(("cpu", key), None)
        self._writing.discard(key)
        self._from_disk.discard(key)
        self.host.discard(key)
        self._removed("cpu", key)

    def _drop_file(self, key: Key) -> None:
        """A file is corrupt, truncated or missing: forget it, with its holds, and delete it."""
        assert self.disk is not None
        self.stats.add("corrupt_chunks")
        for held in self._owners.values():
            held.pop(("disk", key), None)
        if key in self.disk:
            self.disk.discard(key)
            self._removed("disk", key)
        self._ops.deletes.append(key)

    def _host_evicted(self, keys: list[Key]) -> None:
        for key in keys:
            self._from_disk.discard(key)
            self._removed("cpu", key)
        self.stats.add("evicted_host", len(keys))

    def _disk_evicted(self, keys: list[Key]) -> None:
        for key in keys:
            self._ops.deletes.append(key)
            self._removed("disk", key)
        self.stats.add("evicted_disk", len(keys))

    def _stored(self, tier: str, key: Key) -> None:
        if self.events is not None:
            self.events.stored(tier, key)

    def _removed(self, tier: str, key: Key) -> None:
        """After ``tier`` dropped ``key`` (evicted, or an entry that never became valid)."""
        if self.events is not None:
            held = key in self.host or (self.disk is not None and key in self.disk)
            self.events.removed(tier, key, held)

    def take_disk_ops(self) -> DiskOps:
        ops, self._ops = self._ops, DiskOps()
        return ops

    def forget_files(self, keys: list[Key]) -> None:
        """Queue deletion of files that are not (or no longer) in the disk index."""
        self._ops.deletes.extend(keys)

    def has_queued_ops(self) -> bool:
        ops = self._ops
        return bool(ops.promotions or ops.verifies or ops.deletes)

    def take_events(self) -> list[KVCacheEvent]:
        return self.events.take() if self.events is not None else []

    def reset(self) -> bool:
        """Drop every chunk nobody holds; False while some are held or in flight."""
        self._host_evicted(self.host.evict_unpinned())
        if self.disk is not None:
            self._disk_evicted(self.disk.evict_unpinned())
        busy = len(self.host) + (len(self.disk) if self.disk is not None else 0)
        return busy == 0

    def check_integrity(self, idle: bool = False) -> None:
        tiers = [self.host] + ([self.disk] if self.disk is not None else [])
        for tier in tiers:
            tier.check_integrity()
        # Every hold the manager knows of is reflected in the tiers' pin counts.
        pins: dict[tuple[str, Key], int] = {}
        for held in self._owners.values():
            for where, n in held.items():
                pins[where] = pins.get(where, 0) + n
        for key in self._writing:
            pins[("cpu", key)] = pins.get(("cpu", key), 0) + 1
        for key in self._verifying:
            pins[("disk", key)] = pins.get(("disk", key), 0) + 1
        for (tier_name, key), n in pins.items():
            entry = self._tier(tier_name).get(key)
            assert entry is not None, f"a hold on {key.hex()[:8]} that {tier_name} forgot"
            assert entry.pins >= n, f"{tier_name} {key.hex()[:8]}: pin count too low"
        if idle:
            assert not self._owners, f"holds left: {sorted(self._owners)}"
            assert not self._writing and not self._verifying, "disk work in flight"
            assert not self.has_queued_ops(), "disk work queued"
            for tier in tiers:
                assert tier.num_pinned() == 0, f"{tier.name} chunks still pinned"
                assert tier.num_pending() == 0, f"{tier.name} chunks still pending"
