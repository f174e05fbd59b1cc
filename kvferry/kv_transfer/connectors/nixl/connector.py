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
``handshake_timeout`` (5 s), ``transfer_timeout`` (120 s), ``num_threads`` (0),
``secret_file``, ``auth_window`` (60 s), ``allow_unauthenticated`` (false),
``progress_interval`` (0.01 s), ``max_reader_share`` (0.5), ``max_peer_inflight`` (8).

Limits (:mod:`.peers`, :mod:`.lease`): a decode instance keeps side-channel work per prefill
address (host, port, engine id): at most ``max_peer_inflight`` calls to one and 256 in all,
each waiting at most ``handshake_timeout`` for a slot and as long for its answer, so a dead or
forged peer delays only its own reads and releases. A prefill instance lets one reader keep
at most ``max_reader_share`` of its pool claimed or renewed. A release answers once the
prefill side did (or gave up). UCX's progress thread sleeps between events (waking at least
every ``progress_interval``), and UCX listens only on the side-channel host's interface when
that is an address of this machine (unless ``UCX_NET_DEVICES`` is set).

Trust (:mod:`.auth`, docs/security.md): with a deployment secret every side-channel message
is authenticated and replay-protected, and the params a prefill instance issues are signed;
a decode instance refuses unsigned or altered params at intake. Without one the connector
works on loopback only (one warning at start-up) unless ``allow_unauthenticated`` is set.
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
from kvferry.kv_transfer.connectors.nixl.auth import check_exposure, load_peer_auth
from kvferry.kv_transfer.connectors.nixl.metadata import (
    NixlConnectorMetadata,
    NixlOptions,
    side_channel_address,
)
from kvferry.kv_transfer.connectors.nixl.scheduler import NixlConnectorScheduler
from kvferry.kv_transfer.options import parse_options
from kvferry.logger import init_logger

if TYPE_CHECKING:
    import torch

    from kvferry.config import EngineConfig
    from kvferry.core.kv_cache_config import KVCacheConfig
    from kvferry.core.kv_cache_manager import KVCacheBlocks
    from kvferry.kv_transfer.connectors.nixl.worker import NixlConnectorWorker
    from kvferry.model.forward_context import ForwardContext
    from kvferry.request import Request
    from kvferry.step_types.kv_connector_output import KVConnectorOutput
    from kvferry.step_types.scheduler_output import SchedulerOutput

logger = init_logger(__name__)


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
        auth = load_peer_auth(opts)
        host, _ = side_channel_address(config, opts, rank=0)
        check_exposure(host, auth, opts.allow_unauthenticated, name)
        self.connector_scheduler: NixlConnectorScheduler | None = None
        self.connector_worker: NixlConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlConnectorScheduler(
                config, kv_cache_config, opts, engine_id, auth
            )
        else:
            if auth is None:
                logger.warning(
                    "%s: the NIXL side channel on %s is not authenticated and kv_transfer_params "
                    "are not signed: anyone who can reach it can read the KV this instance "
                    "holds; configure a deployment secret (see docs/security.md)",
                    name,
                    host,
                )
            else:
                logger.info("%s: side channel authenticated (secret from %s)", name, auth.source)
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
        self._sched.validate(params)

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
