"""The side channel between a decode instance and a prefill instance (ZeroMQ, msgpack): one
import for the whole protocol, whose parts live in :mod:`.messages` (what is said),
:mod:`.codec` (how a frame is sealed and opened) and :mod:`.sidechannel` (how it travels).

Every frame is an :class:`Envelope`: the sender's compatibility hash and a readable summary of
what it hashes, around an opaque body, and (with a deployment secret, :mod:`.auth`) a
timestamp, a nonce and a MAC over all of it. The receiver decodes the envelope, checks the
MAC and freshness, then the hash, and only then decodes the body into one of the typed
messages. Anything malformed, oversized, unauthenticated or from an incompatible peer
changes no state; the peer learns only that it was refused (the details go to the local
log). Nothing is ever unpickled.

Requests (decode -> prefill): :class:`HandshakeRequest` (answered with :class:`AgentInfo`:
the transport's metadata and the KV pool layout), :class:`ClaimRequest` (answered with
:class:`Granted` when the prefill instance holds exactly those blocks for that prompt),
:class:`HeartbeatRequest` (answered with :class:`Renewed`) and :class:`ReleaseRequest`
(answered with :class:`Ack`). With a secret, claims and releases carry the signed params
they act on (:class:`ParamsProof`), checked before the request is handled.
Any request may be answered with :class:`Refused` (``retry`` says whether asking again later
may succeed).
"""

from __future__ import annotations

from kvferry.kv_transfer.connectors.pd.codec import (
    Codec,
    Compat,
    IncompatiblePeer,
    ProtocolError,
    Unauthenticated,
)
from kvferry.kv_transfer.connectors.pd.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Address,
    AgentInfo,
    AgentName,
    ClaimRequest,
    Count,
    Digest,
    Envelope,
    Granted,
    HandshakeRequest,
    HeartbeatRequest,
    PeerReply,
    PeerRequest,
    ReadDone,
    Redirect,
    Refused,
    ReleaseRequest,
    Renewed,
    Seconds,
)
from kvferry.kv_transfer.connectors.pd.params import ParamsProof
from kvferry.kv_transfer.connectors.pd.sidechannel import (
    PeerUnreachable,
    SideChannelServer,
    call,
    endpoint,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "Ack",
    "Address",
    "AgentInfo",
    "AgentName",
    "ClaimRequest",
    "Redirect",
    "Codec",
    "Compat",
    "Count",
    "Digest",
    "Envelope",
    "Granted",
    "HandshakeRequest",
    "HeartbeatRequest",
    "IncompatiblePeer",
    "ParamsProof",
    "PeerReply",
    "PeerRequest",
    "PeerUnreachable",
    "ProtocolError",
    "ReadDone",
    "Refused",
    "ReleaseRequest",
    "Renewed",
    "Seconds",
    "SideChannelServer",
    "Unauthenticated",
    "call",
    "endpoint",
]
