"""The side channel between a decode instance and a prefill instance (ZeroMQ, msgpack).

Every frame is an :class:`Envelope`: the sender's compatibility hash and a readable summary of
what it hashes, around an opaque body. The receiver decodes the envelope, checks the hash,
and only then decodes the body into one of the typed messages below; anything malformed,
oversized or from an incompatible peer is refused with one clear sentence and changes no
state. Nothing is ever unpickled.

Requests (decode -> prefill): :class:`HandshakeRequest` (answered with :class:`AgentInfo`:
the NIXL agent metadata and the KV pool layout), :class:`ClaimRequest` (answered with
:class:`Granted` when the prefill instance holds exactly those blocks for that prompt),
:class:`HeartbeatRequest` (answered with :class:`Renewed`) and :class:`ReleaseRequest`
(answered with :class:`Ack`).
Any request may be answered with :class:`Refused` (``retry`` says whether asking again later
may succeed).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Union

import msgspec
import zmq

from kvferry.kv_transfer.connectors.nixl.params import (
    MAX_BLOCKS,
    MAX_ID_LEN,
    BlockIds,
    EngineId,
    NumTokens,
    RequestId,
)

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.core.kv_cache_config import KVCacheConfig

logger = logging.getLogger(__name__)

# Bump on any change of the messages or of their meaning.
PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 8 << 20

Digest = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
AgentName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Address = Annotated[int, msgspec.Meta(ge=1)]


class ProtocolError(RuntimeError):
    """A peer message that cannot be accepted (malformed, oversized, unexpected)."""


class IncompatiblePeer(ProtocolError):
    """The peer runs another model, dtype, KV layout or protocol version."""


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
        from kvferry import __version__

        mc = config.model_config
        arch = hashlib.sha256(repr(mc.arch).encode()).hexdigest()[:12]
        g = kv_cache_config.groups[0]
        layout = (
            f"kv2xNxB{g.block_size}xH{g.num_kv_heads}xD{g.head_dim}"
            f"xL{len(kv_cache_config.layer_names)}"
        )
        dtype = str(g.dtype).removeprefix("torch.")
        return Compat(
            f"model={Path(mc.model).name}/{mc.arch.architecture}/{arch} dtype={dtype} "
            f"layout={layout} tp={config.parallel_config.tensor_parallel_size} "
            f"protocol={PROTOCOL_VERSION} kvferry={__version__}"
        )


class Envelope(msgspec.Struct, array_like=True, frozen=True):
    compat_hash: Annotated[str, msgspec.Meta(max_length=64)]
    compat_desc: Annotated[str, msgspec.Meta(max_length=1024)]
    body: bytes


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


class HeartbeatRequest(msgspec.Struct, tag="heartbeat", frozen=True, forbid_unknown_fields=True):
    engine_id: EngineId
    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=1 << 16)]
    reader_engine_id: EngineId


class ReleaseRequest(msgspec.Struct, tag="release", frozen=True, forbid_unknown_fields=True):
    engine_id: EngineId
    request_id: RequestId
    block_ids: BlockIds
    reader_engine_id: EngineId


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
    """The NIXL notification a reader attaches to its READ (delivered after the data)."""

    engine_id: EngineId
    request_id: RequestId
    reader_engine_id: EngineId


class Codec:
    """Encodes our messages and opens a peer's: size, envelope, compatibility, then body."""

    def __init__(self, compat: Compat) -> None:
        self.compat = compat
        self._hash = compat.hash
        self._enc = msgspec.msgpack.Encoder()
        self._envelope = msgspec.msgpack.Decoder(Envelope)
        self._request = msgspec.msgpack.Decoder(PeerRequest)  # type: ignore[arg-type]
        self._reply = msgspec.msgpack.Decoder(PeerReply)  # type: ignore[arg-type]
        self._notif = msgspec.msgpack.Decoder(ReadDone)

    def encode(self, msg: msgspec.Struct) -> bytes:
        body = self._enc.encode(msg)
        return self._enc.encode(Envelope(self._hash, self.compat.desc, body))

    def _open(self, frame: bytes, peer: str) -> bytes:
        if len(frame) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message from {peer} is {len(frame)} bytes, over the limit")
        try:
            env = self._envelope.decode(frame)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed message from {peer}: {e}") from None
        if env.compat_hash != self._hash:
            raise IncompatiblePeer(
                f"incompatible peer {peer}: its KV transfer compatibility hash "
                f"{env.compat_hash[:16]!r} differs from ours {self._hash[:16]!r} "
                f"(peer: {env.compat_desc[:300]!r}; here: {self.compat.desc!r}); both "
                f"instances must run the same model, dtype, KV layout and kvferry version"
            )
        return env.body

    def decode_request(self, frame: bytes, peer: str) -> PeerRequest:
        body = self._open(frame, peer)
        try:
            return self._request.decode(body)  # type: ignore[no-any-return]
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed request from {peer}: {e}") from None

    def decode_reply(self, frame: bytes, peer: str) -> PeerReply:
        body = self._open(frame, peer)
        try:
            return self._reply.decode(body)  # type: ignore[no-any-return]
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed reply from {peer}: {e}") from None

    def encode_notif(self, msg: ReadDone) -> bytes:
        return self._enc.encode(msg)

    def decode_notif(self, data: bytes) -> ReadDone:
        if len(data) > 4 * MAX_ID_LEN:
            raise ProtocolError(f"notification of {len(data)} bytes, over the limit")
        try:
            return self._notif.decode(data)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed notification: {e}") from None


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
            reply = self._answer(payload)
            try:
                sock.send_multipart([ident, b"", self._codec.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.debug("side channel: reply not sent: %s", e)
        sock.close()

    def _answer(self, payload: bytes) -> PeerReply:
        peer = "a side-channel peer"
        try:
            request = self._codec.decode_request(payload, peer)
            reply = self._handler(request, peer)
        except ProtocolError as e:
            logger.warning("NIXL side channel refused a request: %s", e)
            return Refused(str(e)[:2048])
        except Exception as e:  # a bug here must not kill the side channel
            logger.exception("NIXL side channel failed to answer")
            return Refused(f"internal error: {type(e).__name__}")
        if isinstance(reply, Refused) and not reply.retry:
            logger.warning("NIXL side channel refused %s: %s", type(request).__name__, reply.reason)
        return reply

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

    Raises PeerUnreachable (no answer in ``timeout_s``), IncompatiblePeer or ProtocolError."""
    peer = f"{host}:{port}"
    sock = ctx.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.connect(endpoint(host, port))
        sock.send(codec.encode(request))
        if not sock.poll(int(timeout_s * 1000)):
            raise PeerUnreachable(f"no answer from the NIXL side channel {peer} in {timeout_s}s")
        return codec.decode_reply(sock.recv(), peer)
    except zmq.ZMQError as e:
        raise PeerUnreachable(f"NIXL side channel {peer}: {e}") from None
    finally:
        sock.close()
