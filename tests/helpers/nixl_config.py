"""The smallest engine config a NixlConnector can be built from, without an engine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvferry.config import KVTransferConfig


def nixl_engine_config(engine_id: str, host: str | None = None, **extra: Any) -> Any:
    """What a NixlConnector reads of an EngineConfig: its KV transfer config (a side channel
    on a free port, plus ``extra`` options), a two-layer Llama model folder name and TP 1."""
    kvt = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_both",
        engine_id=engine_id,
        kv_connector_extra_config={"side_channel_port": 0, **extra},
        **({"kv_ip": host} if host is not None else {}),
    )
    arch = SimpleNamespace(architecture="LlamaForCausalLM", layers=2)
    return SimpleNamespace(
        kv_transfer_config=kvt,
        model_config=SimpleNamespace(model="/m/tiny", arch=arch),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
