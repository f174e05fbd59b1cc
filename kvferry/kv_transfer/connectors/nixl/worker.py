"""The worker side of the NixlConnector: the shared P/D worker (:mod:`..pd.worker`) with one
NIXL agent (:class:`~.agent.NixlTransport`) per worker."""

from __future__ import annotations

from kvferry.kv_transfer.connectors.nixl.agent import NixlTransport
from kvferry.kv_transfer.connectors.nixl.options import NixlOptions
from kvferry.kv_transfer.connectors.pd.transport import KVTransport
from kvferry.kv_transfer.connectors.pd.worker import PDConnectorWorker


class NixlConnectorWorker(PDConnectorWorker):
    stats_prefix = "nixl"
    opts: NixlOptions

    def make_transport(self, name: str) -> KVTransport:
        opts = self.opts
        return NixlTransport(
            name,
            opts.backends,
            opts.num_threads,
            progress_interval=opts.progress_interval,
            bind_host=self.host,
        )
