"""Helpers for tests that run ``kvferry serve`` / ``kvferry proxy`` as subprocesses on free
loopback ports (port 0; the process prints the address it got)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvferry.entrypoints.demo import Instance, scrape, start, stop, wait_healthy, wait_listening

# The repository root: subprocesses import the test connectors as ``tests.helpers.*``.
ROOT = Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-batched-tokens", "512"]
OFFLINE_KW = {"dtype": "float32", "max_model_len": 512, "max_num_batched_tokens": 512}

__all__ = ["Instance", "scrape", "stop", "wait_healthy", "wait_listening"]


def pd_kv_config(store: Path, lease_s: float = 60.0) -> dict[str, Any]:
    return {
        "kv_connector": "PDTestConnector",
        "kv_connector_module_path": "tests.helpers.pd_test_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store), "lease_s": lease_s},
    }


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("KVFERRY_LOG_STATS_INTERVAL", "3600")
    return env


def start_server(
    name: str,
    model: Path,
    log_dir: Path,
    kv: dict[str, Any] | None = None,
    *extra: str,
    env: dict[str, str] | None = None,
) -> Instance:
    """``env``: variables set for this server only, on top of this process's."""
    argv = ["serve", str(model), "--port", "0", "--served-model-name", "tiny", *ENGINE_FLAGS]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    return start(name, [*argv, *extra], log_dir, env={**_env(), **(env or {})})


@contextlib.contextmanager
def serving(
    name: str, model: Path, log_dir: Path, kv: dict[str, Any] | None = None, *extra: str
) -> Iterator[Instance]:
    """A ready ``kvferry serve`` (see :func:`start_server`), stopped on exit; its log must end
    without a traceback."""
    inst = start_server(name, model, log_dir, kv, *extra)
    try:
        ready(inst)
        yield inst
    finally:
        stop([inst])
        assert "Traceback" not in inst.log.read_text(), inst.log.read_text()[-3000:]


@contextlib.contextmanager
def pd_serving(
    model: Path,
    log_dir: Path,
    prefill_kv: dict[str, Any],
    decode_kv: dict[str, Any],
    *extra: str,
    prefill_extra: Sequence[str] = (),
    decode_extra: Sequence[str] = (),
    prefill_env: dict[str, str] | None = None,
    decode_env: dict[str, str] | None = None,
) -> Iterator[dict[str, Instance]]:
    """A ready prefill and decode ``kvferry serve`` behind ``kvferry proxy``, by name
    (``prefill``, ``decode``, ``proxy``), stopped on exit; no log may hold a traceback.
    ``extra`` flags go to both servers, ``prefill_extra`` / ``decode_extra`` to one, and
    ``prefill_env`` / ``decode_env`` environment variables to one."""
    procs = [
        start_server(
            "prefill", model, log_dir, prefill_kv, *extra, *prefill_extra, env=prefill_env
        ),
        start_server("decode", model, log_dir, decode_kv, *extra, *decode_extra, env=decode_env),
    ]
    try:
        p_url, d_url = (wait_listening(i) for i in procs)
        procs.append(start_proxy("proxy", log_dir, [p_url], [d_url]))
        ready(*procs)
        yield {i.name: i for i in procs}
    finally:
        stop(procs)
        for inst in procs:
            assert "Traceback" not in inst.log.read_text(), inst.log.read_text()[-3000:]


def start_proxy(name: str, log_dir: Path, prefill: list[str], decode: list[str]) -> Instance:
    argv = ["proxy", "--port", "0", "--prefill", *prefill, "--decode", *decode]
    return start(name, argv, log_dir, env=_env())


def ready(*instances: Instance) -> None:
    """Wait until every instance listens and answers /health."""
    for inst in instances:
        wait_listening(inst)
    for inst in instances:
        wait_healthy(inst.url, inst=inst)


def wait_for(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def metric(url: str, name: str, **labels: str) -> float:
    key = name
    if labels:
        key += "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
    return scrape(url).get(key, 0.0)


def dead_port() -> int:
    """A loopback port nobody listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
