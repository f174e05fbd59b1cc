"""The scheduler-side contract of a KV connector: what the scheduler calls on the
``SCHEDULER`` role instance as requests arrive, are admitted, run and end."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from kvferry.kv_transfer.base.common import CacheHitSource
from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView, KVCacheManagerView
from kvferry.step_types.kv_connector_metadata import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

if TYPE_CHECKING:
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.base.stats import KVConnectorStats
    from kvferry.request import Request
    from kvferry.step_types.kv_connector_output import KVConnectorOutput
    from kvferry.step_types.scheduler_output import SchedulerOutput

__all__ = ["KVConnectorSchedulerSide"]


class KVConnectorSchedulerSide(ABC):
    """Scheduler-role members of :class:`~kvferry.kv_transfer.base.KVConnectorBase`."""

    # The tier this connector's external hits come from, unless it overrides
    # ``get_external_cache_hit_sources``.
    _cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    _kv_cache_config: KVCacheConfig | None
    _kv_cache_manager: KVCacheManagerView | None

    # -- start ----------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManagerView) -> None:
        """Called once when the scheduler is built, with its KV cache manager. Read it, never
        change it (e.g. an offloader asks for ``eviction_candidates`` to store blocks about to
        be evicted). The default keeps it as ``self._kv_cache_manager`` and calls
        ``bind_gpu_block_pool`` with the same view."""
        self._kv_cache_manager = kv_cache_manager
        self.bind_gpu_block_pool(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: KVCacheManagerView) -> None:
        """vLLM 0.33's name for the binding above; kvferry passes the KV cache manager's
        read-only view (block ids, hashes, free count, eviction candidates), as the pool
        itself is the scheduler's to change."""

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Each worker rank's ``get_handshake_metadata`` (ranks that returned None left out),
        once at start; not called when all returned None."""

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """What the engine calls at start: the handshake metadata keyed by
        ``(pp_rank, tp_rank)``. kvferry has no pipeline parallelism, so ``pp_rank`` is 0; the
        default refuses any other and hands ``{tp_rank: meta}`` to
        ``set_xfer_handshake_metadata``."""
        if any(pp_rank != 0 for pp_rank, _ in metadata):
            raise ValueError(
                f"{type(self).__name__} got handshake metadata for a pipeline rank above 0, "
                "but it does not handle pipeline-parallel KV transfer"
            )
        self.set_xfer_handshake_metadata({tp: meta for (_, tp), meta in metadata.items()})

    # -- request intake and admission -----------------------------------------------------
    def validate_kv_transfer_params(self, params: dict[str, Any]) -> None:
        """Called on the scheduler side when a request carrying ``kv_transfer_params`` arrives,
        before it is queued. Raise ``ValueError`` with a clear message for params this
        connector could never honour (wrong types, impossible ranges); the request is then
        refused (an HTTP 400 from the server) and nothing is held. Checks that need the
        request's state belong in ``get_num_new_matched_tokens``. kvferry-only."""

    def on_new_request(self, request: Request) -> None:
        """Called once when the scheduler takes in a request, before its first lookup (e.g. to
        set up per-request state). An exception refuses the request; nothing is held."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` (a block-aligned local prefix hit) can
        be loaded from outside, and whether the load is asynchronous.

        May be called several times for one request: keep it free of side effects. Return
        ``(None, False)`` when the answer is not known yet; the scheduler skips the request this
        step and asks again. The flag must be False when the count is 0. Never offer the last
        prompt token: its logits are needed to sample."""

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The KV cache groups a load for ``request`` restores; asked after
        ``get_num_new_matched_tokens`` offered a positive count. kvferry's groups all hold
        attention KV the request reads, so an external hit that leaves a group out is not
        used (the tokens are computed). Default: every group."""
        config = self._kv_cache_config
        return tuple(range(len(config.groups))) if config is not None else (0,)

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        """Called after a successful allocation for every admitted waiting request (also with 0
        external tokens). Record which engine blocks receive the external tokens. For an async
        load it is called again with 0 when the request is scheduled after the load."""

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """Split a first admission's ``num_external_tokens`` (> 0) by the tier that holds
        them; asked right after ``update_state_after_alloc``. Counts must add up to
        ``num_external_tokens`` (otherwise they are all counted as ``external_unspecified``);
        zero counts are left out. They reach ``RequestMetrics.external_cache_hit_sources``
        and Prometheus. Default: all from ``_cache_hit_source``."""
        if num_external_tokens == 0:
            return {}
        return {self._cache_hit_source: num_external_tokens}

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """Whether the connector restores lagging recurrent state of hybrid models when the
        local full-attention hit goes deeper. kvferry has no recurrent-state layers and never
        asks; vLLM's default False."""
        return False

    # -- every step -----------------------------------------------------------------------
    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Pack this step's loads and saves. Called at the end of every ``schedule()``; must not
        modify ``scheduler_output``; resets the per-step plan."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Consume the step's aggregated worker output, before the scheduler handles
        finished_recving / finished_sending."""

    def take_events(self) -> Iterable[Any]:
        """KV cache events since the last call (``kvferry.kv_events`` types), called once per
        step after ``update_connector_output``; the scheduler publishes them in that step's
        batch. The workers' events (``KVConnectorOutput.kv_cache_events``, merged across
        workers) are published only if the connector returns them from here, as in vLLM."""
        return ()

    def get_finished_count(self) -> int | None:
        """How many workers must report a request id finished; None means every worker."""
        return None

    # -- request end ----------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request ends (any reason), before its blocks are freed.

        Return True to keep the blocks until the request id comes back in finished_sending
        (the connector is still reading them), and optional ``kv_transfer_params`` that are
        returned to the caller with the final output."""
        return False, None

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        """Take over the partial last block offloads vLLM's cache manager finalizes when a
        request ends (True keeps the blocks until ``get_finished``). kvferry's cache manager
        offloads whole blocks only, so it never calls this; vLLM's default False."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """Whether KV this connector hands off must arrive (vLLM: a request preempted while its
        hand-off is pending is then recomputed instead of finishing on freed blocks). Default:
        the producer role. kvferry schedules one step at a time, so no output is stale when a
        request is preempted; the scheduler reads it once, as vLLM does, and nothing else
        depends on it."""
        kvt = getattr(self, "_kv_transfer_config", None)
        return bool(kvt is not None and kvt.is_kv_producer)

    # -- keeping the engine stepping ------------------------------------------------------
    def has_pending_push_work(self) -> bool:
        """True keeps the engine stepping with no requests (e.g. queued stores or pushes).
        ``has_pending_work`` is the same hook under kvferry's older name: override either."""
        if type(self).has_pending_work is not KVConnectorSchedulerSide.has_pending_work:
            return self.has_pending_work()
        return False

    def has_pending_work(self) -> bool:
        """Alias of ``has_pending_push_work`` (one implementation, whichever is overridden)."""
        if type(self).has_pending_push_work is not KVConnectorSchedulerSide.has_pending_push_work:
            return self.has_pending_push_work()
        return False

    def has_pending_block_frees(self) -> bool:
        """True when transfers in flight will soon hand engine blocks back (finished_sending
        of delayed frees). A running request that finds no free block then waits a step
        instead of preempting another. Only answer True for transfers that do complete."""
        return False

    def reset_cache(self) -> bool | None:
        """Drop the connector's own cache; True done, False failed, None: it has none."""
        return None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Rebuild this connector's ``KVConnectorStats`` (or subclass) from ``data`` when stats
        arrive as a plain dict (serialized by a worker). None: kvferry uses a plain
        ``KVConnectorStats``."""
        return None
