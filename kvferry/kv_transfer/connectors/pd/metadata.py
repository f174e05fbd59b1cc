"""The plain data a P/D connector's two roles exchange (NIXL and Mooncake alike).

Scheduler -> worker, every step: :class:`PDConnectorMetadata` (reads to start, blocks to
hold for readers, releases and heartbeats to send). Worker -> scheduler, every step:
:class:`PDWorkerMeta` (the side-channel address a prefill instance advertises, which the
scheduler only knows in advance when the port is configured).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvferry.kv_transfer.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from kvferry.kv_transfer.connectors.pd.params import ParamsProof


class RemoteRef(msgspec.Struct, frozen=True):
    """A request held by a prefill instance, and where that instance's side channel is (its
    rank 0's); ``proof``: the signed params that named it (with a deployment secret);
    ``tp_size``: the prefill instance's tensor-parallel size."""

    engine_id: str
    host: str
    port: int
    request_id: str
    proof: ParamsProof | None = None
    tp_size: int = 1


class RecvSpec(msgspec.Struct, frozen=True):
    """Decode request ``req_id`` reads its prompt's KV from ``remote``: the worker claims all
    of ``remote_block_ids`` (the prompt's ``num_tokens`` tokens, whose digest is
    ``token_digest``) and reads ``remote_block_ids[first_block:]`` into ``local_block_ids``
    (the blocks before ``first_block`` were a local prefix-cache hit), or, when
    ``read_block_ids`` is set (hybrid engines: every group's blocks, group after group),
    those remote blocks. With ``error`` set the params were invalid: the worker reports the
    load failed at once and contacts nobody."""

    req_id: str
    remote: RemoteRef | None
    remote_block_ids: list[int]
    local_block_ids: list[int]
    num_tokens: int
    token_digest: str
    first_block: int = 0
    error: str | None = None
    read_block_ids: list[int] | None = None

    def remote_ids_to_read(self) -> list[int]:
        """The remote blocks read into ``local_block_ids``, in the same order."""
        if self.read_block_ids is not None:
            return self.read_block_ids
        return self.remote_block_ids[self.first_block :]


class SendSpec(msgspec.Struct, frozen=True):
    """Hold ``block_ids`` (the first ``num_tokens`` prompt tokens of ``req_id``) for a reader."""

    req_id: str
    block_ids: list[int]
    num_tokens: int
    token_digest: str


class ReleaseSpec(msgspec.Struct, frozen=True):
    """Tell a prefill instance it may free what it holds for ``remote``: the decode request
    that named it ended without reading. With ``req_id`` that request's free waits for the
    release: the workers report it ``finished_sending`` once the prefill side answered (or
    the release was given up after a bounded time)."""

    remote: RemoteRef
    block_ids: list[int]
    req_id: str | None = None


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: list[RecvSpec] = field(default_factory=list)
    reqs_to_send: list[SendSpec] = field(default_factory=list)
    # Prefill requests admitted this step: a reader that claims one of them before its hold
    # is registered is told to retry instead of "unknown request".
    expected_sends: list[str] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
    # Remote requests this decode instance is about to read (admission pending): renew them.
    heartbeats: list[RemoteRef] = field(default_factory=list)


@dataclass
class PDWorkerMeta(KVConnectorWorkerMetadata):
    """Side-channel address per worker rank: ``rank -> (host, port)``."""

    addresses: dict[int, tuple[str, int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PDWorkerMeta):
            self.addresses.update(other.addresses)
        return self


@dataclass
class PDHandshakeMetadata(KVConnectorHandshakeMetadata):
    engine_id: str
    rank: int
    host: str
    port: int
    agent_name: str
