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


def single_worker_strategy(api: LMCacheAPI) -> Any:
    """LMCache's ParallelStrategy for kvferry's one worker per engine (no TP/PP yet)."""
    return api.ParallelStrategy(
        mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1
    )
