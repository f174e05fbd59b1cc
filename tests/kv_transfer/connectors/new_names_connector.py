"""A vLLM-style connector (vLLM import paths) that overrides only vLLM 0.33's hook names, and
records every call in ``CALLS`` as ``(name, hook, arg)``; for the wrapping-connector tests.

Options (``kv_connector_extra_config``): ``name`` (in the log), ``hit`` (tokens offered from
position 0, sync), ``source`` (a ``CacheHitSource`` value), ``pending`` (push work queued),
``delivery`` (``requires_kv_delivery``), ``results`` (``{"sending": [...], "recving": [...],
"failed": [...]}`` reported by the next ``get_transfer_results``)."""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

CALLS: list[tuple[str, str, Any]] = []
OBSERVED: list[dict[str, Any]] = []


class NewNamesStats(KVConnectorStats):
    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        # Its own rule (max, not sum), to tell it from the plain one.
        for k, v in other.data.items():
            self.data[k] = max(self.data.get(k, v), v)
        return self


class NewNamesProm(KVConnectorPromMetrics):
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        OBSERVED.append(dict(transfer_stats_data))


class NewNamesConnector(KVConnectorBase_V1):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self._vllm_config.kv_transfer_config.kv_connector_extra_config
        self.name: str = extra.get("name", "x")
        self.hit: int = extra.get("hit", 0)
        self.source = CacheHitSource(extra.get("source", "host"))
        self.pending: bool = extra.get("pending", False)
        self.delivery: bool = extra.get("delivery", False)
        self.results: dict[str, list[str]] = extra.get("results", {})

    def _log(self, hook: str, arg: Any = None) -> None:
        CALLS.append((self.name, hook, arg))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return "NHD"

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # type: ignore[no-untyped-def]
        return NewNamesProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return NewNamesStats(data=dict(data or {}))

    @property
    def requires_kv_delivery(self) -> bool:
        return self.delivery

    # scheduler side
    def on_new_request(self, request: Any) -> None:
        self._log("on_new_request", request.request_id)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return max(0, self.hit - num_computed_tokens), False

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        self._log("get_loaded_kv_cache_group_ids", request.request_id)
        return (0,)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._log("update_state_after_alloc", num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        self._log("get_external_cache_hit_sources", num_external_tokens)
        return {self.source: num_external_tokens}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def has_pending_push_work(self) -> bool:
        return self.pending

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._log("bind_gpu_block_pool")

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict) -> None:
        self._log("set_xfer_handshake_metadata_pp_aware", sorted(metadata))

    def register_finished_partial_tail(self, request: Any, block_ids: Any, tails: Any) -> bool:
        self._log("register_finished_partial_tail")
        return self.name == "b"

    # worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._log("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def finish_forward(self) -> None:
        self._log("finish_forward")

    def wait_for_save(self) -> None:
        self._log("wait_for_save")

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._log("get_transfer_results")
        r, self.results = self.results, {}
        return KVConnectorTransferResults(
            finished_sending=set(r.get("sending", ())),
            finished_recving=set(r.get("recving", ())),
            failed_recving=set(r.get("failed", ())),
        )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return NewNamesStats(data={"calls": 1})
