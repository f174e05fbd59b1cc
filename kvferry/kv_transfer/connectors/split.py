"""SplitConnector: a connector written as a scheduler half and a worker half.

A connector class is built once per role, and each role uses only its side of the protocol.
Connectors that keep the two sides apart subclass :class:`SplitConnector`, build the half of
their role (:meth:`SplitConnector.set_scheduler_half` or
:meth:`SplitConnector.set_worker_half`) and put their logic in a :class:`SchedulerHalf` and a
:class:`WorkerHalf`. The facade forwards every protocol hook to the half of its side; a hook
called on the other role raises a :class:`RuntimeError` that names the hook and the role.

The halves mirror the protocol hook by hook (same names, same contracts: see
:class:`~kvferry.kv_transfer.base.KVConnectorBase`), with these differences: worker hooks
that act on the step's plan receive the bound metadata explicitly; ``get_kv_connector_stats``
and ``shutdown``, which the engine calls on both roles, go to whichever half exists; and
``get_finished_count``, a fact about the connector that both roles read, stays on the facade
(override it there); ``get_external_cache_hit_sources`` of a half may answer None, for all
hits from the facade's ``_cache_hit_source``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvferry.kv_transfer.base import (
    CacheHitSource,
    CopyBlocksOp,
    KVConnectorBase,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
)

if TYPE_CHECKING:
    import torch

    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView, KVCacheManagerView
    from kvferry.model.forward_context import ForwardContext
    from kvferry.request import Request
    from kvferry.step_types.kv_connector_output import KVConnectorOutput
    from kvferry.step_types.scheduler_output import SchedulerOutput


class SchedulerHalf(ABC):
    """The scheduler-role logic of a split connector; defaults are the protocol's no-ops."""

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManagerView) -> None:
        return None

    def validate_kv_transfer_params(self, params: dict[str, Any]) -> None:
        return None

    def on_new_request(self, request: Request) -> None:
        return None

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]: ...

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None: ...

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int] | None:
        return None

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata: ...

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        return None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def take_events(self) -> Iterable[Any]:
        return ()

    def has_pending_work(self) -> bool:
        return False

    def has_pending_block_frees(self) -> bool:
        return False

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        return None

    def reset_cache(self) -> bool | None:
        return None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None

    def shutdown(self) -> None:
        return None


class WorkerHalf(ABC):
    """The worker-role logic of a split connector; defaults are the protocol's no-ops.

    ``metadata`` arguments are the step's bound plan (``get_finished`` may run with none
    bound: then it is None)."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None: ...

    def set_host_xfer_buffer_ops(self, copy_op: CopyBlocksOp) -> None:
        return None

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        return None

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        return None

    @abstractmethod
    def start_load_kv(
        self, metadata: KVConnectorMetadata, forward_context: ForwardContext
    ) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None

    def finish_forward(self) -> None:
        return None

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        return None

    def get_finished(
        self, finished_req_ids: set[str], metadata: KVConnectorMetadata | None
    ) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_failed_recving(self) -> set[str]:
        return set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None

    def get_kv_connector_kv_cache_events(self) -> Any | None:
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None

    def shutdown(self) -> None:
        return None


SchedulerT = TypeVar("SchedulerT", bound=SchedulerHalf)
WorkerT = TypeVar("WorkerT", bound=WorkerHalf)


class SplitConnector(KVConnectorBase, Generic[SchedulerT, WorkerT]):
    """Forwards the protocol to ``scheduler_half`` or ``worker_half``, by role.

    A subclass's ``__init__`` calls ``super().__init__`` and then builds the half of
    ``role``. Subclasses may override a hook to add checks, and call ``super()`` to forward.
    """

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self._scheduler_half: SchedulerT | None = None
        self._worker_half: WorkerT | None = None

    def set_scheduler_half(self, half: SchedulerT) -> None:
        if self._role != KVConnectorRole.SCHEDULER:
            raise RuntimeError(f"{type(self).__name__}: a scheduler half on the {self._role_name}")
        self._scheduler_half = half

    def set_worker_half(self, half: WorkerT) -> None:
        if self._role != KVConnectorRole.WORKER:
            raise RuntimeError(f"{type(self).__name__}: a worker half on the {self._role_name}")
        self._worker_half = half

    @property
    def _role_name(self) -> str:
        return f"{self._role.name.lower()}-role instance"

    def _scheduler_side(self, hook: str) -> SchedulerT:
        if self._scheduler_half is None:
            raise RuntimeError(
                f"{type(self).__name__}.{hook} is a scheduler-side hook, called on the "
                f"{self._role_name}"
            )
        return self._scheduler_half

    def _worker_side(self, hook: str) -> WorkerT:
        if self._worker_half is None:
            raise RuntimeError(
                f"{type(self).__name__}.{hook} is a worker-side hook, called on the "
                f"{self._role_name}"
            )
        return self._worker_half

    @property
    def scheduler_half(self) -> SchedulerT:
        return self._scheduler_side("scheduler_half")

    @property
    def worker_half(self) -> WorkerT:
        return self._worker_side("worker_half")

    # -- both roles -------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker_half is not None:
            return self._worker_half.get_kv_connector_stats()
        if self._scheduler_half is not None:
            return self._scheduler_half.get_kv_connector_stats()
        return None

    def shutdown(self) -> None:
        if self._worker_half is not None:
            self._worker_half.shutdown()
        if self._scheduler_half is not None:
            self._scheduler_half.shutdown()

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side("register_kv_caches").register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_op: CopyBlocksOp) -> None:
        super().set_host_xfer_buffer_ops(copy_op)
        self._worker_side("set_host_xfer_buffer_ops").set_host_xfer_buffer_ops(copy_op)

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        self._worker_side("handle_preemptions").handle_preemptions(metadata)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        worker = self._worker_side("bind_connector_metadata")
        super().bind_connector_metadata(metadata)
        worker.bind_connector_metadata(metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        worker = self._worker_side("start_load_kv")
        worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side("wait_for_layer_load").wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._worker_side("save_kv_layer").save_kv_layer(layer_name, kv_layer, attn_metadata)

    def finish_forward(self) -> None:
        self._worker_side("finish_forward").finish_forward()

    def wait_for_save(self) -> None:
        self._worker_side("wait_for_save").wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        worker = self._worker_side("get_finished")
        return worker.get_finished(finished_req_ids, self._connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._worker_side("get_block_ids_with_load_errors")
        return worker.get_block_ids_with_load_errors()

    def get_failed_recving(self) -> set[str]:
        return self._worker_side("get_failed_recving").get_failed_recving()

    def get_kv_connector_kv_cache_events(self) -> Any | None:
        worker = self._worker_side("get_kv_connector_kv_cache_events")
        return worker.get_kv_connector_kv_cache_events()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        worker = self._worker_side("build_connector_worker_meta")
        return worker.build_connector_worker_meta()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker_side("get_handshake_metadata").get_handshake_metadata()

    # -- scheduler side ---------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManagerView) -> None:
        scheduler = self._scheduler_side("bind_kv_cache_manager")
        scheduler.bind_kv_cache_manager(kv_cache_manager)

    def validate_kv_transfer_params(self, params: dict[str, Any]) -> None:
        self._scheduler_side("validate_kv_transfer_params").validate_kv_transfer_params(params)

    def on_new_request(self, request: Request) -> None:
        self._scheduler_side("on_new_request").on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        scheduler = self._scheduler_side("get_num_new_matched_tokens")
        return scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        scheduler = self._scheduler_side("update_state_after_alloc")
        scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        scheduler = self._scheduler_side("get_external_cache_hit_sources")
        sources = scheduler.get_external_cache_hit_sources(request, num_external_tokens)
        if sources is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return sources

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduler = self._scheduler_side("build_connector_meta")
        return scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        scheduler = self._scheduler_side("update_connector_output")
        scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side("request_finished").request_finished(request, block_ids)

    def take_events(self) -> Iterable[Any]:
        return self._scheduler_side("take_events").take_events()

    def has_pending_work(self) -> bool:
        return self._scheduler_side("has_pending_work").has_pending_work()

    def has_pending_block_frees(self) -> bool:
        return self._scheduler_side("has_pending_block_frees").has_pending_block_frees()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        scheduler = self._scheduler_side("set_xfer_handshake_metadata")
        scheduler.set_xfer_handshake_metadata(metadata)

    def reset_cache(self) -> bool | None:
        return self._scheduler_side("reset_cache").reset_cache()
