"""``vllm.config``: ``VllmConfig`` (a view over kvferry's ``EngineConfig``), its parts, and
``KVTransferConfig`` / ``KVEventsConfig``."""

from kvferry.vllm_compat.config.kv_events import KVEventsConfig
from kvferry.vllm_compat.config.kv_transfer import KVTransferConfig
from kvferry.vllm_compat.config.vllm import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)

__all__ = [
    "CacheConfig",
    "DeviceConfig",
    "KVEventsConfig",
    "KVTransferConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "VllmConfig",
]
