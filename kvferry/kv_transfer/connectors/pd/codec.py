"""Turning side-channel messages into frames and back, and the checks a peer's frame passes.

:class:`Codec` seals our messages in an :class:`~.messages.Envelope` (with a deployment secret,
:mod:`.auth`: a timestamp, a nonce and a MAC over all of it) and opens a peer's in order: size,
envelope, MAC and freshness, the :class:`Compat` hash, then the typed body, and for a claim or
release the signed params it names. A frame that fails any check raises a
:class:`ProtocolError` and changes no state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvferry.kv_transfer.connectors.pd.auth import (
    NOTIF_DOMAIN,
    EnvelopeAuth,
    NotAuthenticated,
    PeerAuth,
)
from kvferry.kv_transfer.connectors.pd.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ClaimRequest,
    Envelope,
    PeerReply,
    PeerRequest,
    ReadDone,
    Refused,
    ReleaseRequest,
)
from kvferry.kv_transfer.connectors.pd.params import MAX_ID_LEN

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig


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


@dataclass(frozen=True)
class Compat:
    """What two instances must share to exchange KV blocks, and its hash."""

    desc: str
    tp_size: int = 1  # the engine's tensor-parallel size (not in desc: it may differ)

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.desc.encode()).hexdigest()[:32]

    @staticmethod
    def of(
        config: EngineConfig, kv_cache_config: KVCacheConfig, transport: str | None = None
    ) -> Compat:
        """``transport``: the transfer library when it is not NIXL, so instances on different
        libraries never pair (NIXL's description predates the field and stays as it was)."""
        from kvferry.model.fingerprint import weights_fingerprint
        from kvferry.version import __version__

        mc = config.model_config
        arch = hashlib.sha256(repr(mc.arch).encode()).hexdigest()[:12]
        g = kv_cache_config.groups[0]
        tp = config.parallel_config.tensor_parallel_size
        # The model's KV heads in all (a rank holds 1/tp of them): instances of different
        # tensor-parallel sizes pair, each rank's share is checked at the handshake.
        layout = (
            f"kv2xNxB{g.block_size}xH{g.num_kv_heads * tp}xD{g.head_dim}"
            f"xL{len(kv_cache_config.layer_names)}"
        )
        if len(kv_cache_config.groups) > 1:
            # Hybrid: which layers share a tensor and each group's window (one group's
            # description stays as it was).
            layout += "xG" + "/".join(
                f"{len(x.layer_names)}{'' if x.sliding_window is None else f'w{x.sliding_window}'}"
                for x in kv_cache_config.groups
            )
        # The memory order inside a block (NHD / HND) is not hashed: it travels in the
        # handshake, where the decode side permutes or refuses (see .layout_match).
        dtype = str(g.dtype).removeprefix("torch.")
        return Compat(
            f"model={Path(mc.model).name}/{mc.arch.architecture}/{arch} "
            f"weights={weights_fingerprint(mc.model)} dtype={dtype} "
            f"layout={layout} "
            f"protocol={PROTOCOL_VERSION} kvferry={__version__}"
            + (f" transport={transport}" if transport else ""),
            config.parallel_config.tensor_parallel_size,
        )


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
        fields = proof.fields(
            request.engine_id, request.request_id, request.block_ids, self.compat.tp_size
        )
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
