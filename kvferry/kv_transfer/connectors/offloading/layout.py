"""Sizes and the disk folder of an offload connector, derived the same way on both roles,
with the disk tier's key (from the deployment secret) that names the folder and checks files;
and the few engine facts they are derived from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_transfer.connectors.offloading.options import OffloadingOptions
from kvferry.kv_transfer.offload.disk import (
    DEFAULT_READ_TIMEOUT_S,
    file_bytes,
    layout_fingerprint,
    model_fingerprint,
    payload_bytes,
)
from kvferry.kv_transfer.secret import load_deployment_secret
from kvferry.model.parallel import tp_rank


@dataclass(frozen=True)
class EngineFacts:
    prefix_caching: bool
    world_size: int
    model_path: str | None
    # The prefix-cache hash algorithm: chunk keys are block hashes, so it names the disk folder.
    hash_algo: str = "kvferry"


def engine_facts(config: Any) -> EngineFacts:
    """What the offloaders need from the engine config (tests may pass a partial one)."""
    cache = getattr(config, "cache_config", None)
    parallel = getattr(config, "parallel_config", None)
    model = getattr(config, "model_config", None)
    return EngineFacts(
        prefix_caching=bool(getattr(cache, "enable_prefix_caching", True)),
        world_size=int(getattr(parallel, "tensor_parallel_size", 1)),
        model_path=getattr(model, "model", None),
        hash_algo=str(getattr(cache, "prefix_caching_hash_algo", "kvferry")),
    )


@dataclass(frozen=True)
class OffloadLayout:
    block_size: int
    blocks_per_chunk: int
    bytes_per_block: int
    num_host_chunks: int
    num_disk_chunks: int
    disk_folder: Path | None
    fingerprint: str
    disk_key: bytes | None = field(default=None, repr=False)
    disk_read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    world_size: int = 1  # tensor-parallel ranks, each with its own folder under the fingerprint

    def rank_folders(self) -> list[Path]:
        """Every rank's disk folder (a chunk is on disk once all of them hold its file)."""
        if self.disk_folder is None:
            return []
        return [self.disk_folder.parent / f"rank{r}" for r in range(self.world_size)]

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    @property
    def chunk_payload(self) -> int:
        return payload_bytes(self.bytes_per_block, self.blocks_per_chunk)

    @property
    def file_size(self) -> int:
        return file_bytes(self.bytes_per_block, self.blocks_per_chunk, self.disk_key is not None)


def resolve_layout(
    opts: OffloadingOptions, kv_cache_config: KVCacheConfig, facts: EngineFacts, owner: str
) -> OffloadLayout:
    group = kv_cache_config.groups[0]
    per_block = kv_cache_config.bytes_per_block
    b = opts.blocks_per_chunk
    folder, fingerprint, n_disk, key = None, "", 0, None
    if opts.disk_path is not None:
        secret = load_deployment_secret(
            {"secret_file": opts.secret_file} if opts.secret_file is not None else None
        )
        key = secret.key_for("disk-tier") if secret is not None else None
        fingerprint = layout_fingerprint(
            model_fingerprint(facts.model_path),
            # Distinct KV tensors: a chunk file holds each one's blocks.
            len(kv_cache_config.kv_cache_tensors),
            group.num_kv_heads,
            group.head_dim,
            group.dtype,
            group.block_size,
            b,
            key,
            facts.hash_algo,
            kv_cache_config.layout,
        )
        # One folder per rank: each holds its own shard of the KV heads (the scheduler half,
        # in the engine process, is rank 0; it reads every rank's folder when restoring).
        folder = Path(opts.disk_path) / fingerprint / f"rank{tp_rank()}"
        n_disk = opts.num_disk_file_chunks(file_bytes(per_block, b, key is not None), owner)
    return OffloadLayout(
        block_size=group.block_size,
        blocks_per_chunk=b,
        bytes_per_block=per_block,
        num_host_chunks=opts.num_host_chunks(per_block * b, owner),
        num_disk_chunks=n_disk,
        disk_folder=folder,
        fingerprint=fingerprint,
        disk_key=key,
        disk_read_timeout_s=opts.disk_read_timeout_s,
        world_size=facts.world_size,
    )
