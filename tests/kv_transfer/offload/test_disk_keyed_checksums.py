"""Keyed chunk checksums: a chunk rewritten with a recomputed CRC32 loads without a key and
is refused with one; the layout fingerprint depends on the key.

The ambient deployment secret is unset for every test (``no_ambient_secret``)."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import pytest
import torch

from kvferry.kv_transfer.offload.disk import HEADER, KEYED_HEADER, MAGIC, layout_fingerprint
from tests.helpers.disk_tier import _refused_fast, _rewrite_with_crc, _store, _views, k

pytestmark = pytest.mark.usefixtures("no_ambient_secret")


# -- keyed checksums ------------------------------------------------------------------------


def test_a_rewritten_chunk_passes_crc32_but_not_the_keyed_check(tmp_path: Path) -> None:
    out = [torch.zeros_like(v) for v in _views(0)]
    plain = _store(tmp_path / "plain")
    plain.write(k(1), _views(1))
    forged = b"".join(v.numpy().tobytes() for v in _views(9))
    _rewrite_with_crc(plain.path(k(1)), forged)
    plain.read_into(k(1), out)  # the documented limitation: loaded without a key
    assert all(torch.equal(a, b) for a, b in zip(out, _views(9), strict=True))

    keyed = _store(tmp_path / "keyed", key=b"k" * 32)
    keyed.write(k(1), _views(1))
    path = keyed.path(k(1))
    raw = path.read_bytes()
    assert raw[:8] == b"KVFCHNK2" and len(raw) == KEYED_HEADER.size + len(forged)
    # The payload swapped, everything else kept: the MAC no longer matches.
    path.write_bytes(raw[: KEYED_HEADER.size] + forged)
    _refused_fast(keyed, k(1), "checksum mismatch")
    # A MAC computed with another key is no better.
    other = _store(tmp_path / "other", key=b"o" * 32)
    other.write(k(1), _views(9))
    shutil.copy(other.path(k(1)), path)
    _refused_fast(keyed, k(1), "checksum mismatch")
    # Nor is an unkeyed file with a valid CRC32, resized to look like a keyed one.
    crc = zlib.crc32(forged)
    header = HEADER.pack(MAGIC, bytes.fromhex(k(1)), keyed.layout_digest, len(forged), crc, 0)
    path.write_bytes(header + b"\0" * (KEYED_HEADER.size - HEADER.size) + forged)
    _refused_fast(keyed, k(1), "header does not match")
    keyed.write(k(1), _views(1))
    keyed.read_into(k(1), out)
    assert all(torch.equal(a, b) for a, b in zip(out, _views(1), strict=True))
    for s in (plain, keyed, other):
        s.shutdown()


def test_fingerprint_depends_on_the_key() -> None:
    args = ("m" * 64, 4, 2, 64, torch.float32, 16, 1)
    plain = layout_fingerprint(*args)
    keyed = layout_fingerprint(*args, disk_key=b"a" * 32)
    assert plain != keyed and "-keyed-" in keyed
    assert keyed != layout_fingerprint(*args, disk_key=b"b" * 32)
    assert keyed == layout_fingerprint(*args, disk_key=b"a" * 32)
