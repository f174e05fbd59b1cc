"""A cheap fingerprint of a checkpoint's weights, for instances that must agree on them.

Two instances exchanging KV (P/D disaggregation) must run the same weights, not merely a
folder of the same name with the same shapes: KV computed with other weights decodes into
wrong text. Hashing every byte of a large checkpoint would cost seconds to minutes, so the
fingerprint covers, per weight file (by file name, not folder): its size, its whole
safetensors header (every tensor's name, dtype, shape and offsets) and
:data:`SAMPLES_PER_FILE` samples of :data:`SAMPLE_BYTES` bytes of tensor data at fixed,
evenly spread offsets (all the data of a file smaller than that).

What it detects: another checkpoint (other training run, fine-tune, seed, quantisation or
dtype), a changed tensor layout, a truncated or extended file. What it does not: an edit
confined to bytes outside the samples (a deliberate, targeted change of a few weights). It
is a guard against mistakes, not against an adversary who controls the weight files.

Computed once per process per set of files (cached by path, size and modification time).
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path

from kvferry.config import ConfigError

SAMPLE_BYTES = 4096
SAMPLES_PER_FILE = 8
_MAX_HEADER_BYTES = 100 << 20
_NO_WEIGHTS = "none"


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index names, else every one there."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            names = set()
        if names:
            return sorted(folder / str(n) for n in names)
    return sorted(folder.glob("*.safetensors"))


def weights_fingerprint(model: str | Path) -> str:
    """32 hex digits identifying the weights in folder ``model`` ("none" without weights)."""
    folder = Path(model)
    try:
        files = weight_files(folder) if folder.is_dir() else []
        key = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    except OSError as e:
        raise ConfigError(f"cannot fingerprint the weights in {folder}: {e}") from None
    return _fingerprint(key) if key else _NO_WEIGHTS


@functools.lru_cache(maxsize=16)
def _fingerprint(files: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"kvferry-weights")
    for path, size, _ in files:
        name = Path(path).name.encode()
        h.update(struct.pack("<QQ", len(name), size))
        h.update(name)
        try:
            _hash_file(Path(path), size, h.update)
        except OSError as e:
            raise ConfigError(f"cannot fingerprint the weights file {path}: {e}") from None
    return h.hexdigest()


def _hash_file(path: Path, size: int, update: Callable[[bytes], None]) -> None:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path} is not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise ConfigError(f"{path} is not a safetensors file (bad header length)")
        update(f.read(header_len))
        start = 8 + header_len
        data = size - start
        if data <= SAMPLES_PER_FILE * SAMPLE_BYTES:
            update(f.read(data))
            return
        step = (data - SAMPLE_BYTES) // (SAMPLES_PER_FILE - 1)
        for i in range(SAMPLES_PER_FILE):
            f.seek(start + i * step)
            update(f.read(SAMPLE_BYTES))
