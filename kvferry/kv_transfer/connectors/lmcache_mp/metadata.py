"""What the LMCacheMPConnector's scheduler half sends its worker half each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.kv_transfer.base import KVConnectorMetadata


@dataclass
class ChunkOp:
    """One retrieve or store of the chunk-aligned token range ``[start, end)`` of a request.

    ``token_ids`` are the request's tokens from 0 (LMCache keys a chunk by its whole prefix),
    at least ``end`` of them; ``block_ids`` are the engine blocks holding ``[start, end)``, in
    order. A retrieve leaves the first ``skip_first_n_tokens`` of the range unwritten: they
    sit in blocks of the engine's own prefix-cache hit, which other requests may share.
    """

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int
    skip_first_n_tokens: int = 0
    cache_salt: str = ""


@dataclass
class LMCacheMPConnectorMetadata(KVConnectorMetadata):
    """``loads`` start before the forward; ``stores`` are submitted after it (the forward
    computed their KV). ``preempted``: requests lost their blocks this step, so copies still
    reading engine blocks must finish before the forward overwrites them."""

    loads: list[ChunkOp] = field(default_factory=list)
    stores: list[ChunkOp] = field(default_factory=list)
    preempted: bool = False
