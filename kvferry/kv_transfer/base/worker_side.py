"""The worker-side contract of a KV connector: what the engine calls on the ``WORKER`` role
instance around each forward, and once at start and shutdown."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from kvferry.kv_transfer.base.common import CopyBlocksOp, KVConnectorTransferResults
from kvferry.step_types.kv_connector_metadata import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

if TYPE_CHECKING:
    from kvferry.kv_transfer.base.stats import KVConnectorStats
    from kvferry.model.forward_context import ForwardContext

__all__ = ["KVConnectorWorkerSide"]


class KVConnectorWorkerSide(ABC):
    """Worker-role members of :class:`~kvferry.kv_transfer.base.KVConnectorBase`."""

    _connector_metadata: KVConnectorMetadata | None
    _copy_op: CopyBlocksOp | None

    # -- start and shutdown ---------------------------------------------------------------
    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        """A context to allocate the KV pool in (custom memory pools). kvferry allocates its
        pool with torch's default allocator and never asks; vLLM's default None applies."""
        return None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once per worker after the KV pool is allocated: layer name -> tensor of shape
        ``(2, num_blocks, block_size, num_kv_heads, head_dim)``, its memory in the order of
        the pool's layout (``"NHD"``: contiguous as shaped; ``"HND"``: strided so each head's
        rows of a block are together; see ``get_required_kvcache_layout`` and
        ``kv_cache_config.layout``). Pre-register memory here."""

    def set_host_xfer_buffer_ops(self, copy_op: CopyBlocksOp) -> None:
        """Called right after ``register_kv_caches`` with the engine's block copy function."""
        self._copy_op = copy_op

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Asked once per worker at start, after ``register_kv_caches``: what a peer needs to
        reach this worker (addresses, memory descriptors), or None. The engine hands every
        rank's answer to the scheduler side through ``set_xfer_handshake_metadata_pp_aware``."""
        return None

    def unregister_kv_caches(self) -> None:
        """Drop KV registrations before the pool is released (vLLM's sleep mode). kvferry has
        no sleep mode and never calls it; idempotent no-op by default."""

    def restore_kv_caches(self) -> None:
        """Redo the registrations ``unregister_kv_caches`` dropped (vLLM's wake-up). Never
        called by kvferry; idempotent no-op by default."""

    def reset_capture_state(self) -> None:
        """Undo worker state changed while CUDA graphs were captured. kvferry runs eagerly and
        captures no graphs, so it never calls this; no-op by default."""

    def shutdown(self) -> None:
        """Release threads, sockets and files. Called once at engine shutdown, on both roles."""

    # -- every step, before the forward ---------------------------------------------------
    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        """Called every step before the forward, before binding. Blocks freed by preemption may
        be reused by this very step: finish or fence any async save still reading them."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Called every step (empty ones too) before ``start_load_kv``."""
        self._connector_metadata = metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata is bound for this step")
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads into the engine's KV blocks (may return before they finish).

        Called on every step that carries metadata, right after ``bind_connector_metadata``
        and before the forward (as vLLM does): sync loads must be in place, or fenced by
        ``wait_for_layer_load``, before the layers read them; async loads start here and end
        in ``get_finished`` / ``get_transfer_results`` of a later step."""

    # -- during the forward, per attention layer ------------------------------------------
    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by an attention layer before it reads its KV: block until that layer's loads
        for this step are in place. A no-op for connectors that load everything up front."""

    @abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Called by an attention layer after this step's KV was written into ``kv_layer``.
        ``attn_metadata.slot_mapping`` tells which slots received new tokens."""

    # -- every step, after the forward ----------------------------------------------------
    def finish_forward(self) -> None:
        """Called once per step right after the forward (and on steps without one), before
        ``wait_for_save``: the model no longer reads this step's KV."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Called once per step after the forward (and on empty steps). Either block until the
        step's saves are done, or keep the source blocks alive until completion is reported."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What the engine asks after ``wait_for_save``: sends and receives completed since the
        last call, and failed receives, in one snapshot. ``finished_req_ids`` are requests the
        scheduler finished since the last step. The default combines ``get_finished`` and
        ``get_failed_recving``; override either this or those."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=set(self.get_failed_recving()),
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Return ``(finished_sending, finished_recving)`` request ids completed since the last
        call (the 0.20.2 form of ``get_transfer_results``). A failed async load is reported
        here as finished (and its blocks or id as failed)."""
        return None, None

    def get_failed_recving(self) -> set[str]:
        """Request ids whose async load failed as a whole (safer than block ids); each must also
        be reported as finished_recving. kvferry-only; vLLM's form is
        ``KVConnectorTransferResults.failed_recving``."""
        return set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine block ids whose load failed since the last call (then forgotten). Report a
        failed async load no later than the step that reports the request finished_recving."""
        return set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Interval stats (reset on read), or None."""
        return None

    def get_kv_connector_kv_cache_events(self) -> Any | None:
        """KV cache events of this worker since the last call (``KVConnectorKVEvents``)."""
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Data for the scheduler side about this step, folded across workers by ``aggregate``."""
        return None

    def clear_connector_metadata(self) -> None:
        """Called at the end of every step; the per-layer hooks are no-ops afterwards."""
        self._connector_metadata = None
