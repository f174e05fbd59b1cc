"""``kvferry serve`` and ``vllm serve`` on one model folder with matched settings, one
server at a time, for the serving benchmark.

Both get the same OpenMP runtime (Intel OpenMP, plus tcmalloc where installed, preloaded
from vLLM's venv), the same thread count, the same KV pool and scheduler limits, and each
its own default for prefix caching (on in both). vLLM gets the CPU settings of
``benchmarks/setup_vllm_cpu.sh``: every core bound to its OpenMP pool, none reserved, KV
space from ``VLLM_CPU_KVCACHE_SPACE``, eager mode. Unlike the offline ``LLM``, ``vllm
serve`` always runs its engine core in a process of its own; ``mp=False`` keeps the model
in that engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: two processes), and
``mp=True`` is vLLM's default (a third, worker process).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.paths import REPO_ROOT
from benchmarks.harness.vllm_env import preload_libs, vllm_cpu_env
from kvferry.entrypoints.demo import Instance, stop, wait_healthy

BACKENDS = ("kvferry", "vllm")
LABELS = {"kvferry": "kvferry", "vllm": "vLLM CPU"}


@dataclass(frozen=True)
class ServerSettings:
    """What both servers are started with."""

    model_dir: Path
    dtype: str
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_gib: int = 1
    threads: int = os.cpu_count() or 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvferry_argv(s: ServerSettings, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvferry",
        "serve",
        str(s.model_dir),
        "--served-model-name=m",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--dtype={s.dtype}",
        f"--max-model-len={s.max_model_len}",
        f"--max-num-seqs={s.max_num_seqs}",
        f"--max-num-batched-tokens={s.max_num_batched_tokens}",
        f"--kv-cache-memory={s.kv_gib}GiB",
        "--seed=0",
        "--no-log-stats",
    ]


def vllm_argv(s: ServerSettings, port: int, vllm_python: str) -> list[str]:
    from benchmarks.harness.bench_serve import VLLM_CLI

    return [
        vllm_python,
        str(VLLM_CLI),
        "serve",
        str(s.model_dir),
        "--served-model-name=m",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--dtype={s.dtype}",
        f"--max-model-len={s.max_model_len}",
        f"--max-num-seqs={s.max_num_seqs}",
        f"--max-num-batched-tokens={s.max_num_batched_tokens}",
        "--enforce-eager",
        "--seed=0",
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
    ]


def server_env(backend: str, s: ServerSettings, vllm_python: str, mp: bool) -> dict[str, str]:
    """The server's environment: one OpenMP runtime and thread count for both backends,
    vLLM's CPU variables (its own venv, no repo on the path) or this repo on PYTHONPATH."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(s.threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        KVFERRY_LOG_STATS_INTERVAL="3600",
    )
    preload = preload_libs(vllm_python)
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    if backend == "vllm":
        env.pop("PYTHONPATH", None)
        env.update(vllm_cpu_env(s.threads, s.kv_gib, mp))
    else:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
        )
    return env


def client_env() -> dict[str, str]:
    """The load generator's environment (vLLM's venv, offline, no usage reports). The CPU
    platform is named: undetected, vLLM imports its default kernels, which the CPU wheel
    builds for AVX-512 with bf16 (an AVX2-only CPU dies of SIGILL)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


@dataclass
class Server:
    backend: str
    inst: Instance
    startup_s: float  # launch until /health answered 200

    @property
    def url(self) -> str:
        return self.inst.url


@contextmanager
def serving(
    backend: str,
    s: ServerSettings,
    logs: Path,
    vllm_python: str,
    mp: bool = False,
    timeout: float = 600.0,
) -> Iterator[Server]:
    """``backend``'s server on a free loopback port, healthy; stopped on exit. Its output
    goes to ``logs/<backend>.log`` (overwritten per launch)."""
    port = free_port()
    argv = kvferry_argv(s, port) if backend == "kvferry" else vllm_argv(s, port, vllm_python)
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{backend}.log"
    t0 = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=server_env(backend, s, vllm_python, mp),
            cwd=REPO_ROOT,
            start_new_session=True,  # its helpers (vLLM's engine core) go with it
        )
    inst = Instance(backend, proc, log, f"http://127.0.0.1:{port}")
    try:
        wait_healthy(inst.url, timeout=timeout, inst=inst)
        yield Server(backend, inst, time.perf_counter() - t0)
    finally:
        stop([inst], timeout=30.0)
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End what the server left behind in its session (its own pid is the group id)."""
    import contextlib
    import signal

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
