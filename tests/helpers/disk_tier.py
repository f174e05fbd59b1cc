"""Helpers shared by the disk-tier hardening tests: chunk keys, small KV views and stores,
the check that a chunk is refused fast, and what someone without the key can write."""

from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry.kv_transfer.offload.disk import HEADER, CorruptChunk, DiskStore

OFFLOAD = "OffloadingConnector"
SECRET = b"disk-tier-test-secret-0123456789"


def k(i: int) -> str:
    return i.to_bytes(32, "big").hex()


def _views(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 2, 8, generator=g) for _ in range(2)]


def _store(folder: Path, key: bytes | None = None, **kw: Any) -> DiskStore:
    payload = sum(v.numel() * v.element_size() for v in _views(0))
    return DiskStore(folder, "x" * 8 + "0" * 32, payload, fsync=False, key=key, **kw)


def _refused_fast(store: DiskStore, key_hex: str, match: str) -> None:
    out = [torch.zeros_like(v) for v in _views(0)]
    t0 = time.monotonic()
    with pytest.raises(CorruptChunk, match=match):
        store.read_into(key_hex, out)
    with pytest.raises(CorruptChunk, match=match):
        store.check(key_hex)
    assert time.monotonic() - t0 < 1.0
    assert all(not o.any() for o in out)  # nothing was written into the destination


def _rewrite_with_crc(path: Path, payload: bytes) -> None:
    """What someone with write access but no key can do to an unkeyed file: new payload,
    checksum recomputed."""
    raw = path.read_bytes()
    magic, key, layout, length, _, pad = HEADER.unpack(raw[: HEADER.size])
    header = HEADER.pack(magic, key, layout, length, zlib.crc32(payload), pad)
    path.write_bytes(header + payload)


def _secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return str(path)
