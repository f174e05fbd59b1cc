"""Trust for P/D on the NIXL side channel, in process: with the deployment secret every
message carries a MAC, replays and stale messages are refused, a reply must answer its
request, claims and releases must name signed params, and refusals are terse."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import pytest
import zmq

from kvferry.kv_transfer.connectors.pd import handshake as hs
from kvferry.kv_transfer.connectors.pd.auth import SignedFields
from kvferry.kv_transfer.connectors.pd.params import ParamsProof
from tests.helpers.pd_auth import COMPAT, OTHER, _auth, _refusal


class Server:
    """A side-channel server answering Ack(1) and recording what reached its handler."""

    def __init__(self, codec: hs.Codec) -> None:
        self.seen: list[Any] = []
        self.ctx = zmq.Context()
        self.server = hs.SideChannelServer(self.ctx, "127.0.0.1", 0, codec, self._handle)
        self.port = self.server.port

    def _handle(self, req: Any, peer: str) -> Any:
        self.seen.append(req)
        return hs.Ack(1)

    def raw(self, frame: bytes) -> bytes:
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        try:
            sock.send(frame)
            assert sock.poll(5000)
            return sock.recv()
        finally:
            sock.close()

    def close(self) -> None:
        self.server.close()
        self.ctx.term()


@pytest.fixture()
def server():
    srv = Server(hs.Codec(COMPAT, _auth()))
    yield srv
    srv.close()


# -- side channel: MAC, replay, terse refusals ------------------------------------------------


@pytest.mark.parametrize("sender", ["no key", "wrong key"])
def test_forged_envelope_is_refused_tersely_and_reaches_nothing(server, sender) -> None:
    forger = hs.Codec(COMPAT, None if sender == "no key" else _auth(OTHER))
    for req in [
        hs.HandshakeRequest("eng", 0),
        hs.ReleaseRequest("eng", "r", [1], "D"),
        hs.HeartbeatRequest("eng", ["r"], "D"),
    ]:
        frame = server.raw(forger.encode_request(req)[0])
        env = _refusal(frame)
        assert msgspec.msgpack.decode(env.body, type=hs.Refused) == hs.Refused("not authenticated")
        assert COMPAT.desc.encode() not in frame
    assert server.seen == []
    # An outsider's reply parser sees just the refusal.
    hb = hs.HeartbeatRequest("eng", ["r"], "D")
    reply = hs.call(server.ctx, "127.0.0.1", server.port, hs.Codec(COMPAT), hb, 5)
    assert reply == hs.Refused("not authenticated")


def test_genuine_messages_pass_and_replays_are_refused(server) -> None:
    client = hs.Codec(COMPAT, _auth())
    hb = hs.HeartbeatRequest("eng", ["r"], "D")
    assert hs.call(server.ctx, "127.0.0.1", server.port, client, hb, 5) == hs.Ack(1)
    frame, _ = client.encode_request(hb)
    first = client.decode_reply(
        server.raw(frame), "srv", msgspec.msgpack.decode(frame, type=hs.Envelope).nonce
    )
    assert first == hs.Ack(1)
    replayed = server.raw(frame)
    assert msgspec.msgpack.decode(_refusal(replayed).body, type=hs.Refused).reason == (
        "not authenticated"
    )
    assert server.seen == [hb, hb]  # the replay never reached the handler
    # A message stamped outside the window (an old recording) is refused too.
    stale = hs.Codec(COMPAT, _auth(clock=lambda: time.time() - 3600))
    assert hs.call(server.ctx, "127.0.0.1", server.port, stale, hb, 5) == hs.Refused(
        "not authenticated"
    )
    # Flipping one byte of a genuine message breaks its MAC.
    frame, _ = client.encode_request(hs.HeartbeatRequest("eng", ["s"], "D"))
    tampered = frame.replace(b"eng", b"enh")
    assert _refusal(server.raw(tampered))
    assert len(server.seen) == 2


def test_a_reply_must_answer_this_request() -> None:
    codec = hs.Codec(COMPAT, _auth())
    frame, nonce = codec.encode_request(hs.HandshakeRequest("eng", 0))
    reply = codec.encode_reply(hs.Ack(1), nonce)
    assert codec.decode_reply(reply, "p", nonce) == hs.Ack(1)
    with pytest.raises(hs.Unauthenticated, match="answers another request"):
        codec.decode_reply(reply, "p", b"x" * 16)
    with pytest.raises(hs.Unauthenticated, match="does not verify"):
        hs.Codec(COMPAT, _auth(OTHER)).decode_reply(reply, "p", nonce)
    # A reply from a peer without the key (no MAC) is not accepted either.
    with pytest.raises(hs.Unauthenticated):
        codec.decode_reply(hs.Codec(COMPAT).encode_reply(hs.Ack(1), nonce), "p", nonce)


def test_incompatible_peer_is_refused_tersely_and_logged_here(server, caplog) -> None:
    theirs = hs.Codec(hs.Compat("model=m weights=other dtype=float32"), _auth())
    with caplog.at_level(logging.WARNING):
        reply = hs.call(
            server.ctx, "127.0.0.1", server.port, theirs, hs.HandshakeRequest("eng", 0), 5
        )
    assert reply == hs.Refused("incompatible")
    assert server.seen == []
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "weights=other" in logged and "weights=w" in logged


def test_claims_and_releases_must_name_signed_params(server) -> None:
    auth = _auth()
    client = hs.Codec(COMPAT, auth)
    fields = SignedFields("eng", "r", "127.0.0.1", 9, [1, 2], 20, 1, 0)
    good = ParamsProof("127.0.0.1", 9, 20, 0, auth.params.sign(fields))
    claim = hs.ClaimRequest("eng", "r", [1, 2], 20, "d", "D", "agent-D", good)
    release = hs.ReleaseRequest("eng", "r", [1, 2], "D", good)

    def ask(req: Any) -> Any:
        return hs.call(server.ctx, "127.0.0.1", server.port, client, req, 5)

    assert ask(claim) == hs.Ack(1) and ask(release) == hs.Ack(1)
    refused = [
        msgspec.structs.replace(claim, proof=None),
        msgspec.structs.replace(claim, block_ids=[1, 3]),
        msgspec.structs.replace(claim, num_tokens=19),
        msgspec.structs.replace(release, request_id="other"),
        msgspec.structs.replace(release, proof=msgspec.structs.replace(good, port=10)),
    ]
    for req in refused:
        assert ask(req) == hs.Refused("not authenticated"), req
    assert server.seen == [claim, release]


def test_refusals_never_carry_the_compat_hash_even_without_a_secret() -> None:
    srv = Server(hs.Codec(COMPAT))
    try:
        for frame in (b"\x00garbage", hs.Codec(hs.Compat("other")).encode(hs.Ack(1))):
            reply = srv.raw(frame)
            _refusal(reply)
            assert COMPAT.hash.encode() not in reply
    finally:
        srv.close()


def test_read_done_notifications_are_authenticated(server) -> None:
    note = hs.ReadDone("eng", "r", "D")
    keyed = hs.Codec(COMPAT, _auth())
    assert keyed.decode_notif(keyed.encode_notif(note)).request_id == "r"
    for forger in (hs.Codec(COMPAT), hs.Codec(COMPAT, _auth(OTHER))):
        with pytest.raises(hs.Unauthenticated):
            keyed.decode_notif(forger.encode_notif(note))
    # The side channel listens on the configured host only.
    assert server.server.endpoint == f"tcp://127.0.0.1:{server.port}"
