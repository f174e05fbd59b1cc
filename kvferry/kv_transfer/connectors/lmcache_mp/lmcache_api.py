"""The few LMCache names this connector uses, imported on first use.

LMCache is an optional dependency: kvferry imports without it, and only building an
``LMCacheMPConnector`` needs it. Its absence (or a broken install) becomes one
:class:`~kvferry.config.ConfigError` naming the install step, never an import traceback.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from kvferry.config import ConfigError

INSTALL_HINT = (
    "LMCacheMPConnector needs LMCache: pip install --no-deps lmcache==0.5.6 "
    "&& pip install 'kvferry[lmcache]'"
)


@dataclass(frozen=True)
class LMCacheAPI:
    """LMCache's engine-side adapters and the types they take (see
    ``lmcache.integration.vllm.vllm_multi_process_adapter``)."""

    SchedulerAdapter: Any
    WorkerAdapter: Any
    ParallelStrategy: Any
    LoadStoreOp: Any
    # The engine-driven transport that unpickles what the server sends (no --shm-name).
    PickleContext: Any
    zmq_context: Any


@functools.lru_cache(maxsize=1)
def lmcache_api() -> LMCacheAPI:
    """Import LMCache's adapters (once per process); ConfigError when LMCache is missing."""
    try:
        import zmq
        from lmcache.integration.vllm.vllm_multi_process_adapter import (
            LMCacheMPSchedulerAdapter,
            LMCacheMPWorkerAdapter,
            LoadStoreOp,
            ParallelStrategy,
        )
        from lmcache.v1.multiprocess.transfer_context.pickle import EngineDrivenContextPickle
    except ImportError as e:
        raise ConfigError(f"{INSTALL_HINT} (import failed: {e})") from None
    return LMCacheAPI(
        SchedulerAdapter=LMCacheMPSchedulerAdapter,
        WorkerAdapter=LMCacheMPWorkerAdapter,
        ParallelStrategy=ParallelStrategy,
        LoadStoreOp=LoadStoreOp,
        PickleContext=EngineDrivenContextPickle,
        # One ZMQ context per process, shared by the scheduler and worker adapters.
        zmq_context=zmq.Context.instance(),
    )


def parallel_strategy(api: LMCacheAPI, tp_size: int, worker_id: int) -> Any:
    """LMCache's ParallelStrategy for worker ``worker_id`` (the tensor-parallel rank) of an
    engine with ``tp_size`` workers and one server; the scheduler half passes 0, as vLLM's
    scheduler does. LMCache then stores a chunk as ``tp_size`` pieces, one per rank's KV
    heads, keyed by the worker id, and a lookup hits a chunk only when every piece is there.
    No pipeline parallelism; kvferry's attention is not MLA (each rank holds its own heads)."""
    return api.ParallelStrategy(
        mla_only=False,
        vllm_world_size=tp_size,
        vllm_worker_id=worker_id,
        tp_size=tp_size,
        pp_size=1,
        n_servers=1,
    )
