"""Small shared types of the connector protocol: roles, the block copy op, one worker's
transfer results, cache-hit sources, and the KV layout kvferry allocates."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = [
    "KV_CACHE_LAYOUT",
    "CacheHitSource",
    "CopyBlocksOp",
    "KVConnectorRole",
    "KVConnectorTransferResults",
]

# kvferry's per-layer KV tensor is (2, num_blocks, block_size, num_kv_heads, head_dim); by
# default its memory is in that order too (inside a block, tokens then heads then head dims),
# which vLLM's attention backends call "NHD". A connector may ask for "HND" instead (see
# kvferry.kv_layout); KVCacheConfig.layout says which one a pool has.
KV_CACHE_LAYOUT = "NHD"

# (src caches, dst caches, src block ids, dst block ids, direction): copies whole blocks of
# every layer named in both dicts. "d2h" reads engine KV into a host buffer, "h2d" the reverse.
CopyBlocksOp = Callable[
    [dict[str, torch.Tensor], dict[str, torch.Tensor], list[int], list[int], Literal["h2d", "d2h"]],
    None,
]


class KVConnectorRole(enum.IntEnum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class KVConnectorTransferResults:
    """One worker's asynchronous transfer completions since the last call: requests whose
    sends finished, whose receives finished, and, of the latter, whose receive failed (a failed
    receive is always also in ``finished_recving``, so its request leaves the wait state)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class CacheHitSource(str, enum.Enum):
    """The tier external hit tokens came from, nearest to the engine first (as in vLLM)."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    # A connector that does not say; last, so a mix with a known tier never hides it.
    EXTERNAL_UNSPECIFIED = "external_unspecified"

    @classmethod
    def outermost(cls, sources: Iterable[CacheHitSource]) -> CacheHitSource:
        """The one of ``sources`` farthest from the engine."""
        order = list(cls)
        return max(sources, key=order.index)
