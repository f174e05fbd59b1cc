"""LMCacheMPConnector: kvferry engines share prompt KV through a running LMCache
multi-process server, reusing its index, storage tiers and eviction.

The connector is a thin adapter onto LMCache's own engine-side adapters
(``lmcache.integration.vllm.vllm_multi_process_adapter``): the scheduler half
(:mod:`.scheduler`) asks the server which prompt chunks it holds and plans retrieves and
stores, the worker half (:mod:`.worker`) registers the KV caches and moves the bytes.
Options are LMCache's ``lmcache.mp.*`` keys (:mod:`.options`). LMCache is optional
(``pip install --no-deps lmcache==0.5.6 && pip install 'kvferry[lmcache]'``); without it
building the connector raises a ConfigError naming that step.

KV is keyed by the model name LMCache sees: kvferry passes the model path with a
fingerprint of the weights, dtype and KV layout, so engines share KV exactly when they
compute the same KV (two models, or one model in two dtypes, never read each other's).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import KVConnectorMetadata, KVConnectorRole
from kvferry.kv_transfer.connectors.lmcache_mp.metadata import LMCacheMPConnectorMetadata
from kvferry.kv_transfer.connectors.lmcache_mp.options import parse_lmcache_options
from kvferry.kv_transfer.connectors.lmcache_mp.scheduler import LMCacheMPScheduler
from kvferry.kv_transfer.connectors.lmcache_mp.worker import KV_LAYOUT, LMCacheMPWorker
from kvferry.kv_transfer.connectors.split import SplitConnector
from kvferry.model.fingerprint import weights_fingerprint
from kvferry.model.parallel import tp_rank

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig


def lmcache_model_name(config: EngineConfig, kv_cache_config: KVCacheConfig) -> str:
    """The model name LMCache keys this engine's KV by: the model plus a digest of what
    determines the KV bytes (weights, dtype, heads, head size, layers, layout)."""
    model = str(config.model_config.model)
    group = kv_cache_config.groups[0]
    facts = "|".join(
        str(x)
        for x in (
            weights_fingerprint(model),
            group.dtype,
            group.num_kv_heads,
            group.head_dim,
            len(kv_cache_config.layer_names),
            KV_LAYOUT,
            "kvferry-lmcache-v1",
        )
    )
    return f"{model}#kvferry-{hashlib.sha256(facts.encode()).hexdigest()[:16]}"


class LMCacheMPConnector(SplitConnector[LMCacheMPScheduler, LMCacheMPWorker]):
    """See the module docstring. Needs one KV cache group and a server chunk size that is a
    multiple of the block size."""

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        name = type(self).__name__
        opts = parse_lmcache_options(self._kv_transfer_config.kv_connector_extra_config, name)
        if len(kv_cache_config.groups) != 1:
            raise ConfigError(f"{name} supports one KV cache group")
        model_name = lmcache_model_name(config, kv_cache_config)
        block_size = kv_cache_config.block_size
        # Under TP every rank registers as its own LMCache worker (its KV heads are one piece
        # of each chunk); the scheduler half looks chunks up for all of them.
        tp = config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            self.set_scheduler_half(LMCacheMPScheduler(opts, model_name, block_size, name, tp))
        else:
            half = LMCacheMPWorker(opts, model_name, block_size, name, tp, tp_rank())
            self.set_worker_half(half)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, LMCacheMPConnectorMetadata):
            raise TypeError(f"{type(self).__name__} got {type(metadata).__name__} as metadata")
        super().bind_connector_metadata(metadata)

    def num_tracked_requests(self) -> int:
        """Scheduler role: requests still tracked (0 once the engine is idle)."""
        return self._scheduler_side("num_tracked_requests").num_tracked_requests()
