"""Disk-tier chunk files: a round trip, checksum, truncation and header checks, and the
fingerprints that tell models and layouts apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvferry.kv_transfer.offload.disk import (
    HEADER,
    CorruptChunk,
    DiskStore,
    layout_fingerprint,
    model_fingerprint,
    scan_folder,
)
from tests.helpers.offload_keys import k

# -- chunk files --------------------------------------------------------------------------


def _views(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 16, 2, 8, generator=g).to(torch.bfloat16) for _ in range(4)]


def test_disk_roundtrip_and_corruption(tmp_path: Path) -> None:
    views = _views(0)
    payload = sum(v.numel() * v.element_size() for v in views)
    fp = "x" * 8 + "0" * 32
    store = DiskStore(tmp_path, fp, payload, fsync=True)
    key = k(7).hex()
    store.write(key, views)
    out = [torch.empty_like(v) for v in views]
    store.read_into(key, out)
    assert all(torch.equal(a, b) for a, b in zip(views, out, strict=True))
    path = store.path(key)
    assert scan_folder(tmp_path, path.stat().st_size) == ([k(7)], [])
    raw = bytearray(path.read_bytes())
    raw[HEADER.size + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunk, match="checksum"):
        store.read_into(key, out)
    path.write_bytes(bytes(raw[:-5]))
    with pytest.raises(CorruptChunk, match="truncated"):
        store.read_into(key, out)
    assert scan_folder(tmp_path, len(raw)) == ([], [k(7)])
    other = DiskStore(tmp_path, "y" * 8 + "1" * 32, payload, fsync=False)
    store.write(key, views)
    with pytest.raises(CorruptChunk, match="header"):
        other.read_into(key, out)  # another layout's file is never read
    with pytest.raises(CorruptChunk, match="missing"):
        store.read_into(k(8).hex(), out)


def test_fingerprint_tells_models_and_layouts_apart(tiny_model_factory) -> None:
    a = model_fingerprint(str(tiny_model_factory("llama", seed=0)))
    b = model_fingerprint(str(tiny_model_factory("llama", seed=1)))
    assert a != b
    fa = layout_fingerprint(a, 4, 2, 64, torch.float32, 16, 1)
    assert fa != layout_fingerprint(a, 4, 2, 64, torch.bfloat16, 16, 1)
    assert fa != layout_fingerprint(a, 4, 2, 64, torch.float32, 16, 2)
