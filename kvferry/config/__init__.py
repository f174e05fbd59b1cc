"""Typed engine configuration. Every check on user-supplied settings lives in this package.

Each config raises :class:`ConfigError` with one clear sentence on bad input, so the CLI and
the offline API can show it without a traceback from deep inside the engine. The configs live
in one module per concept (``arch``, ``model``, ``engine``, ``kv_transfer``, ``kv_events``); import them from
here.
"""

from kvferry.config.arch import SUPPORTED_ARCHITECTURES, ArchConfig
from kvferry.config.engine import (
    PREFIX_CACHING_HASH_ALGOS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    check_scheduler_limits,
)
from kvferry.config.errors import ConfigError
from kvferry.config.kv_events import KV_EVENT_PUBLISHERS, KVEventsConfig
from kvferry.config.kv_transfer import (
    KV_LOAD_FAILURE_POLICIES,
    KV_ROLES,
    KVTransferConfig,
    check_kv_load_failure_policy,
)
from kvferry.config.model import ModelConfig, resolve_dtype

__all__ = [
    "KV_EVENT_PUBLISHERS",
    "PREFIX_CACHING_HASH_ALGOS",
    "KVEventsConfig",
    "KV_LOAD_FAILURE_POLICIES",
    "KV_ROLES",
    "SUPPORTED_ARCHITECTURES",
    "ArchConfig",
    "CacheConfig",
    "ConfigError",
    "DeviceConfig",
    "EngineConfig",
    "KVTransferConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "check_kv_load_failure_policy",
    "check_scheduler_limits",
    "resolve_dtype",
]
