"""KV cache events: which blocks an engine (or a connector's tier) now holds or dropped.

Routers and indexers (llm-d's KV-cache indexer, Dynamo's KV router, ``kvferry proxy
--policy kv_aware``) learn from these which instance holds which prefix. The wire format is
vLLM's, so the same subscribers read kvferry and vLLM alike:

- an event is a msgspec struct encoded as a MessagePack map, tagged with its class name
  (``{"type": "BlockStored", ...}``), fields left out when they hold their default;
- a batch (``KVEventBatch``) is encoded as an array ``[ts, events, data_parallel_rank]``.

Field names, order and defaults are vLLM's (``vllm.distributed.kv_events``), which is what
the compatibility test checks by decoding kvferry's bytes with vLLM's own classes.

``medium`` says where the block lives: :data:`MEDIUM_GPU` for the engine's paged pool (vLLM's
name for it, also on CPU engines, so routers built for vLLM rank it first), :data:`MEDIUM_CPU`
for host-memory offload, :data:`MEDIUM_STORAGE` for disk and remote stores.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "KV_CACHE_SPEC_FULL_ATTENTION",
    "KV_CACHE_SPEC_SLIDING_WINDOW",
    "MAIN_ATTENTION_KINDS",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "external_block_hash",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

# ``BlockStored.kv_cache_spec_kind``: the attention type of the block's KV cache group, in
# vLLM's words (``KVCacheSpecKind`` values; kvferry's groups are one of the first two).
KV_CACHE_SPEC_FULL_ATTENTION = "full_attention"
KV_CACHE_SPEC_SLIDING_WINDOW = "sliding_window"
# Kinds whose blocks hold every earlier token's KV: a prompt's reusable prefix is bounded by
# these groups alone, so routers match prompts against them (Dynamo's "main attention").
MAIN_ATTENTION_KINDS = frozenset(
    {KV_CACHE_SPEC_FULL_ATTENTION, "mla_attention", "sink_full_attention"}
)

# A block hash as events carry it: vLLM publishes the low 64 bits of the hash as an int by
# default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) and the raw bytes otherwise.
ExternalBlockHash = bytes | int


def external_block_hash(block_hash: bytes, as_int: bool = True) -> ExternalBlockHash:
    """The published form of an engine block hash (see :data:`ExternalBlockHash`)."""
    if not as_int:
        return bytes(block_hash)
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the tagged events below."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one request became available in ``medium``.

    ``block_hashes`` are chained: the first one's parent is ``parent_block_hash`` (None for
    a prompt's first block); ``token_ids`` are the blocks' tokens, ``block_size`` per block.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None

    def __hash__(self) -> int:
        return hash(
            (
                tuple(self.block_hashes),
                self.parent_block_hash,
                tuple(self.token_ids),
                self.block_size,
                self.lora_id,
                self.medium,
                tuple(self.extra_keys) if self.extra_keys else None,
                self.group_idx,
                self.kv_cache_spec_kind,
                self.kv_cache_spec_sliding_window,
                self.locality,
                self.ownership,
                self.session_id,
            )
        )


class BlockRemoved(KVCacheEvent):
    """Blocks that ``medium`` no longer holds (evicted or dropped)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __hash__(self) -> int:
        return hash(
            (tuple(self.block_hashes), self.medium, self.group_idx, self.locality, self.ownership)
        )


class AllBlocksCleared(KVCacheEvent):
    """The publisher's whole cache was reset (every block it announced is gone)."""

    def __hash__(self) -> int:
        return hash("AllBlocksCleared")


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """The MessagePack payload of one batch, byte-compatible with vLLM's publisher."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse one payload; raises ``msgspec.ValidationError``/``DecodeError`` on bad input."""
    return _DECODER.decode(payload)
