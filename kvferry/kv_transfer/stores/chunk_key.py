"""Store keys of KV chunks.

A chunk is ``blocks_per_chunk`` consecutive full blocks of a prompt; its key is the chained
block hash of its last block (which names the whole prefix up to there) under a *namespace*:
a fingerprint of the model (its config and a sample of its weights), the KV layout (layers,
KV heads, head size, dtype, block size, chunk size), the prefix-cache hash algorithm, the
number of ranks that split the heads, and (when values are keyed) an identifier of the key.
Engines that differ in any of these never read each other's KV; engines that agree share
every chunk. One value per chunk and rank (each rank holds its own shard of the KV heads).

Key text: ``kvferry/<namespace>/<hash hex>/r<rank>``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvferry.kv_layout import KVCacheLayout
from kvferry.kv_transfer.offload.disk import layout_fingerprint, model_fingerprint

KEY_PREFIX = "kvferry"


@dataclass(frozen=True)
class ChunkLayout:
    """What a chunk's bytes depend on."""

    model_digest: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    blocks_per_chunk: int
    hash_algo: str = "kvferry"
    world_size: int = 1
    kv_layout: KVCacheLayout = KVCacheLayout.NHD


def store_namespace(layout: ChunkLayout, value_key: bytes | None = None) -> str:
    """The namespace of every key of one model, layout, rank split and value key."""
    base = layout_fingerprint(
        layout.model_digest,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.dtype,
        layout.block_size,
        layout.blocks_per_chunk,
        value_key,
        layout.hash_algo,
        layout.kv_layout,
    )
    if layout.world_size == 1:
        return base
    return f"{base}-tp{layout.world_size}"


def model_digest(model_path: str | None) -> str:
    """The model part of the namespace (see :func:`model_fingerprint`)."""
    return model_fingerprint(model_path)


def chunk_key(namespace: str, block_hash: bytes, rank: int = 0) -> str:
    return f"{KEY_PREFIX}/{namespace}/{block_hash.hex()}/r{rank}"


def key_digest(key: str) -> bytes:
    """16 bytes that bind a value to its key (a value copied under another key is refused)."""
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"kvferry-mc-key").digest()


def namespace_digest(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16, person=b"kvferry-mc-ns").digest()
