"""Tensor-parallel engines that lose a worker, or are asked for a size the model cannot be
split over: clear errors within seconds, nothing hangs, no process is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvferry import LLM, SamplingParams
from kvferry.config import ConfigError
from kvferry.worker.multiproc_executor import WorkerFailedError
from tests.helpers.servers import ROOT, _env, serving, stop, wait_for

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
KW = {"dtype": "float32", "max_model_len": 256}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


def test_killed_worker_is_reported_within_seconds(model: Path) -> None:
    llm = LLM(model=str(model), tensor_parallel_size=2, **KW)
    pids = llm.engine.executor.worker_pids
    try:
        assert len(llm.generate([[5, 6, 7]], SP, use_tqdm=False)[0].outputs[0].token_ids) == 4
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"rank 1 .*died.*SIGKILL"):
            llm.generate([[5, 6, 7, 8]], SP, use_tqdm=False)
        assert time.monotonic() - t0 < 10
        # The survivor is stopped with it, and the engine keeps refusing, at once.
        wait_for(lambda: not any(_alive(p) for p in pids), 10, "every worker to exit")
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match="rank 1"):
            llm.generate([[9, 9]], SP, use_tqdm=False)
        assert time.monotonic() - t0 < 2
    finally:
        llm.shutdown()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _hang(worker: object, seconds: float) -> None:
    """Run on a worker: stop answering for a while (a stuck rank)."""
    time.sleep(seconds if getattr(worker, "rank", 0) == 1 else 0)


def test_hung_worker_times_out_and_every_worker_is_stopped(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(model=str(model), tensor_parallel_size=2, **KW)
    pids = llm.engine.executor.worker_pids
    try:
        monkeypatch.setenv("KVFERRY_TP_STEP_TIMEOUT_S", "1.5")
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"rank 1 .*did not answer.*within 1.5 s"):
            llm.engine.executor.collective_rpc(_hang, (60.0,))
        assert time.monotonic() - t0 < 8
        wait_for(lambda: not any(_alive(p) for p in pids), 10, "every worker to exit")
    finally:
        llm.shutdown()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_worker_config_error_reaches_the_caller_as_is(model: Path) -> None:
    # The KV budget is checked by each rank, after its weights are loaded.
    with pytest.raises(ConfigError, match="kv_cache_memory=.* gives 0 KV blocks"):
        LLM(model=str(model), tensor_parallel_size=2, kv_cache_memory="1KiB", **KW)


_HOLDER = """
import sys, time
from kvferry import LLM
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, tensor_parallel_size=2)
print(*llm.engine.executor.worker_pids, flush=True)
time.sleep(600)
"""


def test_workers_exit_when_the_engine_process_dies(model: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(model)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.kill()
        proc.wait(10)
        wait_for(lambda: not any(_alive(p) for p in pids), 10, "orphaned workers to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize(
    ("kwargs", "size", "message"),
    [
        ({}, 3, "tensor_parallel_size=3 does not divide the model's 4 attention heads"),
        ({"heads": 4, "kv_heads": 1}, 2, "does not divide the model's 1 KV heads"),
        ({}, 0, "tensor_parallel_size must be a positive integer, got 0"),
    ],
)
def test_bad_tensor_parallel_size_is_refused(
    tiny_model_factory: Callable[..., Path], kwargs: dict[str, int], size: int, message: str
) -> None:
    folder = tiny_model_factory("llama", **kwargs)
    with pytest.raises(ConfigError, match=message):
        LLM(model=str(folder), tensor_parallel_size=size, **KW)


def test_serve_with_tp2_answers_then_reports_a_dead_worker(model: Path, tmp_path: Path) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "kvferry", "serve", str(model), "--tensor-parallel-size", "3"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert refused.returncode != 0
    assert "does not divide the model's 4 attention heads" in refused.stderr + refused.stdout
    assert "Traceback" not in refused.stderr + refused.stdout

    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    workers: list[int] = []
    with serving("tp2", model, tmp_path, None, "--tensor-parallel-size", "2") as inst:
        r = httpx.post(inst.url + "/v1/completions", json=body, timeout=60, trust_env=False)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        workers = _children(inst.proc.pid)
        workers = [p for p in workers if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        t0 = time.monotonic()
        r = httpx.post(inst.url + "/v1/completions", json=body, timeout=30, trust_env=False)
        assert r.status_code >= 500, r.text
        assert time.monotonic() - t0 < 10
        health = httpx.get(inst.url + "/health", timeout=10, trust_env=False)
        assert health.status_code != 200
        log = inst.log.read_text()
        assert "tensor-parallel worker rank" in log and "SIGKILL" in log, log[-3000:]
        stop([inst])
    wait_for(lambda: not any(_alive(p) for p in workers), 10, "the server's workers to exit")
    print(json.dumps({"workers": workers}))
