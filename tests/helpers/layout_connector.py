"""ExampleConnectors that ask for a KV cache layout, for tests, loaded through
``kv_connector_module_path="tests.helpers.layout_connector"``.

:class:`HNDExampleConnector` requires ``"HND"`` (as vLLM's NIXL connector does for
heterogeneous TP) and keeps what ``register_kv_caches`` handed it; :class:`NHDExampleConnector`
requires ``"NHD"``; :class:`OddLayoutConnector` asks for a layout kvferry does not allocate.
"""

from __future__ import annotations

from typing import Any

import torch

from kvferry.kv_transfer.connectors.example_connector import ExampleConnector


class HNDExampleConnector(ExampleConnector):
    registered: dict[str, torch.Tensor] | None = None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return "HND"

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.registered = dict(kv_caches)
        super().register_kv_caches(kv_caches)


class NHDExampleConnector(ExampleConnector):
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return "nhd"  # any case is accepted


class OddLayoutConnector(ExampleConnector):
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return "BLHNC"  # blocks spanning all layers: not allocated by kvferry
