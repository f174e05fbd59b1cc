"""KV cache events of the offload tiers: host memory (``CPU``) and the disk (``STORAGE``).

The manager knows a chunk only by its key (the hash of its last block), but a router needs
each block's hash, the parent hash and the tokens to match prompts. So the connector's
scheduler half describes a chunk (:meth:`ChunkEvents.describe`) while its request is at
hand: when it plans the chunk's store, and when a lookup meets a chunk it did not store (a
file an earlier engine left). The manager then reports what each tier gains and loses.

A chunk is announced in a tier once (the first time the tier holds it complete) and withdrawn
once, block by block: every block of the chunk is in the events. A chunk without a
description (a file found at start that no request asked for yet) is not announced, nor is
its removal. A description lives while some tier holds the chunk.
"""

from __future__ import annotations

from collections.abc import KeysView
from dataclasses import dataclass, field

import msgspec

from kvferry.kv_events.block_runs import GROUP_IDX, blocks_stored
from kvferry.kv_events.events import (
    KV_CACHE_SPEC_FULL_ATTENTION,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvferry.kv_transfer.offload.policies import Key
from kvferry.request import Request

# Tier names as the manager calls them -> the medium their events carry.
TIER_MEDIA = {"cpu": MEDIUM_CPU, "disk": MEDIUM_STORAGE}


@dataclass
class _Chunk:
    stored: BlockStored  # the chunk's BlockStored, medium filled in per tier
    announced: set[str] = field(default_factory=set)  # tiers that announced it


class ChunkEvents:
    """Descriptions of offloaded chunks and the events the tiers' changes make of them."""

    def __init__(self, block_size: int, blocks_per_chunk: int) -> None:
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self._chunks: dict[Key, _Chunk] = {}
        self._events: list[KVCacheEvent] = []

    def describe(self, request: Request, chunk: int, key: Key) -> None:
        """Chunk ``chunk`` of ``request`` is ``key`` (kept from the first description on)."""
        if key in self._chunks:
            return
        start = chunk * self.blocks_per_chunk
        event = blocks_stored(
            request.block_hashes,
            request.all_token_ids,
            start,
            start + self.blocks_per_chunk,
            self.block_size,
            MEDIUM_CPU,
            request.cache_salt,
            kv_cache_spec_kind=KV_CACHE_SPEC_FULL_ATTENTION,  # group 0's chunks only
        )
        self._chunks[key] = _Chunk(event)

    def stored(self, tier: str, key: Key) -> None:
        """``tier`` now holds ``key`` complete."""
        chunk = self._chunks.get(key)
        if chunk is None or tier in chunk.announced:
            return
        chunk.announced.add(tier)
        medium = TIER_MEDIA[tier]
        event = chunk.stored
        if event.medium != medium:
            event = msgspec.structs.replace(event, medium=medium)
        self._events.append(event)

    def removed(self, tier: str, key: Key, still_held: bool) -> None:
        """``tier`` dropped ``key``; ``still_held``: another tier still has it (or will)."""
        chunk = self._chunks.get(key)
        if chunk is None:
            return
        if tier in chunk.announced:
            chunk.announced.discard(tier)
            self._events.append(
                BlockRemoved(
                    block_hashes=list(chunk.stored.block_hashes),
                    medium=TIER_MEDIA[tier],
                    group_idx=GROUP_IDX,
                )
            )
        if not still_held:
            del self._chunks[key]

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def described_keys(self) -> KeysView[Key]:
        """The chunks described (for leak checks)."""
        return self._chunks.keys()
