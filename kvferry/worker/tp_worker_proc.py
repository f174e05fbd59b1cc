"""The body of one tensor-parallel worker process (rank r of N), spawned by
:class:`~kvferry.worker.multiproc_executor.MultiprocExecutor`.

The process joins the ``torch.distributed`` group (gloo on CPU, NCCL on CUDA) through the
rendezvous store the engine process serves at ``127.0.0.1:port``, records its rank for the
sharded layers, builds its :class:`Worker` (its shard of the weights, its KV heads, its
connector) and then serves the engine over its end of a pipe, one message at a time:

* engine -> worker: ``pickle((kind, payload))`` with kind ``"step"`` (a SchedulerOutput),
  ``"call"`` (``(fn, args)``: ``fn(worker, *args)``, for tests and tools) or ``"shutdown"``.
* worker -> engine: ``("ready", ReadyInfo)`` once, then ``("ok", result)`` or
  ``("error", text)`` per message. Rank 0 returns the whole ModelRunnerOutput of a step; the
  others only their KV-connector output (every rank samples the same tokens, so only one copy
  needs to travel).

The process exits when the pipe closes (the engine closed it or died) or when its parent
process is gone (a watch thread polls the parent pid), so no worker outlives its engine.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from kvferry.config import EngineConfig
from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_transfer.base import KVConnectorHandshakeMetadata

_PARENT_POLL_S = 0.5
# Joining the group and each collective after it.
_GROUP_TIMEOUT = timedelta(seconds=600)


@dataclass(frozen=True)
class WorkerProcArgs:
    config: EngineConfig
    rank: int
    world_size: int
    port: int
    parent_pid: int
    # Builds the rank's worker (default: kvferry.worker.worker.Worker); must be picklable by
    # reference. Benchmarks pass a stand-in to time the engine/worker boundary alone.
    worker_factory: Callable[[EngineConfig, int], Any] | None = None


@dataclass(frozen=True)
class ReadyInfo:
    kv_cache_config: KVCacheConfig
    handshake: dict[int, KVConnectorHandshakeMetadata] | None
    # The worker connector's get_finished_count() (None without a connector or an answer).
    finished_count: int | None
    pid: int


def _watch_parent(parent_pid: int) -> None:
    """Exit at once when the engine process is gone (the ranks may be blocked in a collective,
    where no pipe EOF would reach them)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(_PARENT_POLL_S)


def _cpu_threads(world_size: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def worker_main(args: WorkerProcArgs, conn: Connection) -> None:
    # The engine decides when a worker stops; a Ctrl-C sent to the whole process group must
    # not kill the ranks under it mid-step (the engine shuts them down on its own signal).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_watch_parent, args=(args.parent_pid,), name="kvferry-parent-watch", daemon=True
    ).start()
    import torch
    import torch.distributed as dist

    from kvferry.model.parallel import init_tensor_parallel
    from kvferry.step_types.runner_output import ModelRunnerOutput
    from kvferry.worker.worker import Worker

    cuda = args.config.device_config.torch_device.type == "cuda"
    torch.set_num_threads(_cpu_threads(args.world_size))
    if cuda:
        torch.cuda.set_device(args.rank)
    try:
        # The engine process serves the rendezvous store on args.port.
        store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=_GROUP_TIMEOUT)
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            store=store,
            rank=args.rank,
            world_size=args.world_size,
            timeout=_GROUP_TIMEOUT,
        )
        init_tensor_parallel(args.rank, args.world_size)
        worker = (args.worker_factory or Worker)(args.config, args.rank)
        connector = worker.kv_connector
        info = ReadyInfo(
            kv_cache_config=worker.kv_cache_config,
            handshake=worker.get_kv_connector_handshake_metadata(),
            finished_count=None if connector is None else connector.get_finished_count(),
            pid=os.getpid(),
        )
    except BaseException as e:
        _send(conn, ("error", _describe(e), type(e).__name__))
        return
    _send(conn, ("ready", info))
    try:
        _serve(conn, worker, args.rank, ModelRunnerOutput)
    finally:
        try:
            worker.shutdown()
        finally:
            dist.destroy_process_group()


def _serve(conn: Connection, worker: Any, rank: int, runner_output: type) -> None:
    while True:
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the engine closed the pipe or died
        try:
            if kind == "step":
                out = worker.execute_model(payload)
                if rank != 0:
                    out = runner_output(kv_connector_output=out.kv_connector_output)
                result: Any = out
            elif kind == "call":
                fn, fn_args = payload
                result = fn(worker, *fn_args)
            elif kind == "shutdown":
                _send(conn, ("ok", None))
                return
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        except Exception as e:
            _send(conn, ("error", _describe(e), type(e).__name__))
            continue
        _send(conn, ("ok", result))


def _send(conn: Connection, message: tuple[Any, ...]) -> None:
    try:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    except (BrokenPipeError, EOFError, OSError):
        os._exit(4)  # the engine is gone


def _describe(e: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-3))
    return f"{type(e).__name__}: {e}\n{tb}"
