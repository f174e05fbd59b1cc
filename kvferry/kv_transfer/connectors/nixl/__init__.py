"""NixlConnector: prefill/decode disaggregation over NIXL (see :mod:`.connector`)."""

from kvferry.kv_transfer.connectors.nixl.connector import NixlConnector

__all__ = ["NixlConnector"]
