"""Every KVFERRY_* environment variable the engine reads, typed, in one place."""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "1" if default else "")
    return value.strip().lower() in _TRUE


def _optional_flag(name: str) -> bool | None:
    """The variable read as a flag; None where it is unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    return None if not value else value in _TRUE


def log_level() -> str:
    """KVFERRY_LOG_LEVEL: logging level of the ``kvferry`` logger (default INFO)."""
    return os.environ.get("KVFERRY_LOG_LEVEL", "INFO").upper()


def log_stats_interval_s() -> float:
    """KVFERRY_LOG_STATS_INTERVAL: seconds between the engine's periodic stats lines."""
    return float(os.environ.get("KVFERRY_LOG_STATS_INTERVAL", "10"))


def trace_connector() -> bool:
    """KVFERRY_TRACE_CONNECTOR=1: record every KV-connector call (see ``kvferry trace``)."""
    return _flag("KVFERRY_TRACE_CONNECTOR")


def trace_connector_file() -> str:
    """KVFERRY_TRACE_FILE: where the connector trace is written (JSON lines)."""
    return os.environ.get("KVFERRY_TRACE_FILE", "kvferry-connector-trace.jsonl")


def trace_append() -> bool:
    """KVFERRY_TRACE_APPEND=1: add this run to the trace file (default: each run starts it anew)."""
    return _flag("KVFERRY_TRACE_APPEND")


def native_kernels() -> bool:
    """KVFERRY_NATIVE_KERNELS=0 turns off the C kernels of ``kvferry.native`` (default on)."""
    return _flag("KVFERRY_NATIVE_KERNELS", default=True)


def cpu_isa() -> str | None:
    """KVFERRY_CPU_ISA: cap the CPU level the engine's paths assume (``avx512``, ``avx2``,
    ``scalar``; default ``auto``), e.g. to run the AVX2 paths on an AVX-512 CPU."""
    return os.environ.get("KVFERRY_CPU_ISA") or None


def kernel_cache_dir() -> str | None:
    """KVFERRY_KERNEL_CACHE: where built kernels are kept (default ~/.cache/kvferry/kernels)."""
    return os.environ.get("KVFERRY_KERNEL_CACHE") or None


def kv_cache_layout() -> str | None:
    """KVFERRY_KV_CACHE_LAYOUT: the KV pool's layout, ``NHD`` or ``HND`` (vLLM's
    VLLM_KV_CACHE_LAYOUT; default: what the KV connector requires, else NHD)."""
    return os.environ.get("KVFERRY_KV_CACHE_LAYOUT") or None


def kv_pool_prefault() -> bool | None:
    """KVFERRY_KV_POOL_PREFAULT: ``1`` makes every CPU engine write its whole KV pool at
    start-up, ``0`` take pages as blocks are first used, whatever the engine's config says;
    unset (None): the config (``CacheConfig.kv_pool_prefault``) decides."""
    return _optional_flag("KVFERRY_KV_POOL_PREFAULT")


def kv_secret() -> str | None:
    """KVFERRY_KV_SECRET: the deployment secret itself (prefer KVFERRY_KV_SECRET_FILE)."""
    return os.environ.get("KVFERRY_KV_SECRET") or None


def kv_secret_file() -> str | None:
    """KVFERRY_KV_SECRET_FILE: a file holding the deployment secret (see kv_transfer.secret)."""
    return os.environ.get("KVFERRY_KV_SECRET_FILE") or None


def api_key() -> str | None:
    """KVFERRY_API_KEY: the API key of ``kvferry serve`` when neither flag gives one."""
    return os.environ.get("KVFERRY_API_KEY") or None


def malloc_tuning() -> bool:
    """KVFERRY_MALLOC_TUNING=0 keeps glibc's default malloc thresholds (see
    ``kvferry.worker.malloc_tuning``; default: fixed thresholds in the engine process)."""
    return _flag("KVFERRY_MALLOC_TUNING", default=True)


def tp_step_timeout_s() -> float:
    """KVFERRY_TP_STEP_TIMEOUT_S: how long a tensor-parallel engine waits for every worker's
    reply to one step before it declares the workers hung (default 300)."""
    return float(os.environ.get("KVFERRY_TP_STEP_TIMEOUT_S", "300"))


def tp_startup_timeout_s() -> float:
    """KVFERRY_TP_STARTUP_TIMEOUT_S: how long tensor-parallel workers may take to load the model
    and allocate their KV pools (default 600)."""
    return float(os.environ.get("KVFERRY_TP_STARTUP_TIMEOUT_S", "600"))
