"""KV cache groups in the offload connectors (hybrid models, ``SupportsHMA``).

Chunk ``c`` of a request exists once per group: its blocks ``[c * blocks_per_chunk, (c + 1)
* blocks_per_chunk)`` of that group's table. Group 0 (full attention) keeps the chunk key
(the block hash of the chunk's last block); another group's copy of the same chunk holds
other layers' KV, so it is offloaded under :func:`group_key`. A sliding-window group's copy
is stored only while all its blocks are still held (blocks that left the window go back to
the pool), and a hit needs only the copies its window reads at the hit's end
(:func:`window_chunks`). KV cache events describe group 0's chunks only.
"""

from __future__ import annotations

import hashlib

from kvferry.kv_transfer.offload.policies import Key

_TAG = b"kvferry-offload-group\x00"


def group_key(key: Key, group: int) -> Key:
    """The offload key of group ``group``'s copy of the chunk keyed ``key`` (group 0: the
    key itself); the same length as ``key``."""
    if group == 0:
        return key
    return hashlib.sha256(_TAG + bytes([group]) + key).digest()[: len(key)]


def first_window_block(num_tokens: int, window: int, block_size: int) -> int:
    """The first block the token at position ``num_tokens`` reads in a window of ``window``."""
    return max(0, num_tokens - window + 1) // block_size


def window_chunks(
    end_chunk: int, first_chunk: int, window: int, block_size: int, blocks_per_chunk: int
) -> range:
    """The chunks below ``end_chunk`` (and from ``first_chunk``) a sliding-window group must
    load for a hit ending at chunk ``end_chunk``."""
    chunk_tokens = block_size * blocks_per_chunk
    first = first_window_block(end_chunk * chunk_tokens, window, block_size) // blocks_per_chunk
    return range(max(first, first_chunk), end_chunk)
