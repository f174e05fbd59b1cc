"""The KV-connector protocol: one class, two roles, and the data that passes between them.

A connector class is instantiated twice: once inside the scheduler (``role=SCHEDULER``) and
once per worker (``role=WORKER``). The scheduler side plans: it answers cache lookups, learns
which engine blocks were allocated for loads, and packs each step's plan into a
``KVConnectorMetadata``. The worker side moves bytes: it binds that metadata, loads and saves
KV around the forward pass and the attention layers, and reports completions, failures, stats
and ``KVConnectorWorkerMetadata`` back through ``KVConnectorOutput``. Nothing else travels
between the two, and both payloads must be plain data (no pickle across processes).

The members match vLLM 0.33's ``KVConnectorBase_V1`` (0.20.2's names kept as aliases:
``has_pending_work`` = ``has_pending_push_work``, ``get_finished`` behind
``get_transfer_results``). Contracts live on the members: worker side in
:mod:`.worker_side`, scheduler side in :mod:`.scheduler_side`, constructor and class-level
hooks in :mod:`.connector`, stats in :mod:`.stats` and :mod:`.prom`.

At start the factory asks ``get_required_kvcache_layout``; then the engine calls
``register_kv_caches`` -> ``set_host_xfer_buffer_ops`` -> ``get_handshake_metadata`` on
every worker, ``bind_kv_cache_manager`` (-> ``bind_gpu_block_pool``) and
``set_xfer_handshake_metadata_pp_aware`` (-> ``set_xfer_handshake_metadata``) on the
scheduler side. Each request: ``on_new_request`` when it arrives. Per step, in this order::

    scheduler: get_num_new_matched_tokens -> (get_loaded_kv_cache_group_ids if > 0)
               -> (allocate_slots) -> update_state_after_alloc
               -> (get_external_cache_hit_sources if > 0) -> build_connector_meta
                                                             (every step, empty ones too)
    worker:    handle_preemptions -> bind_connector_metadata -> start_load_kv
               -> forward: per attention layer wait_for_layer_load / save_kv_layer
               -> finish_forward -> wait_for_save -> get_transfer_results (default:
               get_finished, get_failed_recving) -> get_block_ids_with_load_errors
               -> get_kv_connector_stats -> get_kv_connector_kv_cache_events
               -> build_connector_worker_meta -> clear_connector_metadata
    scheduler: update_connector_output -> (finished_recving / finished_sending handled)
               -> request_finished for requests that ended; has_pending_push_work while idle

A step with no tokens to compute runs the same worker sequence without the forward.

When a hook raises: an exception from a per-request scheduler hook
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``request_finished``), or a
lookup answer outside its contract, ends only that request (finish reason ``error``, the
message in its output; its blocks freed, none of them left in the prefix cache); the step's
other requests go on. An exception from a step-wide hook (``build_connector_meta`` and every
worker-side hook) fails that step's requests as an engine fault, and three failing steps in a
row without output mark the engine dead. Report failed loads through
``get_block_ids_with_load_errors`` / ``get_transfer_results`` instead of raising.
"""

from __future__ import annotations

from kvferry.kv_transfer.base.common import (
    KV_CACHE_LAYOUT,
    CacheHitSource,
    CopyBlocksOp,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from kvferry.kv_transfer.base.connector import (
    KVConnectorBase,
    KVConnectorBase_V1,
    SupportsHMA,
    supports_hma,
)
from kvferry.kv_transfer.base.prom import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
    create_metric_per_engine,
)
from kvferry.kv_transfer.base.stats import KVConnectorStats, KVConnectorStatsTotals
from kvferry.kv_transfer.kv_cache_view import (
    KVCacheBlocksView,
    KVCacheBlockView,
    KVCacheManagerView,
)
from kvferry.step_types.kv_connector_metadata import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = [
    "KV_CACHE_LAYOUT",
    "CacheHitSource",
    "CopyBlocksOp",
    "KVCacheBlockView",
    "KVCacheBlocksView",
    "KVCacheManagerView",
    "KVConnectorBase",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorStatsTotals",
    "KVConnectorTransferResults",
    "KVConnectorWorkerMetadata",
    "PromMetric",
    "PromMetricT",
    "SupportsHMA",
    "create_metric_per_engine",
    "supports_hma",
]
