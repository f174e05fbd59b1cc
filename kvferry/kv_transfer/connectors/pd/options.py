"""The options every P/D connector shares (side channel, leases, trust, limits): the
``kv_connector_extra_config`` keys, checked once at start. A transport family adds its own
keys in a subclass (``NixlOptions``, ``MooncakeOptions``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvferry.config import ConfigError

if TYPE_CHECKING:
    from kvferry.config import EngineConfig


@dataclass
class PDOptions:
    """``kv_connector_extra_config`` keys of every P/D connector."""

    # Address of the side channel (handshake, claims, heartbeats) a prefill instance
    # advertises and binds: default kv_ip, and kv_port + worker rank; port 0 picks a free one.
    side_channel_host: str | None = None
    side_channel_port: int | None = None
    # Seconds a prefill instance keeps a finished request's blocks for a reader that has not
    # come yet; each heartbeat or claim from the decode side renews it, up to
    # kv_lease_max_duration seconds in all.
    kv_lease_duration: float = 30.0
    kv_lease_max_duration: float = 600.0
    # Seconds between a decode instance's heartbeats (default: kv_lease_duration / 6).
    heartbeat_interval: float | None = None
    # Seconds to wait for each side-channel answer (handshake, claim).
    handshake_timeout: float = 5.0
    # Seconds after which a READ still in progress counts as failed.
    transfer_timeout: float = 120.0
    # A file holding the deployment secret (else KVFERRY_KV_SECRET_FILE / KVFERRY_KV_SECRET;
    # see kvferry.kv_transfer.secret): authenticates the side channel and signs params.
    secret_file: str | None = None
    # Seconds a side-channel message stays acceptable (clock skew between instances included).
    auth_window: float = 60.0
    # Let the side channel listen beyond loopback without a secret (anyone who reaches it can
    # then read this instance's held KV and release its blocks).
    allow_unauthenticated: bool = False
    # Prefill side: the largest share of the KV pool one reader (engine id and address) may
    # keep claimed or renewed at once; beyond it its claims wait and its renewals are ignored.
    max_reader_share: float = 0.5
    # Decode side: side-channel calls in flight to one prefill instance (address) at once.
    max_peer_inflight: int = 8

    def validate(self, owner: str) -> None:
        if self.side_channel_port is not None and not 0 <= self.side_channel_port < 65536:
            raise ConfigError(
                f"{owner}: side_channel_port must be 0 (pick a free port) or a TCP port, "
                f"got {self.side_channel_port}"
            )
        for name in ("kv_lease_duration", "handshake_timeout", "transfer_timeout", "auth_window"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{owner}: {name} must be a positive number, got {value}")
        if not (self.kv_lease_max_duration >= self.kv_lease_duration):
            raise ConfigError(
                f"{owner}: kv_lease_max_duration ({self.kv_lease_max_duration}) must be at least "
                f"kv_lease_duration ({self.kv_lease_duration})"
            )
        hb = self.heartbeat_interval
        if hb is not None and not (math.isfinite(hb) and 0 < hb < self.kv_lease_duration):
            raise ConfigError(
                f"{owner}: heartbeat_interval must be positive and shorter than "
                f"kv_lease_duration ({self.kv_lease_duration}), got {hb}"
            )
        if not (math.isfinite(self.max_reader_share) and 0 < self.max_reader_share <= 1):
            raise ConfigError(
                f"{owner}: max_reader_share must be in (0, 1], got {self.max_reader_share}"
            )
        if self.max_peer_inflight < 1:
            raise ConfigError(
                f"{owner}: max_peer_inflight must be >= 1, got {self.max_peer_inflight}"
            )

    @property
    def heartbeat_s(self) -> float:
        return self.heartbeat_interval or self.kv_lease_duration / 6

    @property
    def params_lifetime_s(self) -> float:
        """How long signed params stay valid: the longest hold, plus clock skew."""
        return self.kv_lease_max_duration + self.auth_window


def side_channel_address(config: EngineConfig, opts: PDOptions, rank: int) -> tuple[str, int]:
    """The configured side-channel address of worker ``rank`` (port 0: pick a free one)."""
    kvt = config.kv_transfer_config
    assert kvt is not None
    host = opts.side_channel_host or kvt.kv_ip
    port = opts.side_channel_port if opts.side_channel_port is not None else kvt.kv_port + rank
    return host, port
