"""The disk tier against a hostile or broken folder: non-regular files in place of chunk files
(FIFOs, devices, symbolic links) are refused without blocking, reads are bounded in time, and
with a deployment secret a chunk rewritten by someone without it is never loaded.

Harness tests check every loaded KV value (a wrong chunk fails the forward); the end-to-end
tests check that greedy outputs stay token-identical to a run without a connector."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.kv_transfer.offload import disk as disk_mod
from kvferry.kv_transfer.offload.disk import (
    HEADER,
    KEYED_HEADER,
    MAGIC,
    CorruptChunk,
    DiskStore,
    layout_fingerprint,
)
from kvferry.request import Request
from tests.helpers.offload_harness import OffloadHarness
from tests.helpers.scheduler import create_request

OFFLOAD = "OffloadingConnector"
SECRET = b"disk-tier-test-secret-0123456789"


@pytest.fixture(autouse=True)
def _no_ambient_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFERRY_KV_SECRET", raising=False)
    monkeypatch.delenv("KVFERRY_KV_SECRET_FILE", raising=False)


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


# -- files that are not chunk files ---------------------------------------------------------


def test_fifo_in_place_of_a_chunk_is_refused_without_blocking(tmp_path: Path) -> None:
    store = _store(tmp_path)
    os.mkfifo(store.path(k(1)))
    _refused_fast(store, k(1), "is a FIFO")
    store.delete(k(1))
    assert not os.path.lexists(store.path(k(1)))
    store.shutdown()


def test_symlinks_are_refused_and_deleting_one_keeps_its_target(tmp_path: Path) -> None:
    inside, outside = tmp_path / "tier", tmp_path / "elsewhere"
    outside.mkdir()
    store = _store(inside)
    store.write(k(1), _views(1))
    target = outside / "chunk.kvc"
    shutil.copy(store.path(k(1)), target)  # a valid chunk file, outside the folder
    store.path(k(2)).symlink_to(target)
    store.path(k(3)).symlink_to(store.path(k(1)))  # inside the folder: refused all the same
    store.path(k(4)).symlink_to("/dev/zero")
    for key in (k(2), k(3), k(4)):
        _refused_fast(store, key, "symbolic link")
    for key in (k(2), k(3), k(4)):
        store.delete(key)
    assert target.exists() and store.path(k(1)).exists()
    assert disk_mod.scan_folder(inside, store.file_size) == ([bytes.fromhex(k(1))], [])
    store.shutdown()


def test_device_files_are_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        os.mknod(store.path(k(1)), 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's
    except PermissionError:
        pytest.skip("mknod needs privileges here")
    _refused_fast(store, k(1), "character device")
    store.shutdown()


def test_scan_drops_entries_that_are_not_regular_files(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write(k(1), _views(1))
    big = tmp_path / "big"
    big.write_bytes(b"\0" * store.file_size)  # the right size, behind a link
    store.path(k(2)).symlink_to(big)
    os.mkfifo(store.path(k(3)))
    good, bad = disk_mod.scan_folder(tmp_path, store.file_size)
    assert good == [bytes.fromhex(k(1))]
    assert sorted(bad) == sorted(bytes.fromhex(k(i)) for i in (2, 3))
    store.shutdown()


# -- reads bounded in time ------------------------------------------------------------------


def test_a_stuck_read_is_abandoned_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path, read_timeout_s=0.3)
    store.write(k(1), _views(1))
    gate = threading.Event()
    real = disk_mod._read_file

    def hung_read(path: Path, buf: bytearray) -> int:
        if path.name.startswith(k(1)):
            gate.wait(30)  # a read on a mount that stopped answering
        return real(path, buf)

    monkeypatch.setattr(disk_mod, "_read_file", hung_read)
    out = [torch.zeros_like(v) for v in _views(0)]
    t0 = time.monotonic()
    with pytest.raises(CorruptChunk, match="abandoned"):
        store.read_into(k(1), out)
    assert time.monotonic() - t0 < 1.0
    assert all(not o.any() for o in out)
    # Other reads go on, on a fresh thread, while the stuck one still waits.
    store.write(k(2), _views(2))
    store.read_into(k(2), out)
    assert all(torch.equal(a, b) for a, b in zip(out, _views(2), strict=True))
    assert store._reader.num_stuck == 1
    gate.set()
    for _ in range(100):
        if store._reader.num_stuck == 0:
            break
        time.sleep(0.01)
    assert store._reader.num_stuck == 0
    store.read_into(k(1), out)  # the file itself was fine
    assert all(torch.equal(a, b) for a, b in zip(out, _views(1), strict=True))
    store.shutdown()


# -- keyed checksums ------------------------------------------------------------------------


def _rewrite_with_crc(path: Path, payload: bytes) -> None:
    """What someone with write access but no key can do to an unkeyed file: new payload,
    checksum recomputed."""
    raw = path.read_bytes()
    magic, key, layout, length, _, pad = HEADER.unpack(raw[: HEADER.size])
    header = HEADER.pack(magic, key, layout, length, zlib.crc32(payload), pad)
    path.write_bytes(header + payload)


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


# -- through the connector and the scheduler ----------------------------------------------


def prompt(i: int, n: int = 70) -> list[int]:
    return list(range(1000 * i, 1000 * i + n))


def req(i: int, n: int = 70, max_tokens: int = 4) -> Request:
    return create_request(prompt_token_ids=prompt(i, n), max_tokens=max_tokens)


def _disk(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    return {"num_cpu_chunks": 2, "disk_path": str(tmp_path), "num_disk_chunks": 64, **kw}


def _secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return str(path)


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


def _forge(folder: Path, keyed: bool) -> int:
    """Replace every chunk's payload with other KV (float32 noise), fixing the checksum where
    that can be done without the key. Returns the files changed."""
    files = sorted(folder.glob("*.kvc"))
    size = KEYED_HEADER.size if keyed else HEADER.size
    g = torch.Generator().manual_seed(0)
    for f in files:
        raw = f.read_bytes()
        noise = (torch.randn((len(raw) - size) // 4, generator=g) * 4).numpy().tobytes()
        if keyed:
            f.write_bytes(raw[:size] + noise)
        else:
            _rewrite_with_crc(f, noise)
    return len(files)


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


# -- end to end: token-identical outputs ----------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    system = torch.randint(5, 2000, (96,), generator=g).tolist()
    return [system + torch.randint(5, 2000, (12,), generator=g).tolist() for _ in range(3)]


def _llm(model_dir: Path, kv: dict[str, Any] | None) -> LLM:
    args: dict[str, Any] = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 10}
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model_dir), **args)


def _generate(llm: LLM) -> tuple[list[list[int]], dict[str, Any]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    sched = engine.scheduler
    assert sched.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_config.num_blocks
    if sched.connector is not None:
        sched.connector.check_offload_integrity(idle=True)  # type: ignore[attr-defined]
    stats = dict(engine.kv_connector_totals.as_dict())
    engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], stats


@pytest.mark.slow
def test_end_to_end_fifo_and_keyed_rewrites_keep_outputs_identical(
    tiny_model_factory, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama")
    reference, _ = _generate(_llm(model_dir, None))
    kv = {
        "kv_connector": OFFLOAD,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "num_cpu_chunks": 2,
            "disk_path": str(tmp_path / "d"),
            "secret_file": _secret_file(tmp_path),
        },
    }
    tokens, _ = _generate(_llm(model_dir, kv))
    assert tokens == reference
    folder = next((tmp_path / "d").rglob("rank0"))
    files = sorted(folder.glob("*.kvc"))
    assert _forge(folder, keyed=True) >= 4
    os.unlink(files[-1])
    os.mkfifo(files[-1])
    t0 = time.monotonic()
    tokens, stats = _generate(_llm(model_dir, kv))
    assert time.monotonic() - t0 < 20
    assert tokens == reference  # zero wrong outputs
    assert stats["corrupt_chunks"] >= 4
