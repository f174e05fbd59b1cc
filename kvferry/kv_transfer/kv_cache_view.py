"""What a connector may read of the scheduler's KV cache: read-only protocols.

The scheduler's ``KVCacheManager`` and the ``KVCacheBlocks`` it allocates satisfy these
structurally, so connectors depend on this module and never on ``kvferry.core``. The scheduler
binds its manager once (``bind_kv_cache_manager``) and passes every allocation to
``update_state_after_alloc``; a connector only reads them and never changes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvferry.request import BlockHash


class KVCacheBlockView(Protocol):
    """One block of the engine's paged pool."""

    @property
    def block_id(self) -> int: ...

    # The prefix-cache hash while the block is published; None while it fills or once evicted.
    @property
    def block_hash(self) -> BlockHash | None: ...

    # The KV cache group whose prefix cache holds it (meaningful while block_hash is set;
    # hybrid models have several groups, 0 is full attention).
    @property
    def group_id(self) -> int: ...


class KVCacheBlocksView(Protocol):
    """Blocks per KV cache group, in block-table order (e.g. those a request was just given)."""

    def get_block_ids(self) -> tuple[list[int], ...]: ...


class KVCacheManagerView(Protocol):
    """The read API of the scheduler's KV cache manager."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    def get_num_free_blocks(self) -> int: ...

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]: ...

    def eviction_candidates(self, max_blocks: int) -> Sequence[KVCacheBlockView]:
        """The next ``max_blocks`` free blocks the pool hands out, oldest first: the next
        prefix-cache evictions (a snapshot; the pool may change it next step)."""
        ...
