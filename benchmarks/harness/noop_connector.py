"""A connector that does nothing: what the protocol alone costs the engine.

Loaded by module path (``benchmarks.harness.noop_connector``), like an out-of-tree connector,
so its row in ``benchmarks/connector_bench.py`` counts every engine-side cost of having a
connector configured (metadata every step, the per-layer hook calls, the connector output)
and nothing a real connector adds by storing or loading KV.
"""

from __future__ import annotations

from typing import Any

from kvferry.kv_transfer.base import KVConnectorBase, KVConnectorMetadata


class NoOpConnector(KVConnectorBase):
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
