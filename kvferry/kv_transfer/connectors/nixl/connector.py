"""NixlConnector: prefill/decode disaggregation over NIXL (a thin facade).

One class for both P/D roles; which one a request plays is decided per request by its
``kv_transfer_params``: ``do_remote_decode`` on the prefill instance (compute the prompt, hold
its blocks, return where to read them), ``do_remote_prefill`` on the decode instance (read the
prompt's KV from the prefill instance, then decode). The scheduler role forwards to
:class:`NixlConnectorScheduler`, the worker role to :class:`NixlConnectorWorker`.

One transfer, end to end::

    P scheduler  request_finished -> hold the prompt's blocks, return the params (delayed free)
    P worker     hold registered in the lease table (lease: kv_lease_duration)
    D scheduler  async external hit for the whole prompt -> blocks allocated -> RecvSpec
    D worker     side channel: handshake (once per engine: compat hash, engine id, layout),
                 claim (exact blocks + prompt digest; renews the lease; one reader only)
                 NIXL READ with a completion notification; heartbeats while it runs
    P worker     notification from the claiming reader -> finished_sending -> blocks freed
    D worker     READ done, and P provably held the blocks until then -> finished_recving

Failures (bad params, handshake refused or unanswered, claim refused, transfer error or
timeout, peer gone, lease possibly expired mid-read) end the read as finished *and* failed,
so the scheduler applies ``kv_load_failure_policy``. A prefill instance frees held blocks on
the notification, on a release from the decode side (a decode request that ended unread, or
the server's release path), or when the lease runs out.

Extra config (``kv_connector_extra_config``, see :class:`NixlOptions`): ``backends``
(``["UCX"]``), ``side_channel_host`` / ``side_channel_port`` (default ``kv_ip`` and
``kv_port`` + worker rank; port 0 picks a free one), ``kv_lease_duration`` (30 s),
``kv_lease_max_duration`` (600 s), ``heartbeat_interval`` (lease / 6),
``handshake_timeout`` (5 s), ``transfer_timeout`` (120 s), ``num_threads`` (0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
)
from kvferry.kv_transfer.connectors.nixl.metadata import NixlConnectorMetadata, NixlOptions
from kvferry.kv_transfer.connectors.nixl.params import Side, parse_remote, request_side
from kvferry.kv_transfer.connectors.nixl.scheduler import NixlConnectorScheduler
from kvferry.kv_transfer.options import parse_options

if TYPE_CHECKING:
    import torch

    from kvferry.config import EngineConfig
    from kvferry.core.kv_cache_config import KVCacheConfig
    from kvferry.core.kv_cache_manager import KVCacheBlocks
    from kvferry.core.sched_output import SchedulerOutput
    from kvferry.kv_transfer.connectors.nixl.worker import NixlConnectorWorker
    from kvferry.kv_transfer.output import KVConnectorOutput
    from kvferry.model.forward_context import ForwardContext
    from kvferry.request import Request


class NixlConnector(KVConnectorBase):
    # Extra-config keys a subclass consumes itself (not NixlConnector options).
    subclass_options: tuple[str, ...] = ()

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        name = type(self).__name__
        opts = parse_options(
            NixlOptions,
            self._kv_transfer_config.kv_connector_extra_config,
            name,
            ignore=self.subclass_options,
        )
        if len(kv_cache_config.groups) != 1:
            raise ConfigError(f"{name} supports one KV cache group")
        engine_id = self._kv_transfer_config.engine_id
        assert engine_id is not None
        self.connector_scheduler: NixlConnectorScheduler | None = None
        self.connector_worker: NixlConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlConnectorScheduler(
                config, kv_cache_config, opts, engine_id
            )
        else:
            # Imported here: the scheduler role never loads NIXL.
            from kvferry.kv_transfer.connectors.nixl.worker import NixlConnectorWorker

            self.connector_worker = NixlConnectorWorker(config, kv_cache_config, opts, engine_id)

    @property
    def _sched(self) -> NixlConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side method on a worker"
        return self.connector_scheduler

    @property
    def _worker(self) -> NixlConnectorWorker:
        assert self.connector_worker is not None, "a worker-side method on the scheduler"
        return self.connector_worker

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, NixlConnectorMetadata):
            raise TypeError(f"NixlConnector got {type(metadata).__name__} as its metadata")
        super().bind_connector_metadata(metadata)
        self._worker.bind(metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, NixlConnectorMetadata)
        self._worker.start_load(meta, empty_step=forward_context.attn_metadata is None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # reads complete between steps (the requests wait for them)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # readers pull from the engine's own blocks; nothing to save

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._worker.get_finished()
        return sending or None, recving or None

    def get_failed_recving(self) -> set[str]:
        return self._worker.get_failed_recving()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self.connector_worker is not None else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.worker_meta()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake_metadata()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # --------------------------------------------------------------- scheduler side
    def validate_kv_transfer_params(self, params: dict[str, Any]) -> None:
        if request_side(params) is Side.DECODE:
            parse_remote(params, self._kv_cache_config.block_size)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build_connector_meta()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def has_pending_work(self) -> bool:
        return self._sched.has_pending_work()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched.set_handshake_metadata(metadata)
