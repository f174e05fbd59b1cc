"""The plain data of one engine step, shared by the scheduler side and the worker side.

``core`` (the scheduler), ``worker`` (the model runner) and ``kv_transfer`` (the connectors) all
read and write these types, so they live below all three and import none of them:

* :mod:`.scheduler_output`: ``SchedulerOutput``, the plan the scheduler hands to the workers;
* :mod:`.runner_output`: ``ModelRunnerOutput``, what the workers hand back;
* :mod:`.kv_connector_output`: ``KVConnectorOutput``, the connector part of the workers' answer;
* :mod:`.kv_connector_metadata`: the base classes of the connector payloads that ride on them.
"""

from kvferry.step_types.kv_connector_metadata import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from kvferry.step_types.runner_output import ModelRunnerOutput, TokenLogprobs
from kvferry.step_types.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)

__all__ = [
    "CachedRequestData",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorWorkerMetadata",
    "ModelRunnerOutput",
    "NewRequestData",
    "SchedulerOutput",
    "TokenLogprobs",
]
