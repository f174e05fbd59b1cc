"""Attacks on the disk tier by someone who can write to its folder but holds no secret: a FIFO
swapped in for a chunk file, chunk files rewritten with a recomputed checksum. The good client
reads its prompts back from that folder all along."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import struct
import zlib
from pathlib import Path

from tests.helpers.servers import scrape

from .harness import Attack, Service, run_attack

MAGIC_CRC = b"KVFCHNK1"
CRC_HEADER = struct.Struct("<8s32s16sQII")  # magic, chunk key, layout, length, crc32, pad


def _chunks(svc: Service) -> list[Path]:
    folder = Path(svc.env["CHAOS_DISK_FOLDER"])
    return sorted(p for p in folder.rglob("*.kvc") if p.is_file() and not p.is_symlink())


def _disk_hits(svc: Service) -> float:
    m = scrape(svc.url)
    return sum(v for k, v in m.items() if "hit_tokens_disk" in k and "_total" in k)


def _payload(path: Path) -> bytes:
    """A chunk file's payload, whatever its header (unkeyed: CRC32; keyed: a 32-byte MAC)."""
    data = path.read_bytes()
    header = CRC_HEADER.size if data[:8] == MAGIC_CRC else CRC_HEADER.size + 24
    return data[header:]


def forge(path: Path, payload: bytes, variant: int) -> str:
    """Rewrite ``path`` with another ``payload`` and a check that looks right to anyone
    without the key: a recomputed CRC32 (the unkeyed format), or for a keyed file also a
    BLAKE2b MAC under a key of our own. Written in place of the file, as an attacker would."""
    data = path.read_bytes()
    magic, key, layout, length = struct.unpack_from("<8s32s16sQ", data)
    if variant % 2 == 0 or magic == MAGIC_CRC:
        head = CRC_HEADER.pack(MAGIC_CRC, key, layout, len(payload), zlib.crc32(payload), 0)
        how = "recomputed CRC32"
    else:
        prefix = struct.pack("<8s32s16sQ", magic, key, layout, len(payload))
        mac = hashlib.blake2b(prefix + payload, key=os.urandom(32), digest_size=32).digest()
        head = prefix + mac
        how = "MAC under another key"
    tmp = path.with_suffix(".forged")
    tmp.write_bytes(head + payload)
    tmp.replace(path)
    return how


def _unblock_fifos(folder: Path) -> int:
    """Remove the FIFOs an attack left, first opening each for writing so that a reader
    blocked in open() (a tier that does not refuse FIFOs) wakes up with end of file."""
    n = 0
    for p in folder.rglob("*.kvc"):
        if p.is_fifo():
            with contextlib.suppress(OSError):
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            p.unlink(missing_ok=True)
            n += 1
    return n


def test_disk_fifo(disk_up, disk_good) -> None:
    disk = disk_up
    folder = Path(disk.env["CHAOS_DISK_FOLDER"])
    rng = random.Random(7)
    hits0 = _disk_hits(disk)

    def attack(a: Attack) -> None:
        for _ in a.rounds(pause=0.5):
            files = _chunks(disk)
            for p in rng.sample(files, min(4, len(files))):
                p.unlink(missing_ok=True)
                os.mkfifo(p)
                a.count("fifos")
            a.details["disk_hit_tokens"] = _disk_hits(disk) - hits0
        a.check(_disk_hits(disk) > hits0, "no good request loaded from disk: nothing was tested")

    try:
        r = run_attack(
            "disk_fifo",
            "Disk tier: FIFOs swapped in for chunk files",
            attack,
            good=disk_good,
            watch=[disk],
        )
    finally:
        _unblock_fifos(folder)
    assert not r.violations, r.summary()


def test_disk_tampered_chunk(disk_up, disk_good) -> None:
    disk = disk_up
    rng = random.Random(8)
    hits0 = _disk_hits(disk)

    def attack(a: Attack) -> None:
        for i in a.rounds(pause=0.5):
            files = _chunks(disk)
            if len(files) < 2:
                continue
            targets = rng.sample(files, min(8, len(files)))
            for j, p in enumerate(targets):
                # The KV of another block: plausible values, wrong content.
                other = files[(files.index(p) + 1) % len(files)]
                with contextlib.suppress(OSError):
                    how = forge(p, _payload(other), i + j)
                    a.count(how)
            a.details["disk_hit_tokens"] = _disk_hits(disk) - hits0
        a.check(_disk_hits(disk) > hits0, "no good request loaded from disk: nothing was tested")

    r = run_attack(
        "disk_tampered_chunk",
        "Disk tier: chunk files rewritten with a recomputed checksum (secret configured)",
        attack,
        good=disk_good,
        watch=[disk],
    )
    assert not r.violations, r.summary()
