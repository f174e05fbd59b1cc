"""The protocol side both offload connectors share: a facade that dispatches each protocol
call to the connector's scheduler half or worker half, by role.

The halves hold the logic (``connectors/simple_cpu_offload`` and ``connectors/offloading``);
the mechanism they drive (tiers, policies, transfers, files) lives in this package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
)

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.core.kv_cache_config import KVCacheConfig
    from kvferry.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvferry.core.sched_output import SchedulerOutput
    from kvferry.kv_transfer.output import KVConnectorOutput
    from kvferry.model.forward_context import ForwardContext
    from kvferry.request import Request


@dataclass(frozen=True)
class EngineFacts:
    prefix_caching: bool
    world_size: int
    model_path: str | None


def engine_facts(config: Any) -> EngineFacts:
    """What the offloaders need from the engine config (tests may pass a partial one)."""
    cache = getattr(config, "cache_config", None)
    parallel = getattr(config, "parallel_config", None)
    model = getattr(config, "model_config", None)
    return EngineFacts(
        prefix_caching=bool(getattr(cache, "enable_prefix_caching", True)),
        world_size=int(getattr(parallel, "tensor_parallel_size", 1)),
        model_path=getattr(model, "model", None),
    )


class SchedulerHalf(ABC):
    """The scheduler-role logic of an offload connector (same contracts as the protocol)."""

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        """The engine's KV cache manager (read only; lazy offload walks its free queue)."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]: ...
    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None: ...
    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata: ...
    @abstractmethod
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None: ...
    @abstractmethod
    def request_finished(self, request: Request) -> None: ...
    @abstractmethod
    def take_events(self) -> Iterable[Any]: ...
    @abstractmethod
    def has_pending_work(self) -> bool: ...
    @abstractmethod
    def take_stats(self) -> KVConnectorStats | None: ...
    @abstractmethod
    def reset_cache(self) -> bool: ...
    @abstractmethod
    def check_integrity(self, idle: bool = False) -> None:
        """Assert the offload pool's invariants; ``idle``: also that nothing is in flight,
        pinned or held (the end of a lifecycle test, once the engine stopped stepping)."""


class WorkerHalf(ABC):
    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None: ...
    @abstractmethod
    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None: ...
    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None: ...
    @abstractmethod
    def wait_for_save(self, metadata: KVConnectorMetadata) -> None: ...
    @abstractmethod
    def get_finished(self, metadata: KVConnectorMetadata | None) -> set[str]: ...
    @abstractmethod
    def get_failed_recving(self) -> set[str]: ...
    @abstractmethod
    def build_worker_meta(self) -> KVConnectorWorkerMetadata | None: ...
    @abstractmethod
    def take_stats(self) -> KVConnectorStats | None: ...
    @abstractmethod
    def shutdown(self) -> None: ...


class OffloadConnectorBase(KVConnectorBase):
    """Dispatches the protocol to ``self.scheduler_half`` or ``self.worker_half``.

    Offload connectors never delay frees (``request_finished`` returns False): a store that
    still reads a finished or preempted request's blocks is *fenced* instead. The scheduler
    half lists, each step, the store jobs whose source blocks this step reallocated; the
    worker waits for them in ``handle_preemptions``, before the forward can overwrite them.
    """

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self.facts = engine_facts(config)
        if not self.facts.prefix_caching:
            raise ConfigError(
                f"{type(self).__name__} keys offloaded KV by prefix-cache block hashes and "
                f"needs prefix caching; enable it (enable_prefix_caching=True) or drop the "
                f"connector"
            )
        self._sched: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None

    @property
    def scheduler_half(self) -> SchedulerHalf:
        assert self._sched is not None, "scheduler-side call on a worker-role connector"
        return self._sched

    @property
    def worker_half(self) -> WorkerHalf:
        assert self._worker is not None, "worker-side call on a scheduler-role connector"
        return self._worker

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_half.register_kv_caches(kv_caches)

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        self.worker_half.handle_preemptions(metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_half.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request computes only after its load is in

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # whole blocks are copied after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        self.worker_half.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.worker_half.get_finished(self._connector_metadata) or None

    def get_failed_recving(self) -> set[str]:
        return self.worker_half.get_failed_recving()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_half.build_worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._role == KVConnectorRole.WORKER:
            return self.worker_half.take_stats()
        return self.scheduler_half.take_stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side -------------------------------------------------------------------
    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        if self._sched is not None:
            self._sched.bind_kv_cache_manager(manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_half.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_half.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_half.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_half.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler_half.request_finished(request)
        return False, None

    def take_events(self) -> Iterable[Any]:
        return self.scheduler_half.take_events()

    def has_pending_work(self) -> bool:
        return self.scheduler_half.has_pending_work()

    def reset_cache(self) -> bool | None:
        return self.scheduler_half.reset_cache()

    def check_offload_integrity(self, idle: bool = False) -> None:
        """Leak check of the offload pool (scheduler role); see SchedulerHalf.check_integrity."""
        self.scheduler_half.check_integrity(idle)
