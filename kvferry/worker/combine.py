"""What the executors do with their workers' replies, one worker or N ranks alike: the step's
output is rank 0's with every worker's KV-connector output aggregated (a request counts as
finished only once every worker reported it), and the connector handshakes merge by rank."""

from __future__ import annotations

from collections.abc import Iterable

from kvferry.kv_transfer.aggregator import KVOutputAggregator
from kvferry.kv_transfer.base import KVConnectorHandshakeMetadata
from kvferry.step_types.runner_output import ModelRunnerOutput


def combine(
    outputs: list[ModelRunnerOutput], aggregator: KVOutputAggregator | None
) -> ModelRunnerOutput:
    """One step's output from every worker's, in rank order: rank 0's, with the workers'
    KV-connector outputs aggregated when a connector is configured."""
    result = outputs[0]
    if aggregator is not None:
        result.kv_connector_output = aggregator.aggregate([o.kv_connector_output for o in outputs])
    return result


def merge_handshakes(
    per_worker: Iterable[dict[int, KVConnectorHandshakeMetadata] | None],
) -> dict[int, KVConnectorHandshakeMetadata]:
    """Every worker's connector handshake data, by rank (empty when none has any)."""
    merged: dict[int, KVConnectorHandshakeMetadata] = {}
    for handshakes in per_worker:
        merged.update(handshakes or {})
    return merged
