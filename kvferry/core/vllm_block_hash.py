"""vLLM's prefix-cache block hashes, for ``prefix_caching_hash_algo`` sha256, sha256_cbor, xxhash
and xxhash_cbor.

Routers built for vLLM (llm-d's KV-cache indexer, Dynamo's KV router) recompute vLLM's block
hashes from the token ids they see; with these algorithms kvferry's blocks carry the very hashes
they compute. Definitions, as in vLLM 0.32 (``vllm/utils/hashing.py``,
``vllm/v1/core/kv_cache_utils.py``):

- hashed object: ``(parent_hash, tuple(block_token_ids), extra_keys)``; the first block's
  parent is NONE_HASH; ``extra_keys`` is None or a tuple of tagged tuples, ``("lora", name,
  path)`` on every block of a LoRA request, then ``("cache_salt", salt)`` on the first block
  when the salt is non-empty;
- serialisation: pickle at ``pickle.HIGHEST_PROTOCOL`` (sha256, xxhash) or canonical CBOR
  (``*_cbor``, language independent);
- digest: SHA-256 (32 bytes) or XXH3-128 (16 bytes);
- NONE_HASH = digest of the seed string: ``PYTHONHASHSEED`` when set, otherwise the fixed
  ``"vllm-none-hash"`` for the SHA-256 algorithms and random bytes per process for the xxhash
  ones (not collision resistant: a known seed would let anyone precompute colliding blocks).

pickle is only used to serialise our own tuples of ints, strings and bytes, never to load.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvferry.config.errors import ConfigError
from kvferry.logger import init_logger
from kvferry.request import BlockHash

if TYPE_CHECKING:
    from kvferry.request import Request

logger = init_logger(__name__)

VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_NON_CRYPTO_ALGOS = frozenset({"xxhash", "xxhash_cbor"})
_DIGEST_SIZES = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}

HashFn = Callable[[Any], bytes]
# (lora_name, lora_path) of a LoRA request.
LoraKey = tuple[str, str]

# One random seed per process (pid-keyed, so a forked child draws its own).
_random_seed: tuple[int, str] | None = None


def _cbor_dumps() -> Callable[..., bytes]:
    try:
        import cbor2
    except ImportError:
        raise ConfigError(
            "prefix_caching_hash_algo *_cbor needs the cbor2 package: pip install cbor2"
        ) from None
    return cbor2.dumps


def _xxh3_128() -> Callable[[bytes], bytes]:
    try:
        from xxhash import xxh3_128_digest
    except ImportError:
        raise ConfigError(
            "prefix_caching_hash_algo xxhash / xxhash_cbor needs the xxhash package "
            "(with xxh3_128): pip install xxhash"
        ) from None
    return xxh3_128_digest


def hash_function(algo: str) -> HashFn:
    """vLLM's hash function of that name (``get_hash_fn_by_name``): object -> digest.

    Raises ConfigError naming the pip package when an optional dependency is missing.
    """
    if algo not in _DIGEST_SIZES:
        raise ConfigError(f"{algo!r} is not one of vLLM's hash algorithms {VLLM_HASH_ALGOS}")
    if algo.endswith("_cbor"):
        dumps = _cbor_dumps()

        def serialise(obj: Any) -> bytes:
            return dumps(obj, canonical=True)
    else:

        def serialise(obj: Any) -> bytes:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    if algo.startswith("xxhash"):
        digest = _xxh3_128()
        return lambda obj: digest(serialise(obj))
    return lambda obj: hashlib.sha256(serialise(obj)).digest()


def digest_size(algo: str) -> int:
    return _DIGEST_SIZES[algo]


def resolve_none_hash_seed(algo: str) -> str:
    """The seed NONE_HASH derives from, chosen as vLLM's ``resolve_none_hash_seed`` does."""
    global _random_seed
    seed = os.getenv("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo not in _NON_CRYPTO_ALGOS:
        return DEFAULT_NONE_HASH_SEED
    if _random_seed is None or _random_seed[0] != os.getpid():
        _random_seed = (os.getpid(), os.urandom(32).hex())
    return _random_seed[1]


def none_hash(algo: str, hash_fn: HashFn | None = None) -> BlockHash:
    """vLLM's NONE_HASH for ``algo``, warning (as vLLM does) when it is not reproducible."""
    if algo in _NON_CRYPTO_ALGOS and os.getenv("PYTHONHASHSEED") is None:
        logger.warning(
            "Using a random per-process NONE_HASH seed because %s is not "
            "collision resistant. Block hashes are therefore not reproducible "
            "across processes; set PYTHONHASHSEED to a shared value to reuse "
            "the prefix cache across instances, or use sha256.",
            algo,
        )
    fn = hash_fn if hash_fn is not None else hash_function(algo)
    return fn(resolve_none_hash_seed(algo))


def extra_keys(
    block_index: int, cache_salt: str | None, lora: LoraKey | None
) -> tuple[Any, ...] | None:
    """A block's extra keys in vLLM's tagged form (kvferry has no multimodal or embeds)."""
    keys: list[tuple[str, ...]] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if block_index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(
    block_index: int, cache_salt: str | None, lora: LoraKey | None
) -> tuple[Any, ...] | None:
    """One block's entry of ``BlockStored.extra_keys`` as vLLM publishes it (untagged: the
    bare LoRA name and salt, ``to_event_extra_keys``)."""
    keys = extra_keys(block_index, cache_salt, lora)
    return None if keys is None else tuple(key[1] for key in keys)


@dataclass(frozen=True)
class VllmBlockHasher:
    """One engine's vLLM-style block hashing: the algorithm and its resolved NONE_HASH."""

    algo: str
    hash_fn: HashFn
    none_hash: BlockHash

    @staticmethod
    def create(algo: str) -> VllmBlockHasher:
        fn = hash_function(algo)
        return VllmBlockHasher(algo, fn, none_hash(algo, fn))

    @property
    def digest_size(self) -> int:
        return _DIGEST_SIZES[self.algo]

    def hash_block(
        self,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        keys: tuple[Any, ...] | None = None,
    ) -> BlockHash:
        parent = parent_hash if parent_hash else self.none_hash
        return self.hash_fn((parent, tuple(token_ids), keys))

    def hash_token_blocks(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
        parent_hash: BlockHash | None = None,
        start_block: int = 0,
        lora: LoraKey | None = None,
    ) -> list[BlockHash]:
        """Like :func:`kvferry.core.block_hash.hash_token_blocks`, with vLLM's definition."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        hashes: list[BlockHash] = []
        parent = parent_hash
        for i in range(start_block, len(token_ids) // block_size):
            block = token_ids[i * block_size : (i + 1) * block_size]
            parent = self.hash_block(parent, block, extra_keys(i, cache_salt, lora))
            hashes.append(parent)
        return hashes

    def request_hasher(self, block_size: int) -> Callable[[Request], list[BlockHash]]:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")

        def hasher(request: Request) -> list[BlockHash]:
            done = len(request.block_hashes)
            lora_request = getattr(request, "lora_request", None)
            lora = (lora_request.lora_name, lora_request.lora_path) if lora_request else None
            return self.hash_token_blocks(
                request.all_token_ids,
                block_size,
                cache_salt=request.cache_salt,
                parent_hash=request.block_hashes[-1] if done else None,
                start_block=done,
                lora=lora,
            )

        return hasher
