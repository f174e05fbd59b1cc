"""MooncakeStoreConnector: engines share prompt KV through a Mooncake Store.

Every engine configured with the same Mooncake master (``MOONCAKE_CONFIG_PATH`` or
``MOONCAKE_MASTER``, as vLLM and LMCache read them; ``kv_connector_extra_config`` may
override) and the same model and KV layout reads the prompt chunks any of them stored: a
prefix computed on one instance is an external hit on every other. Options:
:class:`~kvferry.kv_transfer.connectors.mooncake_store.options.MooncakeStoreOptions`.

A store that is down or slow never fails a request: lookups that do not answer in time are
misses, loads that fail are reported as load errors (``kv_load_failure_policy`` applies:
use ``recompute``), stores are skipped, and the connector keeps reconnecting in the
background. Values carry a checked header; a corrupt or short value is a miss (and removed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import CacheHitSource, KVConnectorRole
from kvferry.kv_transfer.connectors.mooncake_store.layout import resolve_layout
from kvferry.kv_transfer.connectors.mooncake_store.options import MooncakeStoreOptions
from kvferry.kv_transfer.connectors.mooncake_store.scheduler import MooncakeStoreScheduler
from kvferry.kv_transfer.connectors.mooncake_store.worker import MooncakeStoreWorker
from kvferry.kv_transfer.connectors.split import SplitConnector
from kvferry.kv_transfer.options import parse_options
from kvferry.kv_transfer.stores.mooncake_client import mooncake_available
from kvferry.kv_transfer.stores.mooncake_config import load_mooncake_config
from kvferry.model.parallel import tp_rank

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig

NAME = "MooncakeStoreConnector"


class MooncakeStoreConnector(SplitConnector[MooncakeStoreScheduler, MooncakeStoreWorker]):
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError(f"{NAME} needs the KV cache config")
        cache = getattr(config, "cache_config", None)
        if not bool(getattr(cache, "enable_prefix_caching", True)):
            raise ConfigError(
                f"{NAME} keys stored KV by prefix-cache block hashes and needs prefix caching; "
                "enable it (enable_prefix_caching=True) or drop the connector"
            )
        why = mooncake_available()
        if why is not None:
            raise ConfigError(f"{NAME}: {why}")
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.opts = parse_options(MooncakeStoreOptions, extra, NAME)
        self.mc_config = load_mooncake_config(self.opts.mooncake_overrides())
        self.layout = resolve_layout(config, kv_cache_config, self.opts)
        if role == KVConnectorRole.SCHEDULER:
            events = getattr(config, "kv_events_config", None)
            self.set_scheduler_half(
                MooncakeStoreScheduler(
                    self.opts,
                    self.mc_config,
                    self.layout,
                    bool(events is not None and events.publishes),
                )  # fmt: skip
            )
        else:
            self.set_worker_half(
                MooncakeStoreWorker(
                    self.opts, self.mc_config, self.layout, kv_cache_config, rank=tp_rank()
                )
            )

    def check_store_integrity(self, idle: bool = False) -> None:
        """Leak check of the scheduler half (tests)."""
        self._scheduler_side("check_store_integrity").check_integrity(idle)
