"""Executor: runs the step's plan on the workers and returns one combined output.

kvferry runs one worker in-process today. The executor is still the single place where the
workers' KV-connector outputs are combined (``KVOutputAggregator``), so the scheduler sees a
request finished only once every worker reported it, whatever the worker count. It talks to
each ``Worker`` through its methods only, as it would to a worker in another process.
"""

from __future__ import annotations

from kvferry.config import EngineConfig
from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_transfer.aggregator import KVOutputAggregator
from kvferry.kv_transfer.base import KVConnectorHandshakeMetadata
from kvferry.step_types.runner_output import ModelRunnerOutput
from kvferry.step_types.scheduler_output import SchedulerOutput
from kvferry.worker.worker import Worker


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
        merged: dict[int, KVConnectorHandshakeMetadata] = {}
        for w in self.workers:
            merged.update(w.get_kv_connector_handshake_metadata() or {})
        return merged

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        outputs = [w.execute_model(scheduler_output) for w in self.workers]
        result = outputs[0]
        if self.aggregator is not None:
            result.kv_connector_output = self.aggregator.aggregate(
                [o.kv_connector_output for o in outputs]
            )
        return result

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
