"""MooncakeConnector: prefill/decode disaggregation over Mooncake's transfer engine.

The same P/D machinery as the NixlConnector (:mod:`kvferry.kv_transfer.connectors.pd`: side
channel with handshake and compatibility check, signed ``kv_transfer_params``, claims,
leases and heartbeats, failures reported so ``kv_load_failure_policy`` applies), with
:class:`~.transport.MooncakeTransport` moving the bytes: the decode instance pulls the
prompt's blocks from the prefill instance's registered pool (TCP here, RDMA where present),
and Mooncake's transfer notification tells the prefill side when it may free them.

``kv_transfer_params`` are the NixlConnector's (vLLM's field names) plus vLLM's
MooncakeConnector fields ``transfer_id`` and ``remote_bootstrap_addr``
(:mod:`.scheduler`), so ``kvferry proxy`` runs the same flow for both.

Extra config (``kv_connector_extra_config``): the shared P/D keys (:class:`PDOptions`:
``side_channel_host`` / ``side_channel_port``, ``kv_lease_duration``, ``heartbeat_interval``,
``handshake_timeout``, ``transfer_timeout``, ``secret_file``, ``allow_unauthenticated``,
``max_reader_share``, ``max_peer_inflight``, ...) and Mooncake's (:class:`MooncakeOptions`:
``mooncake_protocol`` ``"tcp"``/``"rdma"``, ``device_name``, ``local_hostname``,
``transfer_threads``).

Trust: kvferry's side channel and params are authenticated as the NixlConnector's are, but
Mooncake's transfer engine itself listens on every interface and serves reads of registered
memory to whoever reaches its ports; keep those ports on a trusted network (docs/security.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.kv_transfer.connectors.mooncake.options import MooncakeOptions
from kvferry.kv_transfer.connectors.mooncake.scheduler import MooncakeConnectorScheduler
from kvferry.kv_transfer.connectors.pd.connector import PDConnector

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.connectors.mooncake.worker import MooncakeConnectorWorker


class MooncakeConnector(PDConnector):
    options_cls = MooncakeOptions
    scheduler_cls = MooncakeConnectorScheduler

    def make_worker(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        opts: MooncakeOptions,
        engine_id: str,
    ) -> MooncakeConnectorWorker:
        # Imported here: the scheduler role never loads Mooncake.
        from kvferry.kv_transfer.connectors.mooncake.worker import MooncakeConnectorWorker

        return MooncakeConnectorWorker(config, kv_cache_config, opts, engine_id)
