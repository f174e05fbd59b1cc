"""The demos' process plumbing: ``python -m kvferry ...`` subprocesses on free loopback ports
(each prints the address it listens on), their health, their ``/metrics`` and shutdown. Tests
and benchmarks start their servers with the same helpers."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvferry.config import ConfigError

__all__ = [
    "Instance",
    "connector_stats",
    "scrape",
    "start",
    "stop",
    "transfer_summary",
    "wait_healthy",
    "wait_listening",
]


@dataclass
class Instance:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""


def start(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Instance:
    """Start ``python -m kvferry ARGV`` with output in ``log_dir/NAME.log``."""
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvferry", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return Instance(name, proc, log)


def wait_listening(inst: Instance, timeout: float = 180.0) -> str:
    """The URL the instance prints once it listens; ConfigError if it dies or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = inst.log.read_text(errors="replace") if inst.log.exists() else ""
        for line in text.splitlines():
            if " listening on " in line:
                inst.url = line.rsplit(" ", 1)[-1].strip()
                return inst.url
        if inst.proc.poll() is not None:
            tail = "\n".join(text.splitlines()[-15:])
            raise ConfigError(f"{inst.name} exited with code {inst.proc.returncode}:\n{tail}")
        time.sleep(0.05)
    raise ConfigError(f"{inst.name} did not start within {timeout:.0f}s (log: {inst.log})")


def wait_healthy(url: str, timeout: float = 120.0, inst: Instance | None = None) -> None:
    """Wait for ``url/health`` to answer 200; ConfigError on timeout or if ``inst`` dies."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if inst is not None and inst.proc.poll() is not None:
            tail = "\n".join(inst.log.read_text(errors="replace").splitlines()[-15:])
            raise ConfigError(f"{inst.name} exited with code {inst.proc.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=5.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise ConfigError(f"{url}/health did not turn healthy within {timeout:.0f}s")


def stop(instances: list[Instance], timeout: float = 15.0) -> None:
    for inst in instances:
        if inst.proc.poll() is None:
            inst.proc.terminate()
    deadline = time.monotonic() + timeout
    for inst in instances:
        try:
            inst.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            inst.proc.kill()
            inst.proc.wait()


_IMPLIED = ("model_name", "engine")


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{label=value,...}": value}`` (labels sorted, without the
    ``model_name`` and ``engine`` every server series carries)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in _IMPLIED)
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def connector_stats(metrics: dict[str, float]) -> dict[str, float]:
    """The connector's stats from scraped metrics: counters, and sums of sample lists."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        for prefix in ("kvferry_kv_connector_total{", "kvferry_kv_connector_samples_sum{"):
            if key.startswith(prefix):
                stat = key[len(prefix) : -1].removeprefix("stat=")
                out[stat] = out.get(stat, 0.0) + value
    return out


def transfer_summary(metrics: dict[str, float]) -> str:
    """Bytes and bandwidth the connector reported, or an estimate from external hits."""
    stats = connector_stats(metrics)
    nbytes = sum(v for k, v in stats.items() if "bytes" in k)
    secs = sum(v for k, v in stats.items() if any(w in k for w in ("duration", "seconds")))
    if nbytes > 0:
        bw = f" in {secs * 1e3:.1f} ms = {nbytes / secs / 1e6:.1f} MB/s" if secs > 0 else ""
        return f"connector moved {nbytes / 1e6:.3f} MB{bw}"
    hits = metrics.get("vllm:external_prefix_cache_hits_total", 0.0)
    per_tok = metrics.get("kvferry_kv_cache_bytes_per_token", 0.0)
    detail = f" ({', '.join(f'{k}={v:g}' for k, v in sorted(stats.items()))})" if stats else ""
    return (
        f"no byte counts reported{detail}; {hits:.0f} external hit tokens "
        f"= ~{hits * per_tok / 1e6:.3f} MB of KV"
    )
