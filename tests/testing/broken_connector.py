"""Connectors that break the protocol's promises, for the conformance kit's own tests."""

from __future__ import annotations

import os
from typing import Any

from kvferry.kv_transfer.connectors.example_connector import ExampleConnector


class NoLoadConnector(ExampleConnector):
    """Offers its stored prefixes but never writes them into the engine's blocks."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass


class NoisyConnector(ExampleConnector):
    """Writes a log line straight to file descriptor 1, as C++ transport libraries do."""

    def register_kv_caches(self, kv_caches: Any) -> None:
        os.write(1, b"I1201 12:00:00.000000 transport.cpp:1] a native log line\n")
        super().register_kv_caches(kv_caches)
