"""The side channel's messages: the envelope every frame travels in, the typed requests and
replies inside it, and the READ-completion notification (msgspec structs, never pickles).

Requests (decode -> prefill): :class:`HandshakeRequest` (answered with :class:`AgentInfo`),
:class:`ClaimRequest` (answered with :class:`Granted`), :class:`HeartbeatRequest` (answered
with :class:`Renewed`) and :class:`ReleaseRequest` (answered with :class:`Ack`); any of them
may be answered with :class:`Refused`. Bump :data:`PROTOCOL_VERSION` on any change here.
"""

from __future__ import annotations

import struct
from typing import Annotated, Literal, Union

import msgspec

from kvferry.kv_transfer.connectors.pd.auth import MAC_BYTES, NONCE_BYTES
from kvferry.kv_transfer.connectors.pd.params import (
    MAX_BLOCKS,
    MAX_ID_LEN,
    BlockIds,
    EngineId,
    Host,
    NumTokens,
    ParamsProof,
    RequestId,
)

# Bump on any change of the messages or of their meaning.
PROTOCOL_VERSION = 5
MAX_MESSAGE_BYTES = 8 << 20

Digest = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
AgentName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Address = Annotated[int, msgspec.Meta(ge=1)]


class Envelope(msgspec.Struct, array_like=True, frozen=True):
    """One frame. ``sent_at`` (sender's wall clock), ``nonce``, ``reply_to`` (a reply: the
    request's nonce) and ``mac`` are set when the sender holds the deployment secret. Replies
    carry no description, refusals not even the hash."""

    compat_hash: Annotated[str, msgspec.Meta(max_length=64)]
    compat_desc: Annotated[str, msgspec.Meta(max_length=1024)]
    body: bytes
    sent_at: float = 0.0
    nonce: Annotated[bytes, msgspec.Meta(max_length=NONCE_BYTES)] = b""
    reply_to: Annotated[bytes, msgspec.Meta(max_length=NONCE_BYTES)] = b""
    mac: Annotated[bytes, msgspec.Meta(max_length=MAC_BYTES)] = b""

    def signed_parts(self) -> tuple[bytes, ...]:
        return (
            self.compat_hash.encode(),
            self.compat_desc.encode(),
            self.body,
            struct.pack("<d", self.sent_at),
            self.nonce,
            self.reply_to,
        )


class HandshakeRequest(msgspec.Struct, tag="handshake", frozen=True, forbid_unknown_fields=True):
    engine_id: EngineId  # the engine the reader expects to find there
    rank: Count


class ClaimRequest(msgspec.Struct, tag="claim", frozen=True, forbid_unknown_fields=True):
    engine_id: EngineId
    request_id: RequestId
    block_ids: BlockIds
    num_tokens: NumTokens
    token_digest: Digest
    reader_engine_id: EngineId
    reader_agent: AgentName
    proof: ParamsProof | None = None  # the signed params named (with a deployment secret)
    # How many ranks of the reader engine read this rank's blocks (its TP over ours, or 1):
    # the hold ends once each of them completed its READ.
    readers: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1


class HeartbeatRequest(msgspec.Struct, tag="heartbeat", frozen=True, forbid_unknown_fields=True):
    engine_id: EngineId
    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=1 << 16)]
    reader_engine_id: EngineId


class ReleaseRequest(msgspec.Struct, tag="release", frozen=True, forbid_unknown_fields=True):
    engine_id: EngineId
    request_id: RequestId
    block_ids: BlockIds
    reader_engine_id: EngineId
    proof: ParamsProof | None = None


class AgentInfo(msgspec.Struct, tag="agent", frozen=True, forbid_unknown_fields=True):
    engine_id: EngineId
    agent_name: AgentName
    agent_metadata: Annotated[bytes, msgspec.Meta(min_length=1, max_length=4 << 20)]
    rank: Count
    tp_size: Count
    block_size: Count
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
    block_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 34)]
    mem_type: Literal["DRAM", "VRAM"]
    device_id: Count
    base_addrs: Annotated[list[Address], msgspec.Meta(min_length=1, max_length=4096)]
    # The pool's memory order inside a block (vLLM's kv_cache_layout in NIXL's metadata):
    # checked at the handshake, not in the compatibility hash, so that different layouts
    # can pair (see .layout_match).
    kv_cache_layout: Literal["NHD", "HND"] = "NHD"


Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e7)]


class Redirect(msgspec.Struct, tag="redirect", frozen=True, forbid_unknown_fields=True):
    """Answer to a handshake for another tensor-parallel rank: that rank's side channel (each
    rank of a prefill engine serves its own KV heads; rank 0's address is in the params)."""

    rank: Count
    host: Host
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]


class Granted(msgspec.Struct, tag="granted", frozen=True, forbid_unknown_fields=True):
    agent_name: AgentName
    expires_in: Seconds  # the hold lasts at least this long after the claim was received


class Renewed(msgspec.Struct, tag="renewed", frozen=True, forbid_unknown_fields=True):
    """Answer to a heartbeat: the requests still held (seconds each has left), and those whose
    hold ended because this reader's READ completed (freed after the data was read)."""

    held: Annotated[dict[RequestId, Seconds], msgspec.Meta(max_length=1 << 16)]
    read: Annotated[list[RequestId], msgspec.Meta(max_length=1 << 16)]


class Ack(msgspec.Struct, tag="ack", frozen=True, forbid_unknown_fields=True):
    count: Count


class Refused(msgspec.Struct, tag="refused", frozen=True, forbid_unknown_fields=True):
    reason: Annotated[str, msgspec.Meta(max_length=2048)]
    retry: bool = False


PeerRequest = Union[HandshakeRequest, ClaimRequest, HeartbeatRequest, ReleaseRequest]
PeerReply = Union[AgentInfo, Redirect, Granted, Renewed, Ack, Refused]
assert MAX_BLOCKS * 6 < MAX_MESSAGE_BYTES  # a claim of the most blocks still fits


class ReadDone(msgspec.Struct, array_like=True, frozen=True):
    """The notification a reader attaches to its READ (delivered after the data); with
    a deployment secret it carries a MAC, so nobody else can end a hold early."""

    engine_id: EngineId
    request_id: RequestId
    reader_engine_id: EngineId
    mac: Annotated[bytes, msgspec.Meta(max_length=MAC_BYTES)] = b""

    def signed_parts(self) -> tuple[bytes, ...]:
        return (self.engine_id.encode(), self.request_id.encode(), self.reader_engine_id.encode())
