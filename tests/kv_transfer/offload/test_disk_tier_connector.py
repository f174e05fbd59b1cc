"""The hardened disk tier through the offloading connector and the scheduler: a FIFO swapped
in at run time is a miss within a second, and with a deployment secret rewritten or
unkeyed chunks are never loaded. The harness checks every loaded KV value (a wrong chunk
fails the forward).

The ambient deployment secret is unset for every test (``no_ambient_secret``)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from kvferry.kv_transfer.offload.disk import HEADER, KEYED_HEADER
from kvferry.request import Request
from tests.helpers.disk_tier import OFFLOAD, _rewrite_with_crc, _secret_file
from tests.helpers.offload_harness import OffloadHarness
from tests.helpers.scheduler import create_request

pytestmark = pytest.mark.usefixtures("no_ambient_secret")


# -- through the connector and the scheduler ----------------------------------------------


def prompt(i: int, n: int = 70) -> list[int]:
    return list(range(1000 * i, 1000 * i + n))


def req(i: int, n: int = 70, max_tokens: int = 4) -> Request:
    return create_request(prompt_token_ids=prompt(i, n), max_tokens=max_tokens)


def _disk(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    return {"num_cpu_chunks": 2, "disk_path": str(tmp_path), "num_disk_chunks": 64, **kw}


def _clean(h: OffloadHarness) -> None:
    """The leak check, after the fire-and-forget file deletions are through."""
    h.run()
    deadline = time.monotonic() + 5
    while h.engine.num_in_flight() and time.monotonic() < deadline:
        time.sleep(0.005)
    h.assert_clean()
    h.shutdown()


def _run(h: OffloadHarness, ids: list[int]) -> list[Request]:
    reqs = [req(i) for i in ids]
    for r in reqs:
        h.add(r)
    h.run()
    return reqs


def test_fifo_swapped_in_at_run_time_is_a_miss_within_a_second(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    h = OffloadHarness(OFFLOAD, _disk(tmp_path / "d"), num_blocks=12, policy="recompute")
    _run(h, [0, 1, 2, 3])  # the tiny host tier keeps prompt 0's first chunks: the rest are files
    folder = next((tmp_path / "d").rglob("rank0"))
    victim = folder / f"{req(1).block_hashes[2].hex()}.kvc"
    victim.unlink()
    os.mkfifo(victim)
    caplog.set_level(logging.WARNING)
    t0 = time.monotonic()
    reqs = _run(h, [0, 1])
    assert time.monotonic() - t0 < 1.0  # no 30 s lookup wait behind a blocked disk thread
    for r in reqs:
        assert h.finished[r.request_id].finish_reason == "length"
    assert any("is a FIFO" in rec.getMessage() for rec in caplog.records)
    stats = h.stats()
    # Prompt 1's load failed and it recomputed; the failed job's files are all dropped.
    assert stats["load_failed"] == 1 and stats["corrupt_chunks"] >= 1
    assert stats.get("hit_tokens_host", 0) + stats.get("hit_tokens_disk", 0) >= 64  # prompt 0
    _clean(h)
    # The FIFO was removed (it named one of our chunks) and the recomputed chunk written back.
    assert stat.S_ISREG(os.lstat(victim).st_mode)


def _swap_payloads(a: Path, b: Path, header_size: int) -> None:
    ra, rb = a.read_bytes(), b.read_bytes()
    a.write_bytes(ra[:header_size] + rb[header_size:])
    b.write_bytes(rb[:header_size] + ra[header_size:])


def _tamper(folder: Path, keyed: bool) -> int:
    """Swap the payloads of pairs of chunk files (each is real KV, of another prefix), fixing
    the checksum where that can be done without the key. Returns the files changed."""
    files = sorted(folder.glob("*.kvc"))
    size = KEYED_HEADER.size if keyed else HEADER.size
    for a, b in zip(files[0::2], files[1::2], strict=False):
        _swap_payloads(a, b, size)
        if not keyed:
            for f in (a, b):
                _rewrite_with_crc(f, f.read_bytes()[size:])
    return len(files) // 2 * 2


def test_rewritten_chunks_load_without_a_key_and_are_refused_with_one(tmp_path: Path) -> None:
    # Without a key: the rewritten chunks check out, and the forward sees wrong KV.
    first = OffloadHarness(OFFLOAD, _disk(tmp_path / "plain"), num_blocks=12)
    _run(first, [0, 1])
    _clean(first)
    assert _tamper(next((tmp_path / "plain").rglob("rank0")), keyed=False) == 8
    fooled = OffloadHarness(OFFLOAD, _disk(tmp_path / "plain"), num_blocks=12)
    with pytest.raises(AssertionError, match="wrong KV"):
        _run(fooled, [0, 1])
    fooled.shutdown()

    # With a key: every rewritten chunk is refused, every value the forward reads is right.
    extra = _disk(tmp_path / "keyed", secret_file=_secret_file(tmp_path))
    first = OffloadHarness(OFFLOAD, extra, num_blocks=12)
    _run(first, [0, 1])
    _clean(first)
    folder = next((tmp_path / "keyed").rglob("rank0"))
    assert "-keyed-" in folder.parent.name
    assert _tamper(folder, keyed=True) == 8
    second = OffloadHarness(OFFLOAD, extra, num_blocks=12)
    _run(second, [0, 1])
    stats = second.stats()
    assert stats["corrupt_chunks"] >= 8 and stats.get("hit_tokens_disk", 0) == 0
    assert second.checked_tokens > 0
    _clean(second)


def test_a_keyed_engine_never_loads_unkeyed_chunks(tmp_path: Path) -> None:
    plain = OffloadHarness(OFFLOAD, _disk(tmp_path), num_blocks=12)
    _run(plain, [0, 1])
    _clean(plain)
    (plain_folder,) = tmp_path.rglob("rank0")
    extra = _disk(tmp_path, secret_file=_secret_file(tmp_path))
    keyed = OffloadHarness(OFFLOAD, extra, num_blocks=12)
    keyed_folder = next(p for p in tmp_path.rglob("rank0") if p != plain_folder)
    # Unkeyed files copied into the keyed folder (as an attacker might) are dropped too.
    keyed.shutdown()
    for f in plain_folder.glob("*.kvc"):
        shutil.copy(f, keyed_folder / f.name)
    keyed = OffloadHarness(OFFLOAD, extra, num_blocks=12)
    _run(keyed, [0, 1])
    assert keyed.stats().get("hit_tokens_disk", 0) == 0
    _clean(keyed)
    assert len(list(plain_folder.glob("*.kvc"))) == 8  # the other engine's files are untouched
    assert all(f.read_bytes()[:8] == b"KVFCHNK2" for f in keyed_folder.glob("*.kvc"))
