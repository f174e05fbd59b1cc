"""The side channel between a decode instance and a prefill instance (ZeroMQ, msgpack).

Every frame is an :class:`Envelope`: the sender's compatibility hash and a readable summary of
what it hashes, around an opaque body, and (with a deployment secret, :mod:`.auth`) a
timestamp, a nonce and a MAC over all of it. The receiver decodes the envelope, checks the
MAC and freshness, then the hash, and only then decodes the body into one of the typed
messages below. Anything malformed, oversized, unauthenticated or from an incompatible peer
changes no state; the peer learns only that it was refused (the details go to the local
log). Nothing is ever unpickled.

Requests (decode -> prefill): :class:`HandshakeRequest` (answered with :class:`AgentInfo`:
the NIXL agent metadata and the KV pool layout), :class:`ClaimRequest` (answered with
:class:`Granted` when the prefill instance holds exactly those blocks for that prompt),
:class:`HeartbeatRequest` (answered with :class:`Renewed`) and :class:`ReleaseRequest`
(answered with :class:`Ack`). With a secret, claims and releases carry the signed params
they act on (:class:`ParamsProof`), checked before the request is handled.
Any request may be answered with :class:`Refused` (``retry`` says whether asking again later
may succeed).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Union

import msgspec
import zmq

from kvferry.kv_transfer.connectors.nixl.auth import (
    MAC_BYTES,
    NONCE_BYTES,
    NOTIF_DOMAIN,
    EnvelopeAuth,
    NotAuthenticated,
    PeerAuth,
)
from kvferry.kv_transfer.connectors.nixl.params import (
    MAX_BLOCKS,
    MAX_ID_LEN,
    BlockIds,
    EngineId,
    NumTokens,
    ParamsProof,
    RequestId,
)

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig

logger = logging.getLogger(__name__)

# Bump on any change of the messages or of their meaning.
PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 8 << 20

Digest = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
AgentName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Address = Annotated[int, msgspec.Meta(ge=1)]


class ProtocolError(RuntimeError):
    """A peer message that cannot be accepted (malformed, oversized, unexpected). ``public``
    is what the peer is told, when that must be less than the message."""

    public: str | None = None


class IncompatiblePeer(ProtocolError):
    """The peer runs another model (or weights), dtype, KV layout or protocol version."""

    public = "incompatible"


class Unauthenticated(ProtocolError):
    """A message without valid proof that a holder of the deployment secret sent it."""

    public = "not authenticated"


class PeerUnreachable(RuntimeError):
    """No answer from the peer's side channel in time."""


@dataclass(frozen=True)
class Compat:
    """What two instances must share to exchange KV blocks, and its hash."""

    desc: str

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.desc.encode()).hexdigest()[:32]

    @staticmethod
    def of(config: EngineConfig, kv_cache_config: KVCacheConfig) -> Compat:
        from kvferry.model.fingerprint import weights_fingerprint
        from kvferry.version import __version__

        mc = config.model_config
        arch = hashlib.sha256(repr(mc.arch).encode()).hexdigest()[:12]
        g = kv_cache_config.groups[0]
        layout = (
            f"kv2xNxB{g.block_size}xH{g.num_kv_heads}xD{g.head_dim}"
            f"xL{len(kv_cache_config.layer_names)}"
        )
        dtype = str(g.dtype).removeprefix("torch.")
        return Compat(
            f"model={Path(mc.model).name}/{mc.arch.architecture}/{arch} "
            f"weights={weights_fingerprint(mc.model)} dtype={dtype} "
            f"layout={layout} tp={config.parallel_config.tensor_parallel_size} "
            f"protocol={PROTOCOL_VERSION} kvferry={__version__}"
        )


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


Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e7)]


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
PeerReply = Union[AgentInfo, Granted, Renewed, Ack, Refused]
assert MAX_BLOCKS * 6 < MAX_MESSAGE_BYTES  # a claim of the most blocks still fits


class ReadDone(msgspec.Struct, array_like=True, frozen=True):
    """The NIXL notification a reader attaches to its READ (delivered after the data); with
    a deployment secret it carries a MAC, so nobody else can end a hold early."""

    engine_id: EngineId
    request_id: RequestId
    reader_engine_id: EngineId
    mac: Annotated[bytes, msgspec.Meta(max_length=MAC_BYTES)] = b""

    def signed_parts(self) -> tuple[bytes, ...]:
        return (self.engine_id.encode(), self.request_id.encode(), self.reader_engine_id.encode())


class Codec:
    """Encodes our messages and opens a peer's: size, envelope, MAC and freshness (with a
    secret), compatibility, body, and the params a claim or release names (with a secret)."""

    def __init__(self, compat: Compat, auth: PeerAuth | None = None) -> None:
        self.compat = compat
        self.auth = auth
        self._mac: EnvelopeAuth | None = auth.envelope if auth is not None else None
        self._hash = compat.hash
        self._enc = msgspec.msgpack.Encoder()
        self._envelope = msgspec.msgpack.Decoder(Envelope)
        self._request = msgspec.msgpack.Decoder(PeerRequest)  # type: ignore[arg-type]
        self._reply = msgspec.msgpack.Decoder(PeerReply)  # type: ignore[arg-type]
        self._notif = msgspec.msgpack.Decoder(ReadDone)

    def _seal(self, env: Envelope) -> bytes:
        if self._mac is not None:
            env = msgspec.structs.replace(env, mac=self._mac.mac(env.signed_parts()))
        return self._enc.encode(env)

    def encode_request(self, msg: msgspec.Struct) -> tuple[bytes, bytes]:
        """The frame and its nonce (which the reply must name)."""
        body = self._enc.encode(msg)
        if self._mac is None:
            return self._enc.encode(Envelope(self._hash, self.compat.desc, body)), b""
        nonce = self._mac.new_nonce()
        env = Envelope(self._hash, self.compat.desc, body, self._mac.now(), nonce)
        return self._seal(env), nonce

    def encode(self, msg: msgspec.Struct, reply_to: bytes = b"") -> bytes:
        if not reply_to:
            return self.encode_request(msg)[0]
        return self.encode_reply(msg, reply_to)

    def encode_reply(self, msg: msgspec.Struct, reply_to: bytes) -> bytes:
        """A reply. A refusal carries no compatibility hash (nothing an outsider could copy
        into an accepted request); other replies carry the hash but never the description."""
        body = self._enc.encode(msg)
        compat = ("", "") if isinstance(msg, Refused) else (self._hash, "")
        now = self._mac.now() if self._mac is not None else 0.0
        nonce = self._mac.new_nonce() if self._mac is not None else b""
        return self._seal(Envelope(*compat, body, now, nonce, reply_to))

    def _envelope_of(self, frame: bytes, peer: str) -> Envelope:
        if len(frame) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message from {peer} is {len(frame)} bytes, over the limit")
        try:
            env = self._envelope.decode(frame)
        except msgspec.DecodeError as e:
            if self._mac is not None:
                raise Unauthenticated(f"unauthenticated message from {peer}: {e}") from None
            raise ProtocolError(f"malformed message from {peer}: {e}") from None
        if self._mac is not None:
            try:
                self._mac.verify(env.signed_parts(), env.mac)
            except NotAuthenticated as e:
                raise Unauthenticated(
                    f"unauthenticated message from {peer}: {e} (does it hold this "
                    f"deployment's secret?)"
                ) from None
        return env

    def _check_compat(self, env: Envelope, peer: str) -> None:
        if env.compat_hash != self._hash:
            theirs = f"; peer: {env.compat_desc[:300]!r}" if env.compat_desc else ""
            raise IncompatiblePeer(
                f"incompatible peer {peer}: its KV transfer compatibility hash "
                f"{env.compat_hash[:16]!r} differs from ours {self._hash[:16]!r} "
                f"(here: {self.compat.desc!r}{theirs}); both instances must run the same "
                f"model weights, dtype, KV layout and kvferry version"
            )

    def open_request(self, frame: bytes, peer: str) -> Envelope:
        """A request's envelope, authenticated (with a secret); see :meth:`admit`."""
        return self._envelope_of(frame, peer)

    def admit(self, env: Envelope, peer: str) -> None:
        """With a secret: accept an authenticated request once (fresh, nonce not seen)."""
        if self._mac is not None:
            try:
                self._mac.admit(env.sent_at, env.nonce)
            except NotAuthenticated as e:
                raise Unauthenticated(f"refused a message from {peer}: {e}") from None

    def request_of(self, env: Envelope, peer: str) -> PeerRequest:
        """The typed request of an opened envelope, after the compatibility check."""
        self._check_compat(env, peer)
        try:
            request: PeerRequest = self._request.decode(env.body)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed request from {peer}: {e}") from None
        self._check_proof(request, peer)
        return request

    def decode_request(self, frame: bytes, peer: str) -> PeerRequest:
        env = self.open_request(frame, peer)
        self.admit(env, peer)
        return self.request_of(env, peer)

    def _check_proof(self, request: PeerRequest, peer: str) -> None:
        if self.auth is None or not isinstance(request, (ClaimRequest, ReleaseRequest)):
            return
        what = type(request).__name__
        proof = request.proof
        if proof is None:
            raise Unauthenticated(f"{what} from {peer} names no signed kv_transfer_params")
        if isinstance(request, ClaimRequest) and request.num_tokens != proof.num_tokens:
            raise Unauthenticated(f"{what} from {peer} does not match the params it names")
        fields = proof.fields(request.engine_id, request.request_id, request.block_ids)
        try:
            self.auth.params.verify(fields, proof.signature)
        except NotAuthenticated as e:
            raise Unauthenticated(f"{what} from {peer} refused: {e}") from None

    def decode_reply(self, frame: bytes, peer: str, reply_to: bytes = b"") -> PeerReply:
        """The peer's reply to the request whose nonce is ``reply_to``; a terse refusal comes
        back as :class:`Refused`."""
        env = self._envelope_of(frame, peer)
        if self._mac is not None and env.reply_to != reply_to:
            raise Unauthenticated(f"the reply from {peer} answers another request (a replay?)")
        if env.compat_hash == "":  # refusals carry no hash
            try:
                refused = msgspec.msgpack.decode(env.body, type=Refused)
            except msgspec.DecodeError as e:
                raise ProtocolError(f"malformed reply from {peer}: {e}") from None
            return refused
        self._check_compat(env, peer)
        try:
            return self._reply.decode(env.body)  # type: ignore[no-any-return]
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed reply from {peer}: {e}") from None

    def encode_notif(self, msg: ReadDone) -> bytes:
        if self._mac is not None:
            mac = self._mac.mac(msg.signed_parts(), NOTIF_DOMAIN)
            msg = msgspec.structs.replace(msg, mac=mac)
        return self._enc.encode(msg)

    def decode_notif(self, data: bytes) -> ReadDone:
        if len(data) > 4 * MAX_ID_LEN:
            raise ProtocolError(f"notification of {len(data)} bytes, over the limit")
        try:
            note = self._notif.decode(data)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed notification: {e}") from None
        if self._mac is not None:
            try:
                self._mac.verify(note.signed_parts(), note.mac, NOTIF_DOMAIN)
            except NotAuthenticated as e:
                raise Unauthenticated(f"unauthenticated notification: {e}") from None
        return note


def endpoint(host: str, port: int | str) -> str:
    return f"tcp://{host}:{port}"


class SideChannelServer:
    """A ZeroMQ ROUTER on a daemon thread answering each request with ``handler(request)``.

    ``handler`` runs on the server thread; it must be thread-safe with respect to the
    engine's thread. Refusals and protocol errors are logged here (the peer gets them too).
    """

    def __init__(
        self,
        ctx: zmq.Context,  # type: ignore[type-arg]
        host: str,
        port: int,
        codec: Codec,
        handler: Callable[[PeerRequest, str], PeerReply],
    ) -> None:
        self._codec = codec
        self._handler = handler
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            sock.bind(endpoint(host, port if port else "*"))
        except zmq.ZMQError as e:
            sock.close()
            raise RuntimeError(
                f"NIXL side channel cannot listen on {endpoint(host, port)}: {e}"
            ) from None
        last = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoint = last  # what it listens on: the configured host, never more
        self.host = host
        self.port = int(last.rsplit(":", 1)[1])
        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nixl-side-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) != 3 or frames[1] != b"":
                continue  # not a REQ peer; nothing sensible to answer
            ident, _, payload = frames
            frame = self._answer(payload)
            try:
                sock.send_multipart([ident, b"", frame], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.debug("side channel: reply not sent: %s", e)
        sock.close()

    def _answer(self, payload: bytes) -> bytes:
        """The encoded reply. A peer refused for its credentials or its compatibility is
        told only that; the reason is logged here."""
        peer = "a side-channel peer"
        codec = self._codec
        nonce = b""
        try:
            env = codec.open_request(payload, peer)
            nonce = env.nonce  # authenticated: a refusal from here on answers this request
            codec.admit(env, peer)
            request = codec.request_of(env, peer)
            reply = self._handler(request, peer)
        except ProtocolError as e:
            logger.warning("NIXL side channel refused a request: %s", e)
            if e.public is not None:
                return codec.encode_reply(Refused(e.public), nonce)
            return codec.encode_reply(Refused(str(e)[:2048]), nonce)
        except Exception as e:  # a bug here must not kill the side channel
            logger.exception("NIXL side channel failed to answer")
            return codec.encode_reply(Refused(f"internal error: {type(e).__name__}"), nonce)
        if isinstance(reply, Refused) and not reply.retry:
            logger.warning("NIXL side channel refused %s: %s", type(request).__name__, reply.reason)
        return codec.encode_reply(reply, nonce)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def call(
    ctx: zmq.Context,  # type: ignore[type-arg]
    host: str,
    port: int,
    codec: Codec,
    request: PeerRequest,
    timeout_s: float,
) -> PeerReply:
    """Send one request to a side channel and return its typed reply.

    Raises PeerUnreachable (no answer in ``timeout_s``), IncompatiblePeer, Unauthenticated or
    ProtocolError."""
    peer = f"{host}:{port}"
    sock = ctx.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.connect(endpoint(host, port))
        frame, nonce = codec.encode_request(request)
        sock.send(frame)
        if not sock.poll(int(timeout_s * 1000)):
            raise PeerUnreachable(f"no answer from the NIXL side channel {peer} in {timeout_s}s")
        return codec.decode_reply(sock.recv(), peer, nonce)
    except zmq.ZMQError as e:
        raise PeerUnreachable(f"NIXL side channel {peer}: {e}") from None
    finally:
        sock.close()
