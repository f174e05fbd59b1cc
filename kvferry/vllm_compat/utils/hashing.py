"""``vllm.utils.hashing``: hashes connectors use to name stored KV."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

__all__ = ["get_hash_fn_by_name", "safe_hash", "sha256"]


def safe_hash(data: bytes = b"", usedforsecurity: bool = True) -> Any:
    """An MD5 hash object (for naming, not security; FIPS builds accept the flag)."""
    return hashlib.md5(data, usedforsecurity=usedforsecurity)


def sha256(value: Any) -> bytes:
    """SHA-256 of a JSON-encodable value (bytes are hashed as they are)."""
    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
    return hashlib.sha256(data).digest()


def get_hash_fn_by_name(name: str) -> Callable[[Any], bytes]:
    if name in ("sha256", "sha256_cbor"):
        return sha256
    raise ValueError(f"unsupported hash function {name!r}; kvferry offers sha256")
