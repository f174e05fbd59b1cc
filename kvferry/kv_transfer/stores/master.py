"""``MooncakeMaster``: a real ``mooncake_master`` on 127.0.0.1, for tests, demos and
benchmarks.

It starts the master with its HTTP metadata server (no etcd), on free ports, and optionally a
standalone ``mooncake_client`` that lends ``segment_bytes`` of memory to the store, so stored
KV outlives any one engine (engines then lend none: ``global_segment_size`` 0). It waits until
both answer, exposes the addresses and the client config (:meth:`config`, or
:meth:`write_config_file` for ``MOONCAKE_CONFIG_PATH``), can be killed and restarted on the
same ports (failure tests), and stops everything on exit.

Binding: the master's RPC (``-rpc_address``) and metrics server (``-metrics_host``) and the
standalone client's service (``-host``) bind 127.0.0.1; Mooncake 0.3.13 binds its HTTP
metadata server and the clients' transfer-engine ports on every interface whatever the flags
say (``-http_metadata_server_host`` only names the address clients are told).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from kvferry.logger import init_logger

logger = init_logger(__name__)

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _find_binary(name: str) -> str:
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"{name} not found (install mooncake-transfer-engine-non-cuda: "
            "`pip install kvferry[mooncake]`)"
        )
    return found


def _answers(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), 0.2).close()
        return True
    except OSError:
        return False


class MooncakeMaster:
    """A ``mooncake_master`` process (and an optional storage client) on free local ports."""

    def __init__(
        self,
        segment_bytes: int = 0,
        log_dir: str | None = None,
        extra_args: tuple[str, ...] = (),
        start_timeout_s: float = 30.0,
    ) -> None:
        self.rpc_port = _free_port()
        self.http_port = _free_port()
        self.metrics_port = _free_port()
        self.client_port = _free_port()
        self.segment_bytes = segment_bytes
        self.extra_args = extra_args
        self.start_timeout_s = start_timeout_s
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvferry-mooncake-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._master: subprocess.Popen[bytes] | None = None
        self._client: subprocess.Popen[bytes] | None = None
        self._starts = 0

    # -- addresses --------------------------------------------------------------------------
    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.http_port}/metadata"

    def config(self, global_segment_size: int | None = None) -> dict[str, Any]:
        """Client settings (MOONCAKE_CONFIG_PATH keys) for this master. Engines lend no
        memory when a storage client runs, else 64 MiB each unless told otherwise."""
        if global_segment_size is None:
            global_segment_size = 0 if self.segment_bytes else 64 << 20
        return {
            "local_hostname": HOST,
            "metadata_server": self.metadata_server,
            "master_server_address": self.master_address,
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": global_segment_size,
            "local_buffer_size": 16 << 20,
        }

    def write_config_file(self, path: str | os.PathLike[str], **kw: Any) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.config(**kw)))
        return p

    # -- lifecycle --------------------------------------------------------------------------
    def _spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}-{self._starts}.log", "wb")  # noqa: SIM115
        try:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def _wait(self, proc: subprocess.Popen[bytes], ports: list[int], what: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not all(_answers(p) for p in ports):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{what} exited with {proc.returncode} at start; see {self.log_dir}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start in {self.start_timeout_s} s")
            time.sleep(0.05)

    def start(self) -> MooncakeMaster:
        self._starts += 1
        args = [
            _find_binary("mooncake_master"),
            "-rpc_port", str(self.rpc_port),
            "-rpc_address", HOST,
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host", HOST,
            "-http_metadata_server_port", str(self.http_port),
            "-metrics_host", HOST,
            "-metrics_port", str(self.metrics_port),
            *self.extra_args,
        ]  # fmt: skip
        self._master = self._spawn(args, "master")
        try:
            self._wait(self._master, [self.rpc_port, self.http_port], "mooncake_master")
            if self.segment_bytes:
                self._start_client()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_client(self) -> None:
        args = [
            _find_binary("mooncake_client"),
            "-host", HOST,
            "-port", str(self.client_port),
            "-global_segment_size", str(self.segment_bytes),
            "-local_buffer_size", str(16 << 20),
            "-master_server_address", self.master_address,
            "-metadata_server", self.metadata_server,
            "-protocol", "tcp",
        ]  # fmt: skip
        self._client = self._spawn(args, "client")
        self._wait(self._client, [self.client_port], "mooncake_client")

    def kill(self) -> None:
        """Kill the master (SIGKILL) and its storage client, as a crash would."""
        for proc in (self._client, self._master):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        self._client = self._master = None

    def restart(self) -> MooncakeMaster:
        """Start again on the same ports (after :meth:`kill`); the store starts empty."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        for proc in (self._client, self._master):
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._client = self._master = None

    @property
    def running(self) -> bool:
        return self._master is not None and self._master.poll() is None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if self._own_log_dir and exc_type is None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
