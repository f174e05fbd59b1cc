"""Executor: runs the step's plan on the workers and returns one combined output.

:func:`create_executor` picks :class:`UniProcExecutor` (one worker, in-process) for
``tensor_parallel_size`` 1 and :class:`~kvferry.worker.multiproc_executor.MultiprocExecutor`
(one process per rank) above. The executor is still the single place where the
workers' KV-connector outputs are combined (``KVOutputAggregator``), so the scheduler sees a
request finished only once every worker reported it, whatever the worker count. It talks to
each ``Worker`` through its methods only, as it would to a worker in another process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvferry.config import EngineConfig
from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_transfer.aggregator import KVOutputAggregator
from kvferry.kv_transfer.base import KVConnectorHandshakeMetadata
from kvferry.step_types.runner_output import ModelRunnerOutput
from kvferry.step_types.scheduler_output import SchedulerOutput
from kvferry.worker.combine import combine, merge_handshakes
from kvferry.worker.worker import Worker

if TYPE_CHECKING:
    from kvferry.worker.multiproc_executor import MultiprocExecutor


def create_executor(config: EngineConfig) -> UniProcExecutor | MultiprocExecutor:
    if config.parallel_config.tensor_parallel_size > 1:
        from kvferry.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    return UniProcExecutor(config)


class UniProcExecutor:
    world_size = 1

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.workers = [self.worker]
        self.aggregator: KVOutputAggregator | None = None
        connector = self.worker.kv_connector
        if connector is not None:
            expected = connector.get_finished_count() or self.world_size
            self.aggregator = KVOutputAggregator(expected)

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        return self.worker.kv_cache_config

    def get_kv_connector_handshake_metadata(self) -> dict[int, KVConnectorHandshakeMetadata]:
        """Every worker's connector handshake data, by rank (empty when none has any)."""
        return merge_handshakes(w.get_kv_connector_handshake_metadata() for w in self.workers)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return combine([w.execute_model(scheduler_output) for w in self.workers], self.aggregator)

    def collective_rpc(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[Any]:
        """``fn(worker, *args)`` on every worker; the results in rank order."""
        return [fn(w, *args) for w in self.workers]

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
