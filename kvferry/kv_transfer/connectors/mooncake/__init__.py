"""MooncakeConnector: prefill/decode disaggregation over Mooncake's transfer engine (see
:mod:`.connector`)."""

from kvferry.kv_transfer.connectors.mooncake.connector import MooncakeConnector

__all__ = ["MooncakeConnector"]
