"""The FaultInjectionConnector's plain pass-through members: every hook it does not inject
faults into goes to the wrapped connector unchanged, under vLLM 0.33's name (the base's
defaults fall back to kvferry's older names), and class-level hooks go to the wrapped
connector's class with its own config."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvferry.kv_transfer.base import (
    CacheHitSource,
    KVConnectorBase,
    KVConnectorHandshakeMetadata,
    KVConnectorPromMetrics,
    PromMetric,
    supports_hma,
)
from kvferry.kv_transfer.connectors.fault_injection.options import (
    FaultInjectionOptions,
    inner_config,
    with_kv_transfer_config,
)
from kvferry.kv_transfer.factory import KVConnectorFactory
from kvferry.kv_transfer.options import parse_options

if TYPE_CHECKING:
    from kvferry.config import KVTransferConfig
    from kvferry.kv_transfer.kv_cache_view import KVCacheManagerView
    from kvferry.request import Request

__all__ = ["ForwardToInner"]


class ForwardToInner:
    """Mixin of :class:`~.connector.FaultInjectionConnector`: ``self.inner`` answers."""

    inner: KVConnectorBase

    @classmethod
    def supports_hma_config(cls, kvt: KVTransferConfig) -> bool:
        child = inner_config(kvt, cls.__name__)
        return supports_hma(KVConnectorFactory.get_connector_class(child))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True

    @classmethod
    def _inner_class(cls, config: Any) -> tuple[type[KVConnectorBase], Any]:
        kvt = config.kv_transfer_config
        # Asked before the constructor: the same option errors first.
        parse_options(FaultInjectionOptions, kvt.kv_connector_extra_config, cls.__name__)
        child = inner_config(kvt, cls.__name__)
        return KVConnectorFactory.get_connector_class(child), with_kv_transfer_config(config, child)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        inner_cls, inner = cls._inner_class(vllm_config)
        return inner_cls.get_required_kvcache_layout(inner)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetric]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        inner_cls, inner = cls._inner_class(vllm_config)
        return inner_cls.build_prom_metrics(inner, metric_types, labelnames, per_engine_labelvalues)

    @property
    def requires_kv_delivery(self) -> bool:
        return self.inner.requires_kv_delivery

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.inner.supports_divergent_local_hybrid_hits

    def bind_gpu_block_pool(self, gpu_block_pool: KVCacheManagerView) -> None:
        self.inner.bind_gpu_block_pool(gpu_block_pool)

    def validate_kv_transfer_params(self, params: dict[str, Any]) -> None:
        self.inner.validate_kv_transfer_params(params)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self.inner.get_loaded_kv_cache_group_ids(request)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return self.inner.get_external_cache_hit_sources(request, num_external_tokens)

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        return self.inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self) -> Iterable[Any]:
        return self.inner.take_events()

    def has_pending_push_work(self) -> bool:
        return self.inner.has_pending_push_work()

    def has_pending_block_frees(self) -> bool:
        return self.inner.has_pending_block_frees()

    def get_finished_count(self) -> int | None:
        return self.inner.get_finished_count()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self.inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def reset_cache(self) -> bool | None:
        return self.inner.reset_cache()

    def get_kv_connector_kv_cache_events(self) -> Any | None:
        return self.inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.inner.get_handshake_metadata()

    def shutdown(self) -> None:
        self.inner.shutdown()
