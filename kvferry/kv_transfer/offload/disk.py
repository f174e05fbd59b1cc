"""The disk tier's files: one file per chunk, written atomically, checked when read.

Folder: ``<disk_path>/<fingerprint>/`` where the fingerprint digests the model (its
``config.json`` and a sample of its weight files), the KV layout (layers, heads, head size,
dtype, block size), the chunk size and, when the files are keyed, an identifier of the key, so
engines of different models, layouts or keys never read each other's files (a keyed engine
never sees an unkeyed folder, nor one keyed with another deployment's secret), and the
prefix-cache hash algorithm when it is not kvferry's own, so engines hashing blocks differently
never take each other's chunks. File name: the chunk key (a chained block hash: 32 bytes, or 16
for vLLM's xxhash algorithms) in hex, so a new engine on the same folder finds the same chunks.

File layout (little endian), without a key (``b"KVFCHNK1"``) and with one (``b"KVFCHNK2"``)::

    magic   8 bytes  b"KVFCHNK1"            | b"KVFCHNK2"
    key     32 bytes the chunk key (zero-padded when shorter)
    layout  16 bytes the folder's fingerprint digest
    length  u64      payload bytes
    check   u32 CRC32 of the payload, u32 0 | 32 bytes keyed BLAKE2b of the 64 bytes above
                                              and the payload
    payload          per layer, keys then values, each (blocks, block_size, heads, head_dim)

A file is written under a temporary name and renamed into place, so a reader sees either no
file or a complete one. Only regular files are read: a symbolic link (wherever it points), a
FIFO, a device or a socket in place of a chunk file is refused without blocking, and every
read is bounded in time (``read_timeout_s``; see :class:`BoundedReader`). Refused, unreadable
or mismatching files are never loaded: reading raises :class:`CorruptChunk`, and the tier
treats the chunk as a miss.

What the check detects. With a key (the deployment secret, see ``kvferry.kv_transfer.secret``)
the check is a BLAKE2b MAC: any change to a file, accidental or deliberate, is refused unless
it is made by someone who holds the secret. Without a key the check is a CRC32 of the payload:
accidental corruption (a torn write after a crash without ``fsync``, bit flips, truncation, a
file of another layout or chunk) is detected, but a deliberate rewrite by anyone who can write
to the folder is not: they can recompute the CRC, and the engine will load their KV. Configure
a secret whenever others can write to ``disk_path``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import struct
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch

from kvferry.kv_layout import KVCacheLayout
from kvferry.kv_transfer.offload.bounded_read import BoundedReader, ReadTimeout
from kvferry.logger import init_logger

logger = init_logger(__name__)

MAGIC = b"KVFCHNK1"
MAGIC_KEYED = b"KVFCHNK2"
HEADER = struct.Struct("<8s32s16sQII")
KEYED_HEADER = struct.Struct("<8s32s16sQ32s")
_KEYED_PREFIX = 8 + 32 + 16 + 8  # header bytes the MAC covers before the payload
SUFFIX = ".kvc"
MAX_KEY_BYTES = 32
DEFAULT_READ_TIMEOUT_S = 5.0
_SAMPLE_BYTES = 1 << 20
_STALE_TMP_S = 3600.0
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class CorruptChunk(Exception):
    """A chunk file that must not be loaded (truncated, wrong header, bad checksum, not a
    regular file, or unreadable within the time bound)."""


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


def key_id(key: bytes) -> str:
    """A public name of a disk key (it tells folders of different keys apart, reveals nothing)."""
    return hashlib.blake2b(key, digest_size=8, person=b"kvferry-disk-id").hexdigest()


def layout_fingerprint(
    model_digest: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    blocks_per_chunk: int,
    disk_key: bytes | None = None,
    hash_algo: str = "kvferry",
    kv_layout: KVCacheLayout = KVCacheLayout.NHD,
) -> str:
    """Folder name for one model, KV layout, key and block hash algorithm: readable prefix plus
    a 16-byte digest (kvferry's own algorithm and the NHD memory order add nothing, so their
    folders keep their names; an HND pool's block bytes are in another order)."""
    dt = str(dtype).removeprefix("torch.")
    desc = f"{num_layers}l-{num_kv_heads}x{head_dim}-{dt}-bs{block_size}-c{blocks_per_chunk}"
    if hash_algo != "kvferry":
        desc += f"-{hash_algo}"
    if kv_layout is not KVCacheLayout.NHD:
        desc += f"-{kv_layout.value.lower()}"
    material = f"{model_digest}/{desc}"
    if disk_key is not None:
        desc += "-keyed"
        material += f"/keyed-{key_id(disk_key)}"
    digest = hashlib.sha256(material.encode()).hexdigest()[:32]
    return f"{desc}-{digest}"


def header_bytes(keyed: bool) -> int:
    return KEYED_HEADER.size if keyed else HEADER.size


def payload_bytes(bytes_per_block: int, blocks_per_chunk: int) -> int:
    return bytes_per_block * blocks_per_chunk


def file_bytes(bytes_per_block: int, blocks_per_chunk: int, keyed: bool = False) -> int:
    return header_bytes(keyed) + payload_bytes(bytes_per_block, blocks_per_chunk)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    array: Any = t.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path) -> tuple[int, int]:
    """Open ``path`` for reading only if it is a regular file (never through a symbolic link,
    never blocking on a FIFO); returns ``(fd, size)``, or raises CorruptChunk."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise CorruptChunk(f"{path.name}: missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptChunk(f"{path.name}: is a symbolic link; refused") from None
        raise CorruptChunk(f"{path.name}: cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptChunk(f"{path.name}: is {_kind(st.st_mode)}, not a chunk file; refused")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_file(path: Path, buf: bytearray) -> int:
    """Read a regular file into ``buf`` (sized one byte past a whole chunk file, so a longer
    file shows); returns the bytes read. Runs on the bounded reader's thread."""
    fd, size = open_regular(path)
    try:
        if size < len(buf) - 1:
            raise CorruptChunk(f"{path.name}: truncated ({size} bytes, expected {len(buf) - 1})")
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
        return got
    finally:
        os.close(fd)


class DiskStore:
    """Reads and writes chunk files of one folder (worker side). ``key``: the disk-tier key
    (keyed BLAKE2b checks) or None (CRC32). Reads run one at a time, each bounded by
    ``read_timeout_s``."""

    def __init__(
        self,
        folder: Path,
        fingerprint: str,
        chunk_payload: int,
        fsync: bool,
        key: bytes | None = None,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    ) -> None:
        self.folder = folder
        self.layout_digest = bytes.fromhex(fingerprint[-32:])
        self.payload = chunk_payload
        self.fsync = fsync
        self.key = key
        self.header = KEYED_HEADER if key is not None else HEADER
        self.file_size = self.header.size + chunk_payload
        self._reader = BoundedReader(read_timeout_s, "kv-offload-disk-io")
        self._spare: bytearray | None = None  # a read buffer no stuck read still owns
        self._spare_lock = threading.Lock()
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, key_hex: str) -> Path:
        return self.folder / f"{key_hex}{SUFFIX}"

    def _mac(self, prefix: bytes | memoryview, parts: list[memoryview]) -> bytes:
        h = hashlib.blake2b(key=self.key or b"", digest_size=32, person=b"kvferry-chunk")
        h.update(prefix)
        for p in parts:
            h.update(p)
        return h.digest()

    def _header(self, key_hex: str, parts: list[memoryview]) -> bytes:
        key = bytes.fromhex(key_hex)
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"chunk keys are 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
        if self.key is None:
            crc = 0
            for p in parts:
                crc = zlib.crc32(p, crc)
            return HEADER.pack(MAGIC, key, self.layout_digest, self.payload, crc, 0)
        prefix = KEYED_HEADER.pack(MAGIC_KEYED, key, self.layout_digest, self.payload, b"")
        prefix = prefix[:_KEYED_PREFIX]
        return prefix + self._mac(prefix, parts)

    def write(self, key_hex: str, views: list[torch.Tensor]) -> int:
        """Write one chunk from ``views`` (contiguous host tensors, in file order)."""
        parts = [_as_bytes(v) for v in views]
        length = sum(len(p) for p in parts)
        if length != self.payload:
            raise ValueError(f"chunk payload is {length} bytes, expected {self.payload}")
        header = self._header(key_hex, parts)
        tmp = self.folder / f".tmp-{key_hex}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            with os.fdopen(os.open(tmp, flags, 0o644), "wb") as fh:
                fh.write(header)
                for p in parts:
                    fh.write(p)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(tmp, self.path(key_hex))  # replaces the entry, never follows a link
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return len(header) + length

    def _read_checked(self, key_hex: str) -> tuple[memoryview, bytearray]:
        """Read a chunk file within the time bound and check it; returns the payload (a view
        of a buffer the caller hands back with :meth:`_release`) or raises CorruptChunk."""
        path = self.path(key_hex)
        with self._spare_lock:
            buf, self._spare = self._spare, None
        if buf is None:
            buf = bytearray(self.file_size + 1)
        try:
            got = self._reader.run(lambda: _read_file(path, buf))
        except ReadTimeout as e:
            # ``buf`` stays with the stuck read: it may still write into it.
            raise CorruptChunk(f"{path.name}: {e}") from None
        except BaseException:
            self._spare = buf
            raise
        try:
            self._check(path, key_hex, memoryview(buf)[:got])
        except BaseException:
            self._spare = buf
            raise
        return memoryview(buf)[self.header.size : self.file_size], buf

    def _release(self, buf: bytearray) -> None:
        self._spare = buf

    def _check(self, path: Path, key_hex: str, raw: memoryview) -> None:
        h = self.header
        if len(raw) < h.size:
            raise CorruptChunk(f"{path.name}: truncated header")
        magic, key, layout, length, *check = h.unpack(raw[: h.size])
        want_magic = MAGIC if self.key is None else MAGIC_KEYED
        want_key = bytes.fromhex(key_hex).ljust(MAX_KEY_BYTES, b"\0")
        if magic != want_magic or key != want_key or layout != self.layout_digest:
            raise CorruptChunk(f"{path.name}: header does not match")
        if length != self.payload:
            raise CorruptChunk(f"{path.name}: payload {length} bytes, expected {self.payload}")
        if len(raw) < self.file_size:
            raise CorruptChunk(f"{path.name}: truncated payload")
        if len(raw) > self.file_size:
            raise CorruptChunk(f"{path.name}: trailing bytes")
        payload = raw[h.size : self.file_size]
        if self.key is None:
            ok = zlib.crc32(payload) == check[0]
        else:
            ok = self._mac(raw[:_KEYED_PREFIX], [payload]) == check[0]
        if not ok:
            raise CorruptChunk(f"{path.name}: checksum mismatch")

    def check(self, key_hex: str) -> int:
        """Read a chunk file and verify it without keeping the bytes; CorruptChunk if bad."""
        _, buf = self._read_checked(key_hex)
        self._release(buf)
        return self.file_size

    def read_into(self, key_hex: str, views: list[torch.Tensor]) -> int:
        """Read one chunk into ``views``; raise CorruptChunk (views untouched) if the file is
        missing, not a regular file, unreadable in time, or does not check out. The caller
        offers the chunk only after this returned."""
        payload, buf = self._read_checked(key_hex)
        try:
            offset = 0
            for v in views:
                dst = _as_bytes(v)
                dst[:] = payload[offset : offset + len(dst)]
                offset += len(dst)
            if offset != self.payload:
                raise ValueError(f"views hold {offset} bytes, the chunk {self.payload}")
        finally:
            self._release(buf)
        return self.file_size

    def delete(self, key_hex: str) -> None:
        self.path(key_hex).unlink(missing_ok=True)  # removes a link itself, never its target

    def shutdown(self) -> None:
        self._reader.shutdown()


def scan_folder(folder: Path, expected_size: int) -> tuple[list[bytes], list[bytes]]:
    """Chunk files of a folder, oldest first: ``(good keys, keys of files to drop)``; files of
    the wrong size and entries that are not regular files (links, FIFOs, devices) are dropped.

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
                if now - entry.stat(follow_symlinks=False).st_mtime > _STALE_TMP_S:
                    os.unlink(entry.path)
            except OSError:
                pass
            continue
        if not name.endswith(SUFFIX):
            continue
        try:
            key = bytes.fromhex(name[: -len(SUFFIX)])
            st = entry.stat(follow_symlinks=False)
        except (ValueError, OSError):
            continue
        if not 0 < len(key) <= MAX_KEY_BYTES:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size != expected_size:
            bad.append(key)
        else:
            found.append((st.st_mtime, key))
    found.sort()
    return [k for _, k in found], bad
