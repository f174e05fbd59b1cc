"""The worker side of the MooncakeConnector: the shared P/D worker (:mod:`..pd.worker`) with
one Mooncake transfer engine (:class:`~.transport.MooncakeTransport`) per worker."""

from __future__ import annotations

from kvferry.kv_transfer.connectors.mooncake.options import MooncakeOptions
from kvferry.kv_transfer.connectors.mooncake.transport import MooncakeTransport
from kvferry.kv_transfer.connectors.pd.transport import KVTransport
from kvferry.kv_transfer.connectors.pd.worker import PDConnectorWorker


class MooncakeConnectorWorker(PDConnectorWorker):
    stats_prefix = "mooncake"
    compat_transport = "mooncake"
    opts: MooncakeOptions

    def make_transport(self, name: str) -> KVTransport:
        opts = self.opts
        return MooncakeTransport(
            name,
            opts.local_hostname or self.host,
            opts.mooncake_protocol,
            opts.device_name,
            opts.transfer_threads,
        )
