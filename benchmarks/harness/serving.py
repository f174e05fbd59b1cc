"""``kvferry serve`` / ``kvferry proxy`` processes for the P/D benchmarks, and a streaming
client that stamps every token as it arrives."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry.entrypoints.demo import Instance, start, stop, wait_healthy, wait_listening


def serve_env() -> dict[str, str]:
    """This process's environment for a server: UCX on loopback, no periodic stats logs."""
    return {**os.environ, "UCX_NET_DEVICES": "lo", "KVFERRY_LOG_STATS_INTERVAL": "3600"}


_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def http_client() -> Any:
    """One ``httpx.Client`` for every request this process sends (thread-safe). A client per
    request (``httpx.stream(...)``) costs 30-40 ms of set-up (its SSL context) that would be
    counted in every TTFT."""
    import httpx

    with _clients_lock:
        if "client" not in _clients:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
            _clients["client"] = httpx.Client(timeout=600, limits=limits, trust_env=False)
        return _clients["client"]


def start_serve(
    name: str,
    model: Path,
    logs: Path,
    flags: list[str],
    kv: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> Instance:
    """``kvferry serve MODEL`` on a free port, served as model ``m``, logging to ``logs``."""
    argv = ["serve", str(model), "--port", "0", "--served-model-name", "m", *flags]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    return start(name, argv, logs, env=serve_env() if env is None else env)


@dataclass
class PDUrls:
    proxy: str
    prefill: str
    decode: str


@contextmanager
def pd_deployment(
    model: Path,
    logs: Path,
    flags: list[str],
    kvs: tuple[dict[str, Any], dict[str, Any]],
    env: dict[str, str] | None = None,
    proxy_env: dict[str, str] | None = None,
    tag: str = "",
) -> Iterator[PDUrls]:
    """A prefill and a decode instance (``kvs``: their KV-transfer configs) behind a proxy,
    all healthy; stopped on exit. Logs are ``prefill{tag}.log``, ``decode{tag}.log``,
    ``proxy{tag}.log``; the proxy runs in ``proxy_env`` (this process's when None)."""
    p = start_serve(f"prefill{tag}", model, logs, flags, kvs[0], env)
    d = start_serve(f"decode{tag}", model, logs, flags, kvs[1], env)
    procs = [p, d]
    try:
        p_url, d_url = wait_listening(p), wait_listening(d)
        argv = ["proxy", "--port", "0", "--prefill", p_url, "--decode", d_url]
        proxy = start(f"proxy{tag}", argv, logs, env=proxy_env)
        procs.append(proxy)
        url = wait_listening(proxy)
        for inst in procs:
            wait_healthy(inst.url, inst=inst)
        yield PDUrls(url, p_url, d_url)
    finally:
        stop(procs)


def stream_completion(url: str, prompt: list[int], max_tokens: int, out: dict[str, Any]) -> None:
    """One streamed greedy completion of token ids ``prompt``; fills ``out`` with ``ttft``
    (request sent -> first token), ``itl`` (mean gap after it), ``tokens`` and ``max_gap``."""

    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    with http_client().stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            n = len(chunk["choices"][0].get("token_ids") or []) if chunk.get("choices") else 0
            stamps.extend([time.perf_counter()] * n)
    out["ttft"] = stamps[0] - t0
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > a]
    out["itl"] = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    out["tokens"] = len(stamps)
    out["max_gap"] = max(gaps) if gaps else 0.0
