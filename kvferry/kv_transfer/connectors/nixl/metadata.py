"""Options of the NIXL connector and the plain data its two roles exchange.

Scheduler -> worker, every step: :class:`NixlConnectorMetadata` (reads to start, blocks to
hold for readers, releases and heartbeats to send). Worker -> scheduler, every step:
:class:`NixlWorkerMeta` (the side-channel address a prefill instance advertises, which the
scheduler only knows in advance when the port is configured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

if TYPE_CHECKING:
    from kvferry.config import EngineConfig


@dataclass
class NixlOptions:
    """``kv_connector_extra_config`` keys of the NixlConnector."""

    # NIXL backends to create, in order of preference.
    backends: list[str] = field(default_factory=lambda: ["UCX"])
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
    # Progress threads of the backend (0: NIXL's default).
    num_threads: int = 0

    def validate(self, owner: str) -> None:
        if not self.backends or not all(isinstance(b, str) and b for b in self.backends):
            raise ConfigError(f"{owner}: backends must be a non-empty list of backend names")
        if self.side_channel_port is not None and not 0 <= self.side_channel_port < 65536:
            raise ConfigError(
                f"{owner}: side_channel_port must be 0 (pick a free port) or a TCP port, "
                f"got {self.side_channel_port}"
            )
        for name in ("kv_lease_duration", "handshake_timeout", "transfer_timeout"):
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
        if self.num_threads < 0:
            raise ConfigError(f"{owner}: num_threads must be >= 0, got {self.num_threads}")

    @property
    def heartbeat_s(self) -> float:
        return self.heartbeat_interval or self.kv_lease_duration / 6


def side_channel_address(config: EngineConfig, opts: NixlOptions, rank: int) -> tuple[str, int]:
    """The configured side-channel address of worker ``rank`` (port 0: pick a free one)."""
    kvt = config.kv_transfer_config
    assert kvt is not None
    host = opts.side_channel_host or kvt.kv_ip
    port = opts.side_channel_port if opts.side_channel_port is not None else kvt.kv_port + rank
    return host, port


class RemoteRef(msgspec.Struct, frozen=True):
    """A request held by a prefill instance, and where that instance's side channel is."""

    engine_id: str
    host: str
    port: int
    request_id: str


class RecvSpec(msgspec.Struct, frozen=True):
    """Decode request ``req_id`` reads its prompt's KV from ``remote``: the worker claims all
    of ``remote_block_ids`` (the prompt's ``num_tokens`` tokens, whose digest is
    ``token_digest``) and reads ``remote_block_ids[first_block:]`` into ``local_block_ids``
    (the blocks before ``first_block`` were a local prefix-cache hit). With ``error`` set the
    params were invalid: the worker reports the load failed at once and contacts nobody."""

    req_id: str
    remote: RemoteRef | None
    remote_block_ids: list[int]
    local_block_ids: list[int]
    num_tokens: int
    token_digest: str
    first_block: int = 0
    error: str | None = None


class SendSpec(msgspec.Struct, frozen=True):
    """Hold ``block_ids`` (the first ``num_tokens`` prompt tokens of ``req_id``) for a reader."""

    req_id: str
    block_ids: list[int]
    num_tokens: int
    token_digest: str


class ReleaseSpec(msgspec.Struct, frozen=True):
    """Tell a prefill instance it may free what it holds for ``remote``: the decode request
    that named it ended without reading."""

    remote: RemoteRef
    block_ids: list[int]


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: list[RecvSpec] = field(default_factory=list)
    reqs_to_send: list[SendSpec] = field(default_factory=list)
    # Prefill requests admitted this step: a reader that claims one of them before its hold
    # is registered is told to retry instead of "unknown request".
    expected_sends: list[str] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
    # Remote requests this decode instance is about to read (admission pending): renew them.
    heartbeats: list[RemoteRef] = field(default_factory=list)


@dataclass
class NixlWorkerMeta(KVConnectorWorkerMetadata):
    """Side-channel address per worker rank: ``rank -> (host, port)``."""

    addresses: dict[int, tuple[str, int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, NixlWorkerMeta):
            self.addresses.update(other.addresses)
        return self


@dataclass
class NixlHandshakeMetadata(KVConnectorHandshakeMetadata):
    engine_id: str
    rank: int
    host: str
    port: int
    agent_name: str
