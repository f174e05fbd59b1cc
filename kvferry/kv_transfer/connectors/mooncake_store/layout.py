"""The chunk layout, key namespace and value check of a MooncakeStoreConnector, derived the
same way on both roles from the engine config and the KV pool's shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_transfer.connectors.mooncake_store.options import MooncakeStoreOptions
from kvferry.kv_transfer.secret import load_deployment_secret
from kvferry.kv_transfer.stores.chunk_codec import ChunkCodec
from kvferry.kv_transfer.stores.chunk_key import (
    ChunkLayout,
    chunk_key,
    model_digest,
    namespace_digest,
    store_namespace,
)


@dataclass(frozen=True)
class StoreLayout:
    block_size: int
    blocks_per_chunk: int
    bytes_per_block: int
    namespace: str
    world_size: int
    value_key: bytes | None = field(default=None, repr=False)

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    @property
    def payload_bytes(self) -> int:
        return self.bytes_per_block * self.blocks_per_chunk

    def codec(self) -> ChunkCodec:
        return ChunkCodec(namespace_digest(self.namespace), self.payload_bytes, self.value_key)

    def key(self, block_hash: bytes) -> str:
        """The chunk's key without the rank suffix (``rank_key`` adds it)."""
        return chunk_key(self.namespace, block_hash, 0).rsplit("/", 1)[0]

    @staticmethod
    def rank_key(key: str, rank: int) -> str:
        return f"{key}/r{rank}"


def resolve_layout(
    config: Any, kv_cache_config: KVCacheConfig, opts: MooncakeStoreOptions
) -> StoreLayout:
    group = kv_cache_config.groups[0]
    cache = getattr(config, "cache_config", None)
    parallel = getattr(config, "parallel_config", None)
    model = getattr(config, "model_config", None)
    world = int(getattr(parallel, "tensor_parallel_size", 1))
    secret = load_deployment_secret(
        {"secret_file": opts.secret_file} if opts.secret_file is not None else None
    )
    value_key = secret.key_for("mooncake-store") if secret is not None else None
    chunk = ChunkLayout(
        model_digest=model_digest(getattr(model, "model", None)),
        num_layers=len(group.layer_names),
        num_kv_heads=group.num_kv_heads,
        head_dim=group.head_dim,
        dtype=group.dtype,
        block_size=group.block_size,
        blocks_per_chunk=opts.blocks_per_chunk,
        hash_algo=str(getattr(cache, "prefix_caching_hash_algo", "kvferry")),
        world_size=world,
        kv_layout=kv_cache_config.layout,
    )
    return StoreLayout(
        block_size=group.block_size,
        blocks_per_chunk=opts.blocks_per_chunk,
        bytes_per_block=kv_cache_config.bytes_per_block,
        namespace=store_namespace(chunk, value_key),
        world_size=world,
        value_key=value_key,
    )
