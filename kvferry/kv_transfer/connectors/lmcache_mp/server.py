"""Start a real LMCache multi-process server for tests, the demo and benchmarks.

:func:`lmcache_server` runs ``python -m lmcache.v1.multiprocess.server`` on 127.0.0.1 on
a free port, with metrics off (its Prometheus endpoint would bind 0.0.0.0), LMCache's usage
reports off (they would go to LMCache's web service), both transfer modes enabled (a CPU
engine copies blocks itself: engine-driven) and a private POSIX shared-memory segment for
those copies; it waits until the server answers a request, and stops it (and removes the
segment) on exit, also after a failure.

This is a convenience for one machine. A deployment runs its LMCache server the way LMCache
documents and points the connector at it (``lmcache.mp.host`` / ``lmcache.mp.port``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvferry.kv_transfer.connectors.lmcache_mp.lmcache_api import lmcache_api

HOST = "127.0.0.1"

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class LMCacheServer:
    """A running server: ``url`` for ``lmcache.mp.server_urls``, ``extra_config()`` for a
    connector config. ``kill()`` ends it abruptly (SIGKILL), ``stop()`` gently."""

    port: int
    chunk_size: int
    proc: subprocess.Popen[bytes]
    shm_name: str
    log_path: Path | None
    argv: list[str] = field(default_factory=list)
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"tcp://{HOST}:{self.port}"

    def extra_config(self, **more: Any) -> dict[str, Any]:
        cfg: dict[str, Any] = {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": self.port}
        cfg.update(more)
        return cfg

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._cleanup()

    def stop(self, timeout: float = 20.0) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self._cleanup()

    def _cleanup(self) -> None:
        _unlink_shm(self.shm_name)
        if self._log is not None:
            self._log.close()
            self._log = None


def _unlink_shm(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(f"/dev/shm/{name}")


def wait_answering(url: str, timeout: float) -> None:
    """Wait until the server at ``url`` answers a chunk-size request."""
    api = lmcache_api()
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    client = RequestClientFactory.create(url, context=api.zmq_context)
    try:
        client.get_chunk_size().result(timeout=timeout)
    finally:
        client.close()


def start_lmcache_server(
    *,
    chunk_size: int = 256,
    l1_size_gb: float = 1.0,
    port: int | None = None,
    log_path: Path | None = None,
    extra_args: tuple[str, ...] = (),
    timeout: float = 45.0,
    attempts: int = 2,
    shared_memory: bool = True,
) -> LMCacheServer:
    """Start a server and wait until it answers (see the module docstring).
    ``shared_memory=False`` leaves out ``--shm-name`` (kvferry's connector refuses such a
    server: LMCache would send KV to the engine as pickles). A server that is up but stays
    silent for ``timeout`` seconds is stopped and started again, ``attempts`` launches in
    all; one that exits is not retried. Errors carry the tail of the server's log."""
    lmcache_api()  # a clear ConfigError when LMCache is not installed
    launch = functools.partial(
        _launch,
        chunk_size=chunk_size,
        l1_size_gb=l1_size_gb,
        log_path=log_path,
        extra_args=extra_args,
        timeout=timeout,
        shared_memory=shared_memory,
    )
    for attempt in range(1, attempts):
        try:
            return launch(port=free_port() if port is None else port)
        except _Silent as e:
            logger.warning("%s; starting it again (launch %d of %d)", e, attempt + 1, attempts)
    try:
        return launch(port=free_port() if port is None else port)
    except _Silent as e:
        raise RuntimeError(str(e)) from None


class _Silent(Exception):
    """The server process is up but did not answer in time."""


def _launch(
    *,
    chunk_size: int,
    l1_size_gb: float,
    port: int,
    log_path: Path | None,
    extra_args: tuple[str, ...],
    timeout: float,
    shared_memory: bool,
) -> LMCacheServer:
    shm_name = f"kvferry_lmcache_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    argv = [
        sys.executable, "-m", "lmcache.v1.multiprocess.server",
        "--host", HOST, "--port", str(port),
        "--chunk-size", str(chunk_size),
        "--l1-size-gb", str(l1_size_gb), "--eviction-policy", "LRU",
        "--supported-transfer-mode", "auto",
        *(("--shm-name", shm_name) if shared_memory else ()),
        "--disable-metrics",
        *extra_args,
    ]  # fmt: skip
    log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - owned below
    log_start = log.tell() if log is not None else 0
    proc = subprocess.Popen(
        argv,
        stdout=log if log is not None else subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=_server_env(),
    )
    server = LMCacheServer(port, chunk_size, proc, shm_name, log_path, argv, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if not server.alive():
                raise RuntimeError(
                    f"the LMCache server exited with {proc.returncode} before answering"
                    + _log_tail(log_path, log_start)
                )
            # A request sent before the server listens would reach it later, from a client
            # already gone: ask only once the port takes connections.
            if _listening(port):
                with contextlib.suppress(TimeoutError):
                    left = deadline - time.monotonic()
                    wait_answering(server.url, timeout=min(2.0, max(0.1, left)))
                    return server
            else:
                time.sleep(0.1)
            if time.monotonic() > deadline:
                raise _Silent(
                    f"the LMCache server on {server.url} did not answer within {timeout}s"
                    + _log_tail(log_path, log_start)
                )
    except BaseException:
        server.stop()
        raise


def _listening(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def _server_env() -> dict[str, str]:
    # LMCache reports usage to its own web service by default; a test or demo server sends
    # nothing off the machine (and does not wait on a lookup that cannot succeed offline).
    return {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def _log_tail(log_path: Path | None, start: int, lines: int = 15) -> str:
    if log_path is None:
        return ""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return f"; see {log_path}"
    tail = "\n".join(text.splitlines()[-lines:])
    return f"; see {log_path}, which ends:\n{tail}" if tail else f"; {log_path} is empty"


@contextlib.contextmanager
def lmcache_server(**kwargs: Any) -> Iterator[LMCacheServer]:
    """:func:`start_lmcache_server` as a context manager that always stops the server."""
    server = start_lmcache_server(**kwargs)
    try:
        yield server
    finally:
        server.stop()
