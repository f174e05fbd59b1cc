"""The events every source builds for a run of one sequence's blocks.

The engine's prefix cache and the connectors' tiers describe blocks the same way, so a
router sees one shape whatever the medium: the blocks' chained hashes in their published
form, the parent of the first one, the blocks' own tokens, and per-block ``extra_keys`` as
vLLM publishes them (the cache salt on the first block, None on the others).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvferry.kv_events.events import BlockRemoved, BlockStored, external_block_hash

# The KV cache group events describe when a source does not say: group 0, the full-attention
# group (kvferry puts full attention first; vLLM names the group in every block event).
GROUP_IDX = 0


def blocks_stored(
    block_hashes: Sequence[bytes],
    token_ids: Sequence[int],
    start: int,
    end: int,
    block_size: int,
    medium: str,
    cache_salt: str | None = None,
    group_idx: int = GROUP_IDX,
    kv_cache_spec_kind: str | None = None,
    kv_cache_spec_sliding_window: int | None = None,
) -> BlockStored:
    """``BlockStored`` for blocks ``[start, end)`` of a sequence whose full-block hashes are
    ``block_hashes`` and whose tokens are ``token_ids`` (both from the sequence's start), held
    by KV cache group ``group_idx`` (its attention type and window as vLLM names them, or
    None where the source does not know them)."""
    assert 0 <= start < end <= len(block_hashes), "block run out of range"
    extra_keys: list[tuple[Any, ...] | None] = [None] * (end - start)
    if start == 0 and cache_salt:  # vLLM adds no key for an empty salt
        extra_keys[0] = (cache_salt,)
    return BlockStored(
        block_hashes=[external_block_hash(h) for h in block_hashes[start:end]],
        parent_block_hash=external_block_hash(block_hashes[start - 1]) if start else None,
        token_ids=list(token_ids[start * block_size : end * block_size]),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=extra_keys,
        group_idx=group_idx,
        kv_cache_spec_kind=kv_cache_spec_kind,
        kv_cache_spec_sliding_window=kv_cache_spec_sliding_window,
    )


def blocks_removed(
    block_hashes: Iterable[bytes], medium: str, group_idx: int = GROUP_IDX
) -> BlockRemoved:
    """``BlockRemoved`` for blocks that group ``group_idx`` of ``medium`` no longer holds."""
    return BlockRemoved(
        block_hashes=[external_block_hash(h) for h in block_hashes],
        medium=medium,
        group_idx=group_idx,
    )
