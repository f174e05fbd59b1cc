"""The disk tier against a hostile or broken folder: non-regular files in place of chunk
files (FIFOs, devices, symbolic links) are refused without blocking, and a stuck read is
abandoned within its bound.

The ambient deployment secret is unset for every test (``no_ambient_secret``)."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from kvferry.kv_transfer.offload import disk as disk_mod
from kvferry.kv_transfer.offload.disk import CorruptChunk
from tests.helpers.disk_tier import _refused_fast, _store, _views, k

pytestmark = pytest.mark.usefixtures("no_ambient_secret")


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
