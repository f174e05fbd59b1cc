"""Starting a real LMCache server for tests and demos: no usage reports leave the machine,
a server that stays silent is started once more, and what fails says why (its log's tail)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.kv_transfer.connectors.lmcache_mp.harness import CHUNK, lmcache_server_mod

pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")


def _our_segments() -> set[str]:
    prefix = f"kvferry_lmcache_{os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_the_server_sends_no_usage_reports(tmp_path: Path) -> None:
    log = tmp_path / "lmcache.log"
    server = lmcache_server_mod.start_lmcache_server(chunk_size=CHUNK, l1_size_gb=0.1, log_path=log)
    try:
        env = _environ(server.proc.pid)
        assert env["LMCACHE_TRACK_USAGE"] == "false" and env["DO_NOT_TRACK"] == "1"
    finally:
        server.kill()
    text = log.read_text()
    assert "cache server is running" in text and "usage context" not in text


def test_a_silent_server_is_started_once_more_then_reported(tmp_path: Path, caplog) -> None:
    before = _our_segments()
    log = tmp_path / "lmcache.log"
    with (
        caplog.at_level(logging.WARNING, logger=lmcache_server_mod.__name__),
        pytest.raises(RuntimeError, match=r"did not answer within 0.2s; .*lmcache.log") as e,
    ):
        lmcache_server_mod.start_lmcache_server(
            chunk_size=CHUNK, l1_size_gb=0.1, log_path=log, timeout=0.2, attempts=2
        )
    assert "starting it again (launch 2 of 2)" in caplog.text
    assert "Traceback" not in str(e.value)
    assert _our_segments() == before  # both launches stopped and cleaned up


def test_a_second_launch_that_answers_is_kept(tmp_path: Path, monkeypatch, caplog) -> None:
    launches: list[subprocess.Popen[bytes]] = []
    real_popen, real_wait = subprocess.Popen, lmcache_server_mod.wait_answering

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        launches.append(real_popen(*args, **kwargs))
        return launches[-1]

    def first_stays_silent(url: str, timeout: float) -> None:
        if len(launches) == 1:
            time.sleep(min(timeout, 0.5))
            raise TimeoutError
        real_wait(url, timeout)

    monkeypatch.setattr(lmcache_server_mod.subprocess, "Popen", popen)
    monkeypatch.setattr(lmcache_server_mod, "wait_answering", first_stays_silent)
    with caplog.at_level(logging.WARNING, logger=lmcache_server_mod.__name__):
        server = lmcache_server_mod.start_lmcache_server(
            chunk_size=CHUNK, l1_size_gb=0.1, log_path=tmp_path / "lmcache.log", timeout=12
        )
    monkeypatch.undo()
    try:
        assert len(launches) == 2 and server.proc is launches[1]
        assert launches[0].poll() is not None  # the silent one was stopped
        assert "launch 2 of 2" in caplog.text
        lmcache_server_mod.wait_answering(server.url, timeout=10)
    finally:
        server.kill()


def test_no_request_is_sent_before_the_server_listens(tmp_path: Path, monkeypatch) -> None:
    """A request queued before the server binds would reach it later from a client that has
    timed out and gone (LMCache then logs a failed reply): the start-up probe asks only once
    the port takes connections."""
    real_wait = lmcache_server_mod.wait_answering
    listening: list[bool] = []

    def probe(url: str, timeout: float) -> None:
        port = int(url.rsplit(":", 1)[1])
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            listening.append(True)
        except OSError:
            listening.append(False)
        real_wait(url, timeout)

    monkeypatch.setattr(lmcache_server_mod, "wait_answering", probe)
    server = lmcache_server_mod.start_lmcache_server(
        chunk_size=CHUNK, l1_size_gb=0.1, log_path=tmp_path / "lmcache.log"
    )
    server.kill()
    assert listening and all(listening)
