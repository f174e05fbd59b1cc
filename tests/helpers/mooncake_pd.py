"""MooncakeConnector configs for the P/D tests: the same shapes as the NIXL helpers
(``nixl_config.nixl_engine_config``, ``nixl_instance.nixl_kv``) with the Mooncake connector."""

from __future__ import annotations

from typing import Any

from tests.helpers.nixl_config import nixl_engine_config
from tests.helpers.nixl_instance import nixl_kv


def mooncake_engine_config(engine_id: str, host: str | None = None, **extra: Any) -> Any:
    """What a MooncakeConnector reads of an EngineConfig (see ``nixl_engine_config``)."""
    config = nixl_engine_config(engine_id, host, **extra)
    config.kv_transfer_config.kv_connector = "MooncakeConnector"
    return config


def mooncake_kv(role: str, policy: str = "fail", **extra: Any) -> dict[str, Any]:
    """A harness instance's kv_transfer_config: ``nixl_kv``'s timings, MooncakeConnector."""
    return {**nixl_kv(role, policy, **extra), "kv_connector": "MooncakeConnector"}
