"""KVTransferConfig: which KV connector runs and how (names and defaults as in vLLM), with the
roles and load-failure policies it accepts."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from kvferry.config.errors import ConfigError
from kvferry.config.json_object import from_json_object, parse_json

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


def check_kv_load_failure_policy(policy: str) -> None:
    if policy not in KV_LOAD_FAILURE_POLICIES:
        raise ConfigError(
            f"kv_load_failure_policy {policy!r} is not one of {', '.join(KV_LOAD_FAILURE_POLICIES)}"
        )


@dataclass
class KVTransferConfig:
    """Turns on a KV connector and configures it (names and defaults as in vLLM)."""

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cpu"
    kv_buffer_size: float = 1e9
    kv_role: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: str = "fail"

    def __post_init__(self) -> None:
        import uuid

        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        if self.kv_connector is not None and self.kv_role is None:
            raise ConfigError(
                f"kv_role is required with kv_connector={self.kv_connector!r}; "
                f"use one of {', '.join(KV_ROLES)}"
            )
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role {self.kv_role!r} is not one of {', '.join(KV_ROLES)}")
        check_kv_load_failure_policy(self.kv_load_failure_policy)
        if self.kv_connector_module_path == "":
            raise ConfigError("kv_connector_module_path must not be empty")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("kv_connector_extra_config must be a JSON object")
        if not 0 < self.kv_port < 65536:
            raise ConfigError(f"kv_port must be a TCP port, got {self.kv_port}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVTransferConfig:
        return from_json_object(cls, data, "KV transfer config")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        return cls.from_dict(parse_json(text, "--kv-transfer-config"))

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_ROLES

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any = None) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    def has_connector(self, name: str) -> bool:
        """Whether connector ``name`` runs: as ``kv_connector``, or as a child of a
        ``MultiConnector`` (``kv_connector_extra_config["connectors"]``, nested ones too)."""
        if self.kv_connector == name:
            return True
        if self.kv_connector != "MultiConnector":
            return False
        children = self.kv_connector_extra_config.get("connectors") or []
        return any(
            isinstance(child, dict)
            and (
                child.get("kv_connector") == name
                or (
                    child.get("kv_connector") == "MultiConnector"
                    and KVTransferConfig(
                        kv_connector="MultiConnector",
                        kv_role=self.kv_role,
                        kv_connector_extra_config=child.get("kv_connector_extra_config") or {},
                    ).has_connector(name)
                )
            )
            for child in children
        )

    def compute_hash(self) -> str:
        """The config's contribution to a compiled-graph cache key: none (as in vLLM, the KV
        transfer settings do not change the computation graph), so a constant digest."""
        factors: list[Any] = []
        return hashlib.sha256(str(factors).encode()).hexdigest()
