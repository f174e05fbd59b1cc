"""Connectors that break the protocol's promises, for the conformance kit's own tests."""

from __future__ import annotations

from typing import Any

from kvferry.kv_transfer.connectors.example_connector import ExampleConnector


class NoLoadConnector(ExampleConnector):
    """Offers its stored prefixes but never writes them into the engine's blocks."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass
