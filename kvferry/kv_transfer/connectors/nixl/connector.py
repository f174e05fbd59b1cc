"""NixlConnector: prefill/decode disaggregation over NIXL (a thin facade over the shared P/D
machinery in :mod:`kvferry.kv_transfer.connectors.pd`, with :class:`~.agent.NixlTransport`).

One class for both P/D roles; which one a request plays is decided per request by its
``kv_transfer_params``: ``do_remote_decode`` on the prefill instance (compute the prompt, hold
its blocks, return where to read them), ``do_remote_prefill`` on the decode instance (read the
prompt's KV from the prefill instance, then decode). A :class:`SplitConnector`: the
scheduler role forwards to :class:`NixlConnectorScheduler`, the worker role to
:class:`NixlConnectorWorker` (both the shared P/D halves).

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

Hybrid models (several KV cache groups, docs/hybrid_kv.md): ``remote_block_ids`` holds one
list per group; a sliding-window group sends only the blocks in its window at the prompt's
end, null blocks never travel. The compatibility hash covers the group structure.

Trust (:mod:`.auth`, docs/security.md): with a deployment secret every side-channel message
is authenticated and replay-protected, and the params a prefill instance issues are signed;
a decode instance refuses unsigned or altered params at intake. Without one the connector
works on loopback only (one warning at start-up) unless ``allow_unauthenticated`` is set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.kv_transfer.base import SupportsHMA
from kvferry.kv_transfer.connectors.nixl.options import NixlOptions
from kvferry.kv_transfer.connectors.nixl.scheduler import NixlConnectorScheduler
from kvferry.kv_transfer.connectors.pd.connector import PDConnector

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.connectors.nixl.worker import NixlConnectorWorker
    from kvferry.request import Request


class NixlConnector(PDConnector, SupportsHMA):
    """Hybrid models (SupportsHMA): the params carry one block list per KV cache group, a
    sliding-window group's only the blocks in the window of the last prompt token; the
    decode instance reads every group's blocks in one transfer (the groups' layers share
    the KV tensors, a block belongs to one group at a time)."""

    options_cls = NixlOptions
    scheduler_cls = NixlConnectorScheduler

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        half = self._scheduler_side("request_finished_all_groups")
        return half.request_finished_all_groups(request, block_ids)

    def make_worker(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        opts: NixlOptions,
        engine_id: str,
    ) -> NixlConnectorWorker:
        # Imported here: the scheduler role never loads NIXL.
        from kvferry.kv_transfer.connectors.nixl.worker import NixlConnectorWorker

        return NixlConnectorWorker(config, kv_cache_config, opts, engine_id)
