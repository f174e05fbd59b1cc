"""The scheduler side of the NixlConnector: the shared P/D scheduler (:mod:`..pd.scheduler`)."""

from __future__ import annotations

from kvferry.kv_transfer.connectors.pd.scheduler import PDConnectorScheduler


class NixlConnectorScheduler(PDConnectorScheduler):
    label = "NIXL"
