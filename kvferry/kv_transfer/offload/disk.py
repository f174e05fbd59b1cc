"""The disk tier's files: one file per chunk, written atomically, checked when read.

Folder: ``<disk_path>/<fingerprint>/`` where the fingerprint digests the model (its
``config.json`` and a sample of its weight files), the KV layout (layers, heads, head size,
dtype, block size) and the chunk size, so engines of different models or layouts never read
each other's files. File name: the chunk key (a chained SHA-256 block hash) in hex, so a new
engine on the same folder finds the same chunks.

File layout (little endian)::

    magic   8 bytes  b"KVFCHNK1"
    key     32 bytes the chunk key
    layout  16 bytes the folder's fingerprint digest
    length  u64      payload bytes
    crc32   u32      of the payload
    pad     u32
    payload          per layer, keys then values, each (blocks, block_size, heads, head_dim)

A file is written under a temporary name and renamed into place, so a reader sees either no
file or a complete one. A file whose size, header or checksum is wrong (a crash without
``fsync``, disk trouble, tampering) is never loaded: reading raises :class:`CorruptChunk`.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch

from kvferry.logger import init_logger

logger = init_logger(__name__)

MAGIC = b"KVFCHNK1"
HEADER = struct.Struct("<8s32s16sQII")
SUFFIX = ".kvc"
_SAMPLE_BYTES = 1 << 20
_STALE_TMP_S = 3600.0


class CorruptChunk(Exception):
    """A chunk file that must not be loaded (truncated, wrong header, bad checksum)."""


def model_fingerprint(model_path: str | None) -> str:
    """Digest of a model folder: its config and the first and last MiB of each weight file
    (cheap, and enough to tell random-weight checkpoints of one shape apart)."""
    h = hashlib.sha256(b"kvferry-offload-model-v1")
    if model_path is None:
        return h.hexdigest()
    folder = Path(model_path)
    cfg = folder / "config.json"
    h.update(cfg.read_bytes() if cfg.is_file() else str(folder.resolve()).encode())
    for f in sorted(folder.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            h.update(fh.read(_SAMPLE_BYTES))
            fh.seek(max(0, size - _SAMPLE_BYTES))
            h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()


def layout_fingerprint(
    model_digest: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    blocks_per_chunk: int,
) -> str:
    """Folder name for one model and KV layout: readable prefix plus a 16-byte digest."""
    dt = str(dtype).removeprefix("torch.")
    desc = f"{num_layers}l-{num_kv_heads}x{head_dim}-{dt}-bs{block_size}-c{blocks_per_chunk}"
    digest = hashlib.sha256(f"{model_digest}/{desc}".encode()).hexdigest()[:32]
    return f"{desc}-{digest}"


def payload_bytes(bytes_per_block: int, blocks_per_chunk: int) -> int:
    return bytes_per_block * blocks_per_chunk


def file_bytes(bytes_per_block: int, blocks_per_chunk: int) -> int:
    return HEADER.size + payload_bytes(bytes_per_block, blocks_per_chunk)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    array: Any = t.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


class DiskStore:
    """Reads and writes chunk files of one folder (worker side)."""

    def __init__(self, folder: Path, fingerprint: str, chunk_payload: int, fsync: bool) -> None:
        self.folder = folder
        self.layout_digest = bytes.fromhex(fingerprint[-32:])
        self.payload = chunk_payload
        self.fsync = fsync
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, key_hex: str) -> Path:
        return self.folder / f"{key_hex}{SUFFIX}"

    def write(self, key_hex: str, views: list[torch.Tensor]) -> int:
        """Write one chunk from ``views`` (contiguous host tensors, in file order)."""
        parts = [_as_bytes(v) for v in views]
        length = sum(len(p) for p in parts)
        if length != self.payload:
            raise ValueError(f"chunk payload is {length} bytes, expected {self.payload}")
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        header = HEADER.pack(MAGIC, bytes.fromhex(key_hex), self.layout_digest, length, crc, 0)
        tmp = self.folder / f".tmp-{key_hex}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with tmp.open("wb") as fh:
                fh.write(header)
                for p in parts:
                    fh.write(p)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(tmp, self.path(key_hex))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return HEADER.size + length

    def _check_header(self, fh: Any, path: Path, key_hex: str) -> int:
        """Read and check a file's header; returns the payload checksum it records."""
        raw = fh.read(HEADER.size)
        if len(raw) != HEADER.size:
            raise CorruptChunk(f"{path.name}: truncated header")
        magic, key, layout, length, crc, _ = HEADER.unpack(raw)
        if magic != MAGIC or key.hex() != key_hex or layout != self.layout_digest:
            raise CorruptChunk(f"{path.name}: header does not match")
        if length != self.payload:
            raise CorruptChunk(f"{path.name}: payload {length} bytes, expected {self.payload}")
        return int(crc)

    def check(self, key_hex: str) -> int:
        """Read a chunk file and verify it without keeping the bytes; CorruptChunk if bad."""
        path = self.path(key_hex)
        view = memoryview(bytearray(min(self.payload, 4 << 20)))
        try:
            with path.open("rb") as fh:
                crc = self._check_header(fh, path, key_hex)
                check, got = 0, 0
                while n := fh.readinto(view):
                    check = zlib.crc32(view[:n], check)
                    got += n
        except FileNotFoundError:
            raise CorruptChunk(f"{path.name}: missing") from None
        if got != self.payload:
            raise CorruptChunk(f"{path.name}: truncated payload")
        if check != crc:
            raise CorruptChunk(f"{path.name}: checksum mismatch")
        return HEADER.size + got

    def read_into(self, key_hex: str, views: list[torch.Tensor]) -> int:
        """Read one chunk into ``views``; raise CorruptChunk (views unspecified) if the file is
        missing, truncated or does not check out. The caller offers the chunk only after this
        returned."""
        path = self.path(key_hex)
        try:
            with path.open("rb") as fh:
                crc = self._check_header(fh, path, key_hex)
                got, check = 0, 0
                for v in views:
                    buf = _as_bytes(v)
                    n = fh.readinto(buf)
                    if n != len(buf):
                        raise CorruptChunk(f"{path.name}: truncated payload")
                    check = zlib.crc32(buf, check)
                    got += n
                if fh.read(1):
                    raise CorruptChunk(f"{path.name}: trailing bytes")
        except FileNotFoundError:
            raise CorruptChunk(f"{path.name}: missing") from None
        if got != self.payload or check != crc:
            raise CorruptChunk(f"{path.name}: checksum mismatch")
        return HEADER.size + got

    def delete(self, key_hex: str) -> None:
        self.path(key_hex).unlink(missing_ok=True)


def scan_folder(folder: Path, expected_size: int) -> tuple[list[bytes], list[bytes]]:
    """Chunk files of a folder, oldest first: ``(good keys, keys of files of the wrong size)``.

    Only sizes are checked here (cheap enough to run at start); contents are checked when a
    chunk is read. Temporary files older than an hour (left by a crash) are removed.
    """
    if not folder.is_dir():
        return [], []
    found: list[tuple[float, bytes]] = []
    bad: list[bytes] = []
    now = time.time()
    for entry in os.scandir(folder):
        name = entry.name
        if name.startswith(".tmp-"):
            try:
                if now - entry.stat().st_mtime > _STALE_TMP_S:
                    os.unlink(entry.path)
            except OSError:
                pass
            continue
        if not name.endswith(SUFFIX):
            continue
        try:
            key = bytes.fromhex(name[: -len(SUFFIX)])
            st = entry.stat()
        except (ValueError, OSError):
            continue
        if st.st_size != expected_size:
            bad.append(key)
        else:
            found.append((st.st_mtime, key))
    found.sort()
    return [k for _, k in found], bad
