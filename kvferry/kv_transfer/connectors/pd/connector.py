"""PDConnector: the facade every P/D connector shares (NixlConnector, MooncakeConnector).

One class for both P/D roles; which one a request plays is decided per request by its
``kv_transfer_params``: ``do_remote_decode`` on the prefill instance (compute the prompt, hold
its blocks, return where to read them), ``do_remote_prefill`` on the decode instance (read the
prompt's KV from the prefill instance, then decode). A :class:`SplitConnector`: the
scheduler role forwards to a :class:`PDConnectorScheduler`, the worker role to a
:class:`~.worker.PDConnectorWorker` subclass that builds the family's transport.

One transfer, end to end::

    P scheduler  request_finished -> hold the prompt's blocks, return the params (delayed free)
    P worker     hold registered in the lease table (lease: kv_lease_duration)
    D scheduler  async external hit for the whole prompt -> blocks allocated -> RecvSpec
    D worker     side channel: handshake (once per engine: compat hash, engine id, layout),
                 claim (exact blocks + prompt digest; renews the lease; one reader only)
                 transport READ with a completion notification; heartbeats while it runs
    P worker     notification from the claiming reader -> finished_sending -> blocks freed
    D worker     READ done, and P provably held the blocks until then -> finished_recving

Failures (bad params, handshake refused or unanswered, claim refused, transfer error or
timeout, peer gone, lease possibly expired mid-read) end the read as finished *and* failed,
so the scheduler applies ``kv_load_failure_policy``. A prefill instance frees held blocks on
the notification, on a release from the decode side (a decode request that ended unread, or
the server's release path), or when the lease runs out.

Options shared by every family: :class:`~.options.PDOptions`; trust: :mod:`.auth`
(docs/security.md); limits: :mod:`.peers`, :mod:`.lease`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import (
    CacheHitSource,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from kvferry.kv_transfer.connectors.pd.auth import check_exposure, load_peer_auth
from kvferry.kv_transfer.connectors.pd.metadata import PDConnectorMetadata
from kvferry.kv_transfer.connectors.pd.options import PDOptions, side_channel_address
from kvferry.kv_transfer.connectors.pd.scheduler import PDConnectorScheduler
from kvferry.kv_transfer.connectors.split import SplitConnector
from kvferry.kv_transfer.options import parse_options
from kvferry.logger import init_logger

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.connectors.pd.worker import PDConnectorWorker

logger = init_logger(__name__)


class PDConnector(SplitConnector[PDConnectorScheduler, "PDConnectorWorker"]):
    """A family sets :attr:`options_cls` and :attr:`scheduler_cls` and builds its worker half
    in :meth:`make_worker` (importing its transport there: the scheduler role never loads
    the transfer library)."""

    _cache_hit_source = CacheHitSource.P2P  # a peer engine's KV
    # Extra-config keys a subclass consumes itself (not options of the family).
    subclass_options: tuple[str, ...] = ()
    options_cls: ClassVar[type[PDOptions]] = PDOptions
    scheduler_cls: ClassVar[type[PDConnectorScheduler]] = PDConnectorScheduler

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        name = type(self).__name__
        opts = parse_options(
            self.options_cls,
            self._kv_transfer_config.kv_connector_extra_config,
            name,
            ignore=self.subclass_options,
        )
        if len(kv_cache_config.groups) != 1 and not isinstance(self, SupportsHMA):
            raise ConfigError(f"{name} supports one KV cache group")
        engine_id = self._kv_transfer_config.engine_id
        assert engine_id is not None
        auth = load_peer_auth(opts)
        host, _ = side_channel_address(config, opts, rank=0)
        check_exposure(host, auth, opts.allow_unauthenticated, name)
        if role == KVConnectorRole.SCHEDULER:
            self.set_scheduler_half(
                self.scheduler_cls(config, kv_cache_config, opts, engine_id, auth)
            )
        else:
            if auth is None:
                logger.warning(
                    "%s: the P/D side channel on %s is not authenticated and kv_transfer_params "
                    "are not signed: anyone who can reach it can read the KV this instance "
                    "holds; configure a deployment secret (see docs/security.md)",
                    name,
                    host,
                )
            else:
                logger.info("%s: side channel authenticated (secret from %s)", name, auth.source)
            self.set_worker_half(self.make_worker(config, kv_cache_config, opts, engine_id))

    def make_worker(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        opts: Any,
        engine_id: str,
    ) -> PDConnectorWorker:
        raise NotImplementedError

    @property
    def connector_scheduler(self) -> PDConnectorScheduler | None:
        return self._scheduler_half

    @property
    def connector_worker(self) -> PDConnectorWorker | None:
        return self._worker_half

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, PDConnectorMetadata):
            raise TypeError(f"{type(self).__name__} got {type(metadata).__name__} as its metadata")
        super().bind_connector_metadata(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        return sending or None, recving or None
