"""FaultInjectionConnector: the wrapper, both roles. The scheduler side plans faults with a
:class:`.planner.FaultPlanner`; the worker side applies them where the engine sees them.

Every hook of vLLM 0.33's API reaches the wrapped connector under its new name (the base's
defaults fall back to the older names), so a wrapped vLLM-style connector that overrides only
the new names is reached; class-level hooks are asked of the wrapped connector's class."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from kvferry.kv_transfer.base import (
    CopyBlocksOp,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from kvferry.kv_transfer.connectors.fault_injection.forwarding import ForwardToInner
from kvferry.kv_transfer.connectors.fault_injection.metadata import (
    FaultInjectionMetadata,
    InjectedLoad,
)
from kvferry.kv_transfer.connectors.fault_injection.options import (
    FaultInjectionOptions,
    InjectedFault,
    inner_config,
    with_kv_transfer_config,
)
from kvferry.kv_transfer.connectors.fault_injection.planner import FaultPlanner
from kvferry.kv_transfer.factory import KVConnectorFactory
from kvferry.kv_transfer.options import parse_options
from kvferry.logger import init_logger

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView, KVCacheManagerView
    from kvferry.model.forward_context import ForwardContext
    from kvferry.request import Request
    from kvferry.step_types.kv_connector_output import KVConnectorOutput
    from kvferry.step_types.scheduler_output import SchedulerOutput

logger = init_logger(__name__)

# Far from any real key or value, finite in every float dtype the engine uses.
GARBAGE = 1e4


class FaultInjectionConnector(ForwardToInner, KVConnectorBase, SupportsHMA):
    """Wraps ``inner`` (built from the ``inner`` option) and injects the configured faults."""

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        name = type(self).__name__
        kvt = self._kv_transfer_config
        self.options = o = parse_options(FaultInjectionOptions, kvt.kv_connector_extra_config, name)
        child = with_kv_transfer_config(config, inner_config(kvt, name))
        self.inner: KVConnectorBase = KVConnectorFactory.create_connector(
            child, role, kv_cache_config
        )
        self.block_size = kv_cache_config.groups[0].block_size
        self._calls: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self._planner = FaultPlanner(o, self.block_size, self._count)  # scheduler side
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._sync_corrupt: list[InjectedLoad] = []
        self._async: dict[str, InjectedLoad] = {}
        self._held: dict[str, tuple[float, InjectedLoad]] = {}  # delayed finished_recving
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self.sabotaged_req_ids: list[str] = []

    def __getattr__(self, name: str) -> Any:
        # Anything else (test helpers such as check_offload_integrity) is the inner's.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def _hook(self, name: str) -> None:
        if self.options.raise_in != name:
            return
        n = self._calls.get(name, 0)
        self._calls[name] = n + 1
        calls = self.options.raise_calls
        if calls is None or n in calls:
            raise InjectedFault(f"FaultInjectionConnector: injected fault in {name} (call {n})")

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    # ---------------------------------------------------------------- scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManagerView) -> None:
        # The inner's own binding calls its bind_gpu_block_pool.
        self._kv_cache_manager = kv_cache_manager
        self.inner.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self.inner.on_new_request(request)
        self._hook("on_new_request")

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, is_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        self._planner.on_lookup(request.request_id, num_computed_tokens, is_async)
        self._hook("get_num_new_matched_tokens")
        return count, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        self._planner.on_alloc(request, blocks, num_external_tokens)
        self._hook("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = FaultInjectionMetadata(self.inner.build_connector_meta(scheduler_output))
        meta.loads = self._planner.take_loads()
        meta.store_delay_s = self._planner.plan_stores(scheduler_output)
        self._hook("build_connector_meta")
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.inner.update_connector_output(connector_output)
        self._hook("update_connector_output")

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._planner.forget(request.request_id)
        result = self.inner.request_finished(request, block_ids)
        self._hook("request_finished")
        return result

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._planner.forget(request.request_id)
        if isinstance(self.inner, SupportsHMA):
            result = self.inner.request_finished_all_groups(request, block_ids)
        else:
            result = self.inner.request_finished(request, block_ids[0])
        self._hook("request_finished")
        return result

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        self.inner.register_kv_caches(kv_caches)
        self._hook("register_kv_caches")

    def set_host_xfer_buffer_ops(self, copy_op: CopyBlocksOp) -> None:
        super().set_host_xfer_buffer_ops(copy_op)
        self.inner.set_host_xfer_buffer_ops(copy_op)

    def _meta(self, metadata: KVConnectorMetadata) -> FaultInjectionMetadata:
        if not isinstance(metadata, FaultInjectionMetadata):
            raise TypeError("FaultInjectionConnector expects FaultInjectionMetadata")
        return metadata

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        self.inner.handle_preemptions(self._meta(metadata).inner)
        self._hook("handle_preemptions")

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        meta = self._meta(metadata)
        super().bind_connector_metadata(meta)
        self.inner.bind_connector_metadata(meta.inner)
        for load in meta.loads:
            if load.is_async:
                self._async[load.req_id] = load

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.inner.clear_connector_metadata()
        self._sync_corrupt = []

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta(self._get_connector_metadata())
        sync = [load for load in meta.loads if not load.is_async]
        delay = max((load.delay_s for load in sync), default=0.0)
        if delay > 0:
            self._count("delayed_loads")
            time.sleep(delay)
        self.inner.start_load_kv(forward_context, **kwargs)
        for load in sync:
            if load.fail:
                self._sabotage(load)
                self._load_errors.update(load.block_ids)
        self._sync_corrupt = [load for load in sync if load.corrupt]
        self._hook("start_load_kv")

    def _sabotage(self, load: InjectedLoad, layers: Iterable[str] | None = None) -> None:
        if load.corrupt:
            self._garble(load.block_ids, layers)
        if layers is None:  # once per load, not once per layer
            self.sabotaged_req_ids.append(load.req_id)
            self._count("corrupted_loads" if load.corrupt else "failed_loads")
            logger.warning(
                "FaultInjectionConnector: %s the load of %s",
                "corrupted" if load.corrupt else "failed",
                load.req_id,
            )

    def _garble(self, block_ids: list[int], layers: Iterable[str] | None) -> None:
        names = self._kv_caches if layers is None else layers
        for name in names:
            cache = self._kv_caches.get(name)
            if cache is not None and block_ids:
                idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
                cache.index_fill_(1, idx, GARBAGE)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)
        # A connector that loads layer by layer may write this layer only now.
        for load in self._sync_corrupt:
            self._garble(load.block_ids, [layer_name])
        self._hook("wait_for_layer_load")

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self._hook("save_kv_layer")

    def finish_forward(self) -> None:
        self.inner.finish_forward()
        self._hook("finish_forward")

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, FaultInjectionMetadata) and meta.store_delay_s > 0:
            self._count("delayed_stores")
            time.sleep(meta.store_delay_s)
        self.inner.wait_for_save()
        self._hook("wait_for_save")

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        inner = self.inner.get_transfer_results(finished_req_ids)
        done = set(inner.finished_recving)
        # A delayed receive keeps its failure until it is reported finished.
        self._failed_recving |= inner.failed_recving
        now = time.monotonic()
        for rid in sorted(done):
            load = self._async.pop(rid, None)
            if load is not None and load.delay_s > 0:
                done.discard(rid)
                self._held[rid] = (now + load.delay_s, load)
                self._count("delayed_loads")
            elif load is not None:
                self._finish_async(load)
        for rid, (deadline, load) in list(self._held.items()):
            if now >= deadline:
                del self._held[rid]
                done.add(rid)
                self._finish_async(load)
        if self._held:  # the engine steps idle meanwhile: do not let it spin
            time.sleep(min(0.005, max(0.0, min(d for d, _ in self._held.values()) - now)))
        self._hook("get_finished")
        self._hook("get_transfer_results")
        failed = self._failed_recving & done
        self._failed_recving -= failed
        return KVConnectorTransferResults(set(inner.finished_sending), done, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # The older form for direct callers; the engine asks get_transfer_results.
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def _finish_async(self, load: InjectedLoad) -> None:
        if load.fail:
            self._sabotage(load)
            self._failed_recving.add(load.req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        errors |= self.inner.get_block_ids_with_load_errors()
        self._hook("get_block_ids_with_load_errors")
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self.inner.get_kv_connector_stats()
        if self.counts:
            counts = {f"injected_{k}": v for k, v in self.counts.items()}
            self.counts = {}
            if stats is None:
                return KVConnectorStats(counts)
            stats.data.update(counts)
        return stats

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta = self.inner.build_connector_worker_meta()
        self._hook("build_connector_worker_meta")
        return meta
