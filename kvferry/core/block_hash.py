"""Chained block hashes that identify KV content across processes and machines.

A block's hash names the KV that a model produces for the block's tokens *given everything
before them*, so each hash folds in its parent's hash. Hashes travel between engine
instances (prefix caches, offload stores, P/D peers), so they must not depend on the Python
process: we hash a canonical byte encoding with SHA-256 — never ``pickle`` (its output is not
a stable format and unpickling peer data is unsafe) and never ``hash()`` (salted per process).

Canonical encoding of one block (all integers big-endian)::

    b"kvferry-block-v1\\x00"      domain tag, bumped if the encoding ever changes
    parent hash                   32 bytes; NONE_HASH for the first block
    u32 token count, u64 * count  the block's token ids
    u32 extra-key count           then per key: 1 type byte, u32 length, payload
                                  (b"s" UTF-8 str, b"i" i64 int, b"b" raw bytes)

Only full blocks are hashed: a partial block's KV is still growing and cannot be shared.

This is the default ``prefix_caching_hash_algo`` ("kvferry"). vLLM's algorithms, which routers
built for vLLM recompute from token ids, are in :mod:`kvferry.core.vllm_block_hash`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvferry.core.vllm_block_hash import VllmBlockHasher, digest_size
from kvferry.request import BlockHash

if TYPE_CHECKING:
    from kvferry.request import Request

ExtraKey = str | int | bytes

# Fixed, documented seed: every process and every machine derives the same root hash, which
# is what lets two engines agree on block identities without talking to each other.
NONE_HASH_SEED = b"kvferry-none-hash"
NONE_HASH: BlockHash = hashlib.sha256(NONE_HASH_SEED).digest()

_DOMAIN_TAG = b"kvferry-block-v1\x00"
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")


def _encode_extra_key(key: ExtraKey) -> bytes:
    # bool is an int subclass; refuse it so True and 1 cannot silently collide.
    if isinstance(key, bool):
        raise TypeError("block hash extra keys must be str, int or bytes, not bool")
    if isinstance(key, str):
        tag, payload = b"s", key.encode("utf-8")
    elif isinstance(key, int):
        tag, payload = b"i", _I64.pack(key)
    elif isinstance(key, bytes):
        tag, payload = b"b", key
    else:
        raise TypeError(f"block hash extra keys must be str, int or bytes, got {type(key)}")
    return tag + _U32.pack(len(payload)) + payload


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] | None = None,
) -> BlockHash:
    """Return the 32-byte SHA-256 hash of one block chained onto ``parent_hash``.

    ``parent_hash=None`` means "first block" and chains onto :data:`NONE_HASH`. Token ids must
    fit in an unsigned 64-bit integer. ``extra_keys`` distinguish blocks whose tokens are equal
    but whose KV must not be shared (e.g. a cache salt); order matters.
    """
    parent = NONE_HASH if parent_hash is None else parent_hash
    if len(parent) != len(NONE_HASH):
        raise ValueError(f"parent hash must be {len(NONE_HASH)} bytes, got {len(parent)}")
    n = len(token_ids)
    try:
        packed_tokens = struct.pack(f">{n}Q", *token_ids)
    except struct.error:
        raise ValueError("token ids must be integers in [0, 2**64)") from None
    parts = [_DOMAIN_TAG, parent, _U32.pack(n), packed_tokens]
    keys = extra_keys or ()
    parts.append(_U32.pack(len(keys)))
    parts.extend(_encode_extra_key(k) for k in keys)
    return hashlib.sha256(b"".join(parts)).digest()


def _block_extra_keys(block_index: int, cache_salt: str | None) -> tuple[ExtraKey, ...] | None:
    # The salt only enters the first block; chaining carries it into every later hash, so
    # salting once is enough to isolate the whole prefix.
    if block_index == 0 and cache_salt is not None:
        return ("cache_salt", cache_salt)
    return None


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    parent_hash: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hash every full block of ``token_ids`` from block ``start_block`` on.

    ``parent_hash`` must be the hash of block ``start_block - 1`` (None when starting at 0).
    Useful to anyone who holds token ids but no :class:`Request` (connectors, tools, peers).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    parent = parent_hash
    for i in range(start_block, len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent, block, _block_extra_keys(i, cache_salt))
        hashes.append(parent)
    return hashes


def get_request_block_hasher(
    block_size: int, algo: str = "kvferry"
) -> Callable[[Request], list[BlockHash]]:
    """Return the ``block_hasher`` to pass to :class:`Request`.

    The hasher returns hashes only for blocks that became full since the last call (it
    continues from ``len(request.block_hashes)``), so ``Request`` can extend its list as
    output tokens arrive without rehashing the prefix. ``algo`` is the engine's
    ``prefix_caching_hash_algo``: "kvferry" (this module) or one of vLLM's (see
    :mod:`kvferry.core.vllm_block_hash`).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if algo != "kvferry":
        return VllmBlockHasher.create(algo).request_hasher(block_size)

    def hasher(request: Request) -> list[BlockHash]:
        done = len(request.block_hashes)
        parent = request.block_hashes[-1] if done else None
        return hash_token_blocks(
            request.all_token_ids,
            block_size,
            cache_salt=request.cache_salt,
            parent_hash=parent,
            start_block=done,
        )

    return hasher


TokenBlockHasher = Callable[..., list[BlockHash]]


def token_block_hasher(algo: str = "kvferry") -> TokenBlockHasher:
    """``hash_token_blocks`` of ``algo``, for whoever holds token ids but no :class:`Request`
    (routers, tools). Same signature as :func:`hash_token_blocks`; a vLLM algorithm resolves
    its NONE_HASH seed once, here."""
    if algo == "kvferry":
        return hash_token_blocks
    return VllmBlockHasher.create(algo).hash_token_blocks


def block_hash_size(algo: str = "kvferry") -> int:
    """Bytes per block hash: 32 for kvferry and the SHA-256 algorithms, 16 for xxhash."""
    return len(NONE_HASH) if algo == "kvferry" else digest_size(algo)
