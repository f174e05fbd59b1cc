"""MooncakeConnector's options: the shared P/D keys (:class:`PDOptions`) and Mooncake's own."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.config import ConfigError
from kvferry.kv_transfer.connectors.pd.options import PDOptions

_PROTOCOLS = ("tcp", "rdma")


@dataclass
class MooncakeOptions(PDOptions):
    """``kv_connector_extra_config`` keys of the MooncakeConnector."""

    # Mooncake's transport (vLLM's key name): "tcp", or "rdma" where the machine has RDMA NICs.
    mooncake_protocol: str = "tcp"
    # RDMA devices for the transfer engine (e.g. "mlx5_0,mlx5_1"; empty: let Mooncake choose).
    device_name: str = ""
    # The address the transfer engine announces to peers (default: the side-channel host).
    local_hostname: str | None = None
    # Threads running transfers; each READ in flight holds one while it runs.
    transfer_threads: int = 4

    def validate(self, owner: str) -> None:
        super().validate(owner)
        if self.mooncake_protocol not in _PROTOCOLS:
            raise ConfigError(
                f"{owner}: mooncake_protocol must be one of {list(_PROTOCOLS)}, "
                f"got {self.mooncake_protocol!r}"
            )
        if self.local_hostname is not None and not self.local_hostname:
            raise ConfigError(f"{owner}: local_hostname must not be empty")
        if not 1 <= self.transfer_threads <= 256:
            raise ConfigError(
                f"{owner}: transfer_threads must be between 1 and 256, got {self.transfer_threads}"
            )
