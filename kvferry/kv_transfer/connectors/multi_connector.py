"""MultiConnector: several connectors behind one. The first child with a hit loads a request;
every child saves.

Extra config: ``connectors``: a list of KV transfer configs, one per child (their
``engine_id`` defaults to the parent's). When several children ask to keep a finished
request's blocks, the request is reported finished_sending once, after the last of them.

Every hook reaches the children under vLLM 0.33's name, so a child that overrides only the
new names (or only kvferry's older ones) is reached either way. Per-request answers about a
load (``get_loaded_kv_cache_group_ids``, ``get_external_cache_hit_sources``) come from the
child serving it; ``on_new_request``, ``finish_forward`` and the handshake go to all;
``has_pending_push_work``, ``has_pending_block_frees``, ``requires_kv_delivery`` and
``register_finished_partial_tail`` are any-of; transfer results are merged. Stats and
Prometheus metrics are kept per child, by the child's class (:mod:`.multi_stats`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import (
    CacheHitSource,
    CopyBlocksOp,
    KVConnectorBase,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from kvferry.kv_transfer.connectors.multi_config import MultiClassHooks, child_configs
from kvferry.kv_transfer.connectors.multi_stats import (
    MultiKVConnectorStats,
)
from kvferry.kv_transfer.factory import KVConnectorFactory

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView, KVCacheManagerView
    from kvferry.model.forward_context import ForwardContext
    from kvferry.request import Request
    from kvferry.step_types.kv_connector_output import KVConnectorOutput
    from kvferry.step_types.scheduler_output import SchedulerOutput


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    metadata: tuple[KVConnectorMetadata, ...]
    # req_id -> how many finished_sending reports to swallow before the last one.
    extra_async_saves: dict[str, int] = field(default_factory=dict)


@dataclass
class MultiKVConnectorWorkerMetadata(KVConnectorWorkerMetadata):
    metadata: tuple[KVConnectorWorkerMetadata | None, ...]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, MultiKVConnectorWorkerMetadata)
        merged = []
        for mine, theirs in zip(self.metadata, other.metadata, strict=True):
            if mine is None or theirs is None:
                merged.append(mine if theirs is None else theirs)
            else:
                merged.append(mine.aggregate(theirs))
        return MultiKVConnectorWorkerMetadata(tuple(merged))


class MultiConnector(MultiClassHooks, KVConnectorBase, SupportsHMA):
    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self.children: list[KVConnectorBase] = [
            KVConnectorFactory.create_connector(c, role, kv_cache_config)
            for c in child_configs(config)
        ]
        self._names = [f"{i}.{type(c).__name__}" for i, c in enumerate(self.children)]
        # req id -> the child serving its load, from the lookup that chose it to its end.
        self._chosen: dict[str, int] = {}
        self._extra_async_saves: dict[str, int] = {}
        self._swallow_sending: dict[str, int] = {}

    @property
    def requires_kv_delivery(self) -> bool:
        return any(c.requires_kv_delivery for c in self.children)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return all(c.supports_divergent_local_hybrid_hits for c in self.children)

    # ---------------------------------------------------------------- scheduler side
    def on_new_request(self, request: Request) -> None:
        for child in self.children:
            child.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        answers = []
        for child in self.children:
            count, is_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if count is None:
                return None, False
            answers.append((count, is_async))
        for i, (count, is_async) in enumerate(answers):
            if count > 0:
                self._chosen[request.request_id] = i
                return count, is_async
        self._chosen.pop(request.request_id, None)
        return 0, False

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        chosen = self._chosen.get(request.request_id)
        if chosen is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return self.children[chosen].get_loaded_kv_cache_group_ids(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        chosen = self._chosen.get(request.request_id)
        for i, child in enumerate(self.children):
            child.update_state_after_alloc(
                request, blocks, num_external_tokens if i == chosen else 0
            )

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        chosen = self._chosen.get(request.request_id)
        if chosen is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self.children[chosen].get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = MultiKVConnectorMetadata(
            metadata=tuple(c.build_connector_meta(scheduler_output) for c in self.children),
            extra_async_saves=self._extra_async_saves,
        )
        self._extra_async_saves = {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        try:
            for i, child in enumerate(self.children):
                if isinstance(meta, MultiKVConnectorWorkerMetadata):
                    connector_output.kv_connector_worker_meta = meta.metadata[i]
                child.update_connector_output(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        results = [c.request_finished(request, block_ids) for c in self.children]
        return self._merge_finished(results, request.request_id)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        results = [
            c.request_finished_all_groups(request, block_ids)
            if isinstance(c, SupportsHMA)
            else c.request_finished(request, block_ids[0])
            for c in self.children
        ]
        return self._merge_finished(results, request.request_id)

    def _merge_finished(
        self, results: Iterable[tuple[bool, dict[str, Any] | None]], req_id: str
    ) -> tuple[bool, dict[str, Any] | None]:
        self._chosen.pop(req_id, None)
        delays = 0
        merged: dict[str, Any] = {}
        for delay, params in results:
            delays += int(delay)
            for key, value in (params or {}).items():
                if key in merged:
                    raise RuntimeError(
                        f"MultiConnector: two children returned kv_transfer_params[{key!r}]"
                    )
                merged[key] = value
        if delays > 1:
            self._extra_async_saves[req_id] = delays - 1
        return delays > 0, merged or None

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        taken = [
            c.register_finished_partial_tail(request, block_ids, partial_tail_offloads)
            for c in self.children
        ]
        return any(taken)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManagerView) -> None:
        # Each child's own binding also calls its bind_gpu_block_pool; not this one's.
        self._kv_cache_manager = kv_cache_manager
        for child in self.children:
            child.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: KVCacheManagerView) -> None:
        for child in self.children:
            child.bind_gpu_block_pool(gpu_block_pool)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        for child in self.children:
            child.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        for child in self.children:
            child.set_xfer_handshake_metadata_pp_aware(metadata)

    def take_events(self) -> Iterable[Any]:
        for child in self.children:
            yield from child.take_events()

    def has_pending_push_work(self) -> bool:
        return any(c.has_pending_push_work() for c in self.children)

    def has_pending_block_frees(self) -> bool:
        return any(c.has_pending_block_frees() for c in self.children)

    def get_finished_count(self) -> int | None:
        counts = {c.get_finished_count() for c in self.children}
        if len(counts) > 1:
            raise ConfigError(f"MultiConnector children disagree on the finished count: {counts}")
        return counts.pop()

    def reset_cache(self) -> bool | None:
        results = [c.reset_cache() for c in self.children]
        return all(r is not False for r in results)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for child in self.children:
            child.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_op: CopyBlocksOp) -> None:
        for child in self.children:
            child.set_host_xfer_buffer_ops(copy_op)

    def _child_meta(self, metadata: KVConnectorMetadata) -> MultiKVConnectorMetadata:
        if not isinstance(metadata, MultiKVConnectorMetadata):
            raise TypeError("MultiConnector expects MultiKVConnectorMetadata")
        return metadata

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        meta = self._child_meta(metadata)
        for child, m in zip(self.children, meta.metadata, strict=True):
            child.handle_preemptions(m)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        meta = self._child_meta(metadata)
        super().bind_connector_metadata(meta)
        for req_id, n in meta.extra_async_saves.items():
            self._swallow_sending[req_id] = self._swallow_sending.get(req_id, 0) + n
        for child, m in zip(self.children, meta.metadata, strict=True):
            child.bind_connector_metadata(m)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self.children:
            child.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for child in self.children:
            child.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self.children:
            child.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        for child in self.children:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def finish_forward(self) -> None:
        for child in self.children:
            child.finish_forward()

    def wait_for_save(self) -> None:
        for child in self.children:
            child.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        merged = KVConnectorTransferResults()
        for child in self.children:
            results = child.get_transfer_results(finished_req_ids)
            merged.finished_recving |= results.finished_recving
            merged.failed_recving |= results.failed_recving
            for req_id in results.finished_sending:
                left = self._swallow_sending.get(req_id, 0)
                if left > 0:
                    self._swallow_sending[req_id] = left - 1
                else:
                    self._swallow_sending.pop(req_id, None)
                    merged.finished_sending.add(req_id)
        return merged

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # The older form, for callers that ask it directly; failed receives are then lost, so
        # the engine asks get_transfer_results.
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(c.get_block_ids_with_load_errors() for c in self.children))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        by_child = {
            name: stats
            for name, child in zip(self._names, self.children, strict=True)
            if (stats := child.get_kv_connector_stats()) is not None
        }
        return MultiKVConnectorStats(by_child=by_child) if by_child else None

    def get_kv_connector_kv_cache_events(self) -> Any | None:
        # Children are different connectors on this one worker: their events are a union.
        flat: list[Any] = []
        for child in self.children:
            ev = child.get_kv_connector_kv_cache_events()
            if ev is None:
                continue
            get_all = getattr(ev, "get_all_events", None)
            flat.extend(get_all() if callable(get_all) else ev)
        return flat or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        metas = tuple(c.build_connector_worker_meta() for c in self.children)
        return MultiKVConnectorWorkerMetadata(metas) if any(m is not None for m in metas) else None

    def get_handshake_metadata(self) -> Any | None:
        return next(
            (m for c in self.children if (m := c.get_handshake_metadata()) is not None), None
        )

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()
