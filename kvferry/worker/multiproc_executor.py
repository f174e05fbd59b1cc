"""MultiprocExecutor: the executor of a tensor-parallel engine (``tensor_parallel_size`` N > 1).

It spawns N worker processes (:mod:`kvferry.worker.tp_worker_proc`), each holding one shard of
the weights and of the KV heads, and has the same interface as
:class:`~kvferry.worker.executor.UniProcExecutor`. The scheduler stays in the engine process;
each step's SchedulerOutput is pickled once and written to every worker's pipe (a private OS
pipe between the engine and the processes it spawned; nothing is read from the network), and
every rank's reply is read back: rank 0's ModelRunnerOutput is the step's, and the ranks'
KV-connector outputs are combined by :class:`KVOutputAggregator` (a request counts finished
once every rank reported it).

Failure is never silent and never hangs: a worker that exits (killed, crashed) is seen through
its process sentinel or its pipe's EOF, a worker that raises is reported with its error, and a
step whose replies do not all arrive within ``KVFERRY_TP_STEP_TIMEOUT_S`` is declared hung. Each
raises :class:`WorkerFailedError` naming the rank (and exit code), after which the executor is
broken: the other workers are stopped, and every later call raises the same error. Workers
also exit on their own when the engine process dies.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from kvferry import envs
from kvferry.config import ConfigError, EngineConfig
from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_transfer.aggregator import KVOutputAggregator
from kvferry.kv_transfer.base import KVConnectorHandshakeMetadata
from kvferry.logger import fmt_fields, init_logger
from kvferry.step_types.runner_output import ModelRunnerOutput
from kvferry.step_types.scheduler_output import SchedulerOutput
from kvferry.worker.combine import combine, merge_handshakes
from kvferry.worker.tp_worker_proc import ReadyInfo, WorkerProcArgs, worker_main

logger = init_logger(__name__)

_STOP_GRACE_S = 5.0
_RENDEZVOUS_TIMEOUT = timedelta(seconds=600)


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died, failed or hung; the engine cannot go on."""


def _rendezvous_store() -> Any:
    """The ``torch.distributed`` store the ranks meet at, served from the engine process on a
    port the OS picks as it binds. (A port found free here and bound later by rank 0, after
    its start-up, could be taken in between: the rank then failed with EADDRINUSE.)"""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_RENDEZVOUS_TIMEOUT
    )


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


class MultiprocExecutor:
    def __init__(
        self,
        config: EngineConfig,
        worker_factory: Callable[[EngineConfig, int], Any] | None = None,
    ) -> None:
        self.world_size = n = config.parallel_config.tensor_parallel_size
        self._error: WorkerFailedError | None = None
        ctx = mp.get_context("spawn")
        # Held until the workers are stopped: gloo's groups keep using it after start-up.
        self._store: Any = _rendezvous_store()
        port = int(self._store.port)
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        try:
            for rank in range(n):
                parent_end, child_end = ctx.Pipe(duplex=True)
                args = WorkerProcArgs(config, rank, n, port, os.getpid(), worker_factory)
                proc = ctx.Process(
                    target=worker_main,
                    args=(args, child_end),
                    name=f"kvferry-tp-rank{rank}",
                    daemon=True,  # also stopped by multiprocessing's exit handler
                )
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
            infos = self._collect("start-up", envs.tp_startup_timeout_s(), ready=True)
        except BaseException:
            self._stop_all()
            raise
        self._infos: list[ReadyInfo] = infos
        self.kv_cache_config: KVCacheConfig = infos[0].kv_cache_config
        for rank, info in enumerate(infos):
            if info.kv_cache_config != self.kv_cache_config:
                self._stop_all()
                raise RuntimeError(
                    f"tensor-parallel rank {rank} allocated {info.kv_cache_config}, rank 0 "
                    f"{self.kv_cache_config}; every rank must hold the same pool"
                )
        self.aggregator: KVOutputAggregator | None = None
        if config.kv_transfer_config is not None:
            self.aggregator = KVOutputAggregator(infos[0].finished_count or n)
        logger.info(
            fmt_fields(
                "tensor-parallel workers ready",
                world_size=n,
                pids=",".join(str(i.pid) for i in infos),
                kv_heads_per_rank=self.kv_cache_config.groups[0].num_kv_heads,
            )
        )

    @property
    def worker_pids(self) -> list[int]:
        return [info.pid for info in self._infos]

    # -- the executor interface -------------------------------------------------------------

    def get_kv_connector_handshake_metadata(self) -> dict[int, KVConnectorHandshakeMetadata]:
        """Every rank's connector handshake data, by rank (empty when none has any)."""
        return merge_handshakes(info.handshake for info in self._infos)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        outputs: list[ModelRunnerOutput] = self._broadcast(("step", scheduler_output), "step")
        return combine(outputs, self.aggregator)

    def collective_rpc(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[Any]:
        """``fn(worker, *args)`` on every rank (``fn`` must be picklable by reference, i.e. a
        module-level function); the results in rank order."""
        return self._broadcast(("call", (fn, args)), getattr(fn, "__name__", "call"))

    def shutdown(self) -> None:
        if self._error is None:
            with contextlib.suppress(WorkerFailedError):  # already reported and stopped
                self._broadcast(("shutdown", None), "shutdown", timeout=_STOP_GRACE_S)
        self._stop_all()

    # -- the pipe protocol ------------------------------------------------------------------

    def _broadcast(self, message: tuple[str, Any], what: str, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(rank, f"could not be sent the {what} message")
        return self._collect(what, envs.tp_step_timeout_s() if timeout is None else timeout)

    def _collect(self, what: str, timeout: float, ready: bool = False) -> list[Any]:
        """One reply from every rank, in rank order; raises WorkerFailedError (stopping every
        worker) for a rank that dies, fails or does not answer within ``timeout`` seconds."""
        replies: dict[int, Any] = {}
        by_conn = {id(c): r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        deadline = time.monotonic() + timeout
        while len(replies) < len(self._conns):
            waiting = [c for r, c in enumerate(self._conns) if r not in replies]
            sentinels = [p.sentinel for r, p in enumerate(self._procs) if r not in replies]
            left = deadline - time.monotonic()
            ready_objs = wait(waiting + sentinels, timeout=max(0.0, left)) if left > 0 else []
            if not ready_objs:
                missing = sorted(set(range(len(self._conns))) - set(replies))
                self._fail(missing[0], f"did not answer the {what} within {timeout:g} s", hung=True)
            for obj in ready_objs:
                if isinstance(obj, int):
                    rank = by_sentinel[obj]
                    if rank not in replies and not self._conns[rank].poll():
                        self._fail(rank, f"died during the {what}")
                    continue
                rank = by_conn[id(obj)]
                try:
                    reply = pickle.loads(obj.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self._fail(rank, f"died during the {what}")
                if reply[0] == "error":
                    if ready and reply[2] == "ConfigError":
                        self._stop_all()
                        raise ConfigError(reply[1].split("\n", 1)[0].removeprefix("ConfigError: "))
                    self._fail(rank, f"failed the {what}: {reply[1]}")
                replies[rank] = reply[1]
        return [replies[r] for r in range(len(self._conns))]

    def _fail(self, rank: int, why: str, hung: bool = False) -> None:
        proc = self._procs[rank]
        if not hung:
            proc.join(1.0)  # let a dying process finish so its exit code is known
        detail = "" if hung else f" ({_exit_text(proc.exitcode)})"
        error = WorkerFailedError(
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) {why}{detail}; "
            f"the engine's workers are stopped"
        )
        logger.error(str(error))
        self._error = error
        self._stop_all()
        raise error

    def _stop_all(self) -> None:
        """Stop every worker still running (a worker blocked in a collective on a dead peer
        never returns on its own), then close the pipes."""
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()) if self._error is None else 0.0)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._store = None  # the rendezvous store's server goes with it
        self._procs = []
