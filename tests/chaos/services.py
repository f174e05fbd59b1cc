"""The processes the chaos suite attacks: ``kvferry serve`` / ``kvferry proxy`` on fixed loopback
ports (so one can be killed and started again where its peers expect it), and what the suite
reads from them: KV pool state from ``/metrics``, ``/health``, tracebacks in their logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvferry.entrypoints.demo import Instance, start, wait_healthy, wait_listening
from tests.helpers.servers import ENGINE_FLAGS, dead_port, scrape

REPO = Path(__file__).resolve().parents[2]
HEALTH_STALL_S = 5.0


def free_port() -> int:
    return dead_port()


@dataclass
class KVState:
    usage: float
    running: float
    waiting: float
    held: float

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.held == 0


@dataclass
class Service:
    """One ``kvferry`` process on a fixed loopback port, so it can be killed and restarted
    where its peers expect it. ``num_blocks`` is its KV pool (None for the proxy)."""

    name: str
    argv: list[str]
    log_dir: Path
    env: dict[str, str]
    port: int
    num_blocks: int | None = None
    inst: Instance | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.inst is not None
        return self.inst.proc.pid

    @property
    def log(self) -> Path:
        assert self.inst is not None
        return self.inst.log

    def start(self) -> None:
        suffix = f"-{self.starts}" if self.starts else ""
        self.inst = start(self.name + suffix, self.argv, self.log_dir, env=self.env)
        self.starts += 1

    def wait_ready(self, timeout: float = 180.0) -> None:
        assert self.inst is not None
        wait_listening(self.inst, timeout)
        wait_healthy(self.url, timeout, inst=self.inst)

    def alive(self) -> bool:
        return self.inst is not None and self.inst.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs, as in a crash."""
        assert self.inst is not None
        self.inst.proc.send_signal(signal.SIGKILL)
        self.inst.proc.wait(30)

    def stop(self) -> None:
        if self.inst is None or self.inst.proc.poll() is not None:
            return
        self.inst.proc.terminate()
        try:
            self.inst.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.inst.proc.kill()
            self.inst.proc.wait()

    def ensure_up(self) -> None:
        """Restart the process if it exited or its engine is dead (so each attack starts from
        a working service, whatever the one before did)."""
        if self.alive() and _healthy(self):
            return
        self.stop()
        self.start()
        self.wait_ready()

    def kv_state(self) -> KVState | None:
        if self.num_blocks is None:
            return None
        m = scrape(self.url)
        return KVState(
            m.get("vllm:kv_cache_usage_perc", 0.0),
            m.get("vllm:num_requests_running", 0.0),
            m.get("vllm:num_requests_waiting", 0.0),
            m.get("kvferry_num_requests_held_by_connector", 0.0),
        )

    def used_blocks(self, state: KVState) -> int:
        assert self.num_blocks is not None
        return round(state.usage * self.num_blocks)

    def tracebacks(self) -> int:
        """Tracebacks in all logs of this service so far."""
        return sum(
            p.read_text(errors="replace").count("Traceback")
            for p in self.log_dir.glob(f"{self.name}*.log")
        )


def supported_serve_flags(*flags: str) -> list[str]:
    """``flags`` (``--flag value`` pairs) minus those this ``kvferry serve`` does not know
    yet, so the suite still runs (and reports) on a tree where a limit has not landed."""
    from kvferry.entrypoints.cli import build_parser

    _, unknown = build_parser().parse_known_args(["serve", "model", *flags])
    out, it = [], iter(flags)
    for flag, value in zip(it, it, strict=True):
        if flag not in unknown:
            out += [flag, value]
    return out


def serve_service(
    name: str,
    model: Path,
    log_dir: Path,
    *extra: str,
    kv: dict[str, Any] | None = None,
    num_blocks: int = 256,
    env: dict[str, str] | None = None,
) -> Service:
    port = free_port()
    argv = ["serve", str(model), "--port", str(port), "--served-model-name", "tiny"]
    argv += [*ENGINE_FLAGS, "--num-kv-blocks", str(num_blocks), *supported_serve_flags(*extra)]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    return Service(name, argv, log_dir, _env(env), port, num_blocks)


def proxy_service(name: str, log_dir: Path, prefill: Service, decode: Service) -> Service:
    port = free_port()
    argv = ["proxy", "--port", str(port), "--prefill", prefill.url, "--decode", decode.url]
    return Service(name, argv, log_dir, _env(None), port)


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("KVFERRY_LOG_STATS_INTERVAL", "3600")
    env.update(extra or {})
    return env


def start_all(*services: Service) -> None:
    """Start every service at once (they load in parallel), then wait for each."""
    for s in services:
        s.start()
    for s in services:
        s.wait_ready()


def _healthy(s: Service) -> bool:
    try:
        return (
            httpx.get(s.url + "/health", timeout=HEALTH_STALL_S * 2, trust_env=False).status_code
            == 200
        )
    except httpx.HTTPError:
        return False


class _HealthWatch(threading.Thread):
    """Polls ``/health`` of each service; records the slowest answer and anything not 200."""

    def __init__(self, services: Sequence[Service], period: float = 0.5) -> None:
        super().__init__(daemon=True, name="chaos-health")
        self.services = services
        self.period = period
        self.stop = threading.Event()
        self.slowest: dict[str, float] = {s.name: 0.0 for s in services}
        self.bad: dict[str, list[str]] = {s.name: [] for s in services}
        self.dead_503: set[str] = set()

    def run(self) -> None:
        with httpx.Client(trust_env=False, timeout=HEALTH_STALL_S * 2) as http:
            while not self.stop.is_set():
                for s in self.services:
                    t0 = time.monotonic()
                    try:
                        r = http.get(s.url + "/health")
                        status: str = str(r.status_code)
                        if r.status_code == 503:
                            self.dead_503.add(s.name)
                    except httpx.HTTPError as e:
                        status = type(e).__name__
                    took = time.monotonic() - t0
                    self.slowest[s.name] = max(self.slowest[s.name], took)
                    if status != "200" and len(self.bad[s.name]) < 20:
                        self.bad[s.name].append(status)
                self.stop.wait(self.period)
