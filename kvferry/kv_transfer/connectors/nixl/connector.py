"""NixlConnector: prefill/decode disaggregation over NIXL (a thin facade).

One class for both P/D roles; which one a request plays is decided per request by its
``kv_transfer_params``: ``do_remote_decode`` on the prefill instance (compute the prompt, hold
its blocks, return where to read them), ``do_remote_prefill`` on the decode instance (read the
prompt's KV from the prefill instance, then decode). A :class:`SplitConnector`: the
scheduler role forwards to :class:`NixlConnectorScheduler`, the worker role to
:class:`NixlConnectorWorker`.

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

from typing import TYPE_CHECKING

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import CacheHitSource, KVConnectorMetadata, KVConnectorRole
from kvferry.kv_transfer.connectors.nixl.auth import check_exposure, load_peer_auth
from kvferry.kv_transfer.connectors.nixl.metadata import (
    NixlConnectorMetadata,
)
from kvferry.kv_transfer.connectors.nixl.options import NixlOptions, side_channel_address
from kvferry.kv_transfer.connectors.nixl.scheduler import NixlConnectorScheduler
from kvferry.kv_transfer.connectors.split import SplitConnector
from kvferry.kv_transfer.options import parse_options
from kvferry.logger import init_logger

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.connectors.nixl.worker import NixlConnectorWorker

logger = init_logger(__name__)


class NixlConnector(SplitConnector[NixlConnectorScheduler, "NixlConnectorWorker"]):
    _cache_hit_source = CacheHitSource.P2P  # a peer engine's KV
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
        if role == KVConnectorRole.SCHEDULER:
            self.set_scheduler_half(
                NixlConnectorScheduler(config, kv_cache_config, opts, engine_id, auth)
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

            self.set_worker_half(NixlConnectorWorker(config, kv_cache_config, opts, engine_id))

    @property
    def connector_scheduler(self) -> NixlConnectorScheduler | None:
        return self._scheduler_half

    @property
    def connector_worker(self) -> NixlConnectorWorker | None:
        return self._worker_half

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, NixlConnectorMetadata):
            raise TypeError(f"NixlConnector got {type(metadata).__name__} as its metadata")
        super().bind_connector_metadata(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        return sending or None, recving or None
