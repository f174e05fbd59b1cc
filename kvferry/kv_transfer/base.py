"""The KV-connector protocol: one class, two roles, and the data that passes between them.

A connector class is instantiated twice: once inside the scheduler (``role=SCHEDULER``) and
once per worker (``role=WORKER``). The scheduler side plans: it answers cache lookups, learns
which engine blocks were allocated for loads, and packs each step's plan into a
``KVConnectorMetadata``. The worker side moves bytes: it binds that metadata, loads and saves
KV around the forward pass and the attention layers, and reports completions, failures, stats
and ``KVConnectorWorkerMetadata`` back through ``KVConnectorOutput``. Nothing else travels
between the two, and both payloads must be plain data (no pickle across processes).

At start the engine calls ``register_kv_caches`` -> ``set_host_xfer_buffer_ops`` ->
``get_handshake_metadata`` on every worker, then ``set_xfer_handshake_metadata`` on the
scheduler side with the answers by rank. Per step the engine calls, in this order::

    scheduler: get_num_new_matched_tokens -> (allocate_slots) -> update_state_after_alloc
               -> build_connector_meta                       (every step, empty ones too)
    worker:    handle_preemptions -> bind_connector_metadata -> start_load_kv (before the
               forward when the step has sync loads, else after it) -> per attention layer
               wait_for_layer_load / save_kv_layer -> wait_for_save -> get_finished
               -> get_block_ids_with_load_errors -> get_kv_connector_stats
               -> build_connector_worker_meta -> clear_connector_metadata
    scheduler: update_connector_output -> (finished_recving / finished_sending handled)
               -> request_finished for requests that ended

When a hook raises: an exception from a per-request scheduler hook
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``request_finished``), or a
lookup answer outside its contract, ends only that request (finish reason ``error``, the
message in its output; its blocks freed, none of them left in the prefix cache); the step's
other requests go on. An exception from a step-wide hook (``build_connector_meta`` and every
worker-side hook) fails that step's requests as an engine fault, and three failing steps in a
row without output mark the engine dead. Report failed loads through
``get_block_ids_with_load_errors`` / ``get_failed_recving`` instead of raising.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from kvferry.kv_transfer.kv_cache_view import (
    KVCacheBlocksView,
    KVCacheBlockView,
    KVCacheManagerView,
)
from kvferry.logger import init_logger
from kvferry.step_types.kv_connector_metadata import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

if TYPE_CHECKING:
    from kvferry.config import EngineConfig, KVTransferConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.model.forward_context import ForwardContext
    from kvferry.request import Request
    from kvferry.step_types.kv_connector_output import KVConnectorOutput
    from kvferry.step_types.scheduler_output import SchedulerOutput

__all__ = [
    "CopyBlocksOp",
    "KVConnectorBase",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorStatsTotals",
    "KVConnectorWorkerMetadata",
    "KVCacheBlockView",
    "KVCacheBlocksView",
    "KVCacheManagerView",
    "SupportsHMA",
    "supports_hma",
]

logger = init_logger(__name__)

# (src caches, dst caches, src block ids, dst block ids, direction): copies whole blocks of
# every layer named in both dicts. "d2h" reads engine KV into a host buffer, "h2d" the reverse.
CopyBlocksOp = Callable[
    [dict[str, torch.Tensor], dict[str, torch.Tensor], list[int], list[int], Literal["h2d", "d2h"]],
    None,
]


class KVConnectorRole(enum.IntEnum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class KVConnectorStats:
    """Interval statistics of a connector. ``data`` must stay JSON-serializable.

    Workers return one per step (reset on read); the executor folds them with ``aggregate``
    and the engine logs ``reduce()``.
    """

    data: dict[str, Any] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            mine = self.data.get(key)
            if mine is None:
                self.data[key] = list(value) if isinstance(value, list) else value
            elif isinstance(mine, list):
                mine.extend(value)
            else:
                self.data[key] = mine + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """One number per key: sums for counters, means for lists of samples."""
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if isinstance(value, list):
                out[f"{key}_avg"] = sum(value) / len(value) if value else 0.0
                out[f"{key}_count"] = len(value)
            else:
                out[key] = value
        return out

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


@dataclass
class KVConnectorStatsTotals:
    """Running totals of many ``KVConnectorStats`` in constant memory: counters are summed,
    sample lists are kept as sum and count (so long-running engines do not grow)."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, stats: KVConnectorStats) -> None:
        for key, value in stats.data.items():
            if isinstance(value, list):
                self.sums[key] = self.sums.get(key, 0.0) + float(sum(value))
                self.counts[key] = self.counts.get(key, 0) + len(value)
            elif isinstance(value, (int, float)):
                self.sums[key] = self.sums.get(key, 0) + value

    def as_dict(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, total in self.sums.items():
            if key in self.counts:
                n = self.counts[key]
                out[f"{key}_avg"] = total / n if n else 0.0
                out[f"{key}_count"] = n
            else:
                out[key] = total
        return out

    def is_empty(self) -> bool:
        return not self.sums

    def reset(self) -> None:
        self.sums, self.counts = {}, {}


class KVConnectorBase(ABC):
    """Base of every KV connector. Subclasses implement the abstract methods of their roles.

    The constructor receives the engine config (``config.kv_transfer_config`` is set), the role,
    and the KV pool layout. Only the methods of the instance's role are ever called on it.
    """

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        if config.kv_transfer_config is None:
            raise ValueError("a KV connector needs EngineConfig.kv_transfer_config")
        self._config = config
        self._kv_transfer_config: KVTransferConfig = config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role
        self._connector_metadata: KVConnectorMetadata | None = None
        self._copy_op: CopyBlocksOp | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once per worker after the KV pool is allocated: layer name -> tensor of shape
        ``(2, num_blocks, block_size, num_kv_heads, head_dim)``. Pre-register memory here."""

    def set_host_xfer_buffer_ops(self, copy_op: CopyBlocksOp) -> None:
        """Called right after ``register_kv_caches`` with the engine's block copy function."""
        self._copy_op = copy_op

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        """Called every step before the forward, before binding. Blocks freed by preemption may
        be reused by this very step: finish or fence any async save still reading them."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Called every step (empty ones too) before ``start_load_kv``."""
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Called at the end of every step; the per-layer hooks are no-ops afterwards."""
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata is bound for this step")
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads into the engine's KV blocks (may return before they finish).

        Runs before the forward when the step has synchronous loads, after it otherwise."""

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

    @abstractmethod
    def wait_for_save(self) -> None:
        """Called once per step after the forward (and on empty steps). Either block until the
        step's saves are done, or keep the source blocks alive until completion is reported."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Return ``(finished_sending, finished_recving)`` request ids completed since the last
        call. ``finished_req_ids`` are requests the scheduler finished since the last step. A
        failed async load is reported here as finished (and its blocks or id as failed)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine block ids whose load failed since the last call (then forgotten). Report a
        failed async load no later than the step that reports the request finished_recving."""
        return set()

    def get_failed_recving(self) -> set[str]:
        """Request ids whose async load failed as a whole (safer than block ids); each must also
        be reported by ``get_finished`` as finished_recving."""
        return set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Interval stats (reset on read), or None."""
        return None

    def get_kv_connector_kv_cache_events(self) -> Any | None:
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Asked once per worker at start, after ``register_kv_caches``: what a peer needs to
        reach this worker (addresses, memory descriptors), or None. The engine hands every
        rank's answer to the scheduler side through ``set_xfer_handshake_metadata``."""
        return None

    def shutdown(self) -> None:
        """Release threads, sockets and files. Called once at engine shutdown, on both roles."""

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True when the connector relies on the per-layer Python hooks (kvferry runs eagerly,
        so this only documents intent for ports to graph-captured runners)."""
        return False

    # --------------------------------------------------------------- scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManagerView) -> None:
        """Called once when the scheduler is built, with its KV cache manager. Read it, never
        change it (e.g. an offloader asks for ``eviction_candidates`` to store blocks about to
        be evicted)."""

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

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        """Called after a successful allocation for every admitted waiting request (also with 0
        external tokens). Record which engine blocks receive the external tokens. For an async
        load it is called again with 0 when the request is scheduled after the load."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Pack this step's loads and saves. Called at the end of every ``schedule()``; must not
        modify ``scheduler_output``; resets the per-step plan."""

    def validate_kv_transfer_params(self, params: dict[str, Any]) -> None:
        """Called on the scheduler side when a request carrying ``kv_transfer_params`` arrives,
        before it is queued. Raise ``ValueError`` with a clear message for params this
        connector could never honour (wrong types, impossible ranges); the request is then
        refused (an HTTP 400 from the server) and nothing is held. Checks that need the
        request's state belong in ``get_num_new_matched_tokens``."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Consume the step's aggregated worker output, before the scheduler handles
        finished_recving / finished_sending."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request ends (any reason), before its blocks are freed.

        Return True to keep the blocks until the request id comes back in finished_sending
        (the connector is still reading them), and optional ``kv_transfer_params`` that are
        returned to the caller with the final output."""
        return False, None

    def take_events(self) -> Iterable[Any]:
        return ()

    def has_pending_work(self) -> bool:
        """True keeps the engine stepping with no requests (e.g. queued stores)."""
        return False

    def has_pending_block_frees(self) -> bool:
        """True when transfers in flight will soon hand engine blocks back (finished_sending
        of delayed frees). A running request that finds no free block then waits a step
        instead of preempting another. Only answer True for transfers that do complete."""
        return False

    def get_finished_count(self) -> int | None:
        """How many workers must report a request id finished; None means every worker."""
        return None

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Called on the scheduler side once at start, with each worker rank's
        ``get_handshake_metadata`` (ranks that returned None left out; not called when all did)."""

    def reset_cache(self) -> bool | None:
        return None


KVConnectorBase_V1 = KVConnectorBase


class SupportsHMA(ABC):
    """Mixin for connectors that handle several KV cache groups (hybrid models)."""

    @abstractmethod
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with one block-id list per KV cache group."""


def supports_hma(connector: object) -> bool:
    cls = connector if isinstance(connector, type) else type(connector)
    return issubclass(cls, SupportsHMA)
