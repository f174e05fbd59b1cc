"""NixlConnector pieces without engine processes: params checks, the side-channel codec and
server, leases, a worker-to-worker NIXL READ (two agents in this process) checked byte for
byte, and the reader's failure paths with a fake transport."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import torch
import zmq

from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.nixl.connector import NixlConnector
from kvferry.kv_transfer.connectors.pd import handshake as hs
from kvferry.kv_transfer.connectors.pd.lease import LeaseTable
from kvferry.kv_transfer.connectors.pd.metadata import PDConnectorMetadata as NixlConnectorMetadata
from kvferry.kv_transfer.connectors.pd.params import (
    ParamsError,
    Side,
    parse_remote,
    request_side,
    token_digest,
)
from tests.helpers.nixl_config import nixl_engine_config
from tests.helpers.scheduler import make_kv_cache_config

GOOD = {
    "do_remote_prefill": True,
    "remote_engine_id": "eng-P",
    "remote_request_id": "p-1",
    "remote_host": "127.0.0.1",
    "remote_port": 5555,
    "remote_block_ids": [7, 8, 9],
    "remote_num_tokens": 40,
    "tp_size": 1,
    "proxy_extra": {"anything": 1},  # unknown keys are ignored
}


# -- params ------------------------------------------------------------------------------


def test_request_side():
    assert request_side(None) is None
    assert request_side({"do_remote_decode": True, "remote_host": None}) is Side.PREFILL
    assert request_side(GOOD) is Side.DECODE
    assert request_side({**GOOD, "do_remote_prefill": False}) is None
    for bad, msg in [
        ([1], "must be a JSON object"),
        ({"do_remote_prefill": 1}, "must be true or false"),
        ({"do_remote_prefill": True, "do_remote_decode": True}, "sets both"),
    ]:
        with pytest.raises(ParamsError, match=msg):
            request_side(bad)


@pytest.mark.parametrize(
    "change, msg",
    [
        ({"remote_port": "80"}, r"Expected `int`, got `str` - at `\$.remote_port`"),
        ({"remote_port": 70000}, "<= 65535"),
        ({"remote_block_ids": [7, 8, -9]}, r">= 0 - at `\$.remote_block_ids\[2\]`"),
        ({"remote_block_ids": [7, 8, True]}, "got `bool`"),
        ({"remote_block_ids": [7, 8]}, "needs 3 blocks"),
        ({"remote_block_ids": [7, 7, 9]}, "duplicates"),
        ({"remote_engine_id": ""}, "length >= 1"),
        ({"remote_host": "h; rm -rf /"}, "matching regex"),
        ({"remote_num_tokens": 0}, ">= 1"),
        ({"tp_size": 0}, ">= 1"),
        ({"remote_request_id": None}, "got `null`"),
    ],
)
def test_parse_remote_rejects_forgeries(change, msg):
    with pytest.raises(ParamsError, match=msg):
        parse_remote({**GOOD, **change}, block_size=16)


def test_parse_remote_and_digest():
    remote = parse_remote(GOOD, block_size=16)
    assert remote.flat_block_ids() == [7, 8, 9] and remote.remote_num_tokens == 40
    assert remote.remote_block_ids == [[7, 8, 9]] and remote.group_sizes() == ()
    ids = list(range(100))
    assert token_digest(ids, 40) == token_digest(ids[:40] + [5], 40) != token_digest(ids, 41)


# -- codec and side channel --------------------------------------------------------------

COMPAT = hs.Compat("model=m dtype=float32 layout=x protocol=1")


def test_codec_checks_the_compat_hash_before_the_body():
    ours, theirs = hs.Codec(COMPAT), hs.Codec(hs.Compat("model=m dtype=bfloat16"))
    req = hs.HandshakeRequest("eng", 0)
    assert ours.decode_request(ours.encode(req), "peer") == req
    with pytest.raises(hs.IncompatiblePeer, match="dtype=bfloat16"):
        ours.decode_request(theirs.encode(req), "peer")
    # A body that is not a valid message is only looked at after the hash matched.
    env = msgspec.msgpack.encode(hs.Envelope(COMPAT.hash, COMPAT.desc, b"\xc1junk"))
    with pytest.raises(hs.ProtocolError, match="malformed request"):
        ours.decode_request(env, "peer")
    with pytest.raises(hs.ProtocolError, match="malformed message"):
        ours.decode_request(b"\x93\x01", "peer")
    with pytest.raises(hs.ProtocolError, match="over the limit"):
        ours.decode_request(b"x" * (hs.MAX_MESSAGE_BYTES + 1), "peer")
    # A reply type where a request is expected, and unknown fields, are refused.
    with pytest.raises(hs.ProtocolError):
        ours.decode_request(ours.encode(hs.Ack(1)), "peer")
    extra = msgspec.msgpack.encode({"type": "handshake", "engine_id": "e", "rank": 0, "x": 1})
    env = msgspec.msgpack.encode(hs.Envelope(COMPAT.hash, COMPAT.desc, extra))
    with pytest.raises(hs.ProtocolError, match="unknown field"):
        ours.decode_request(env, "peer")


def test_side_channel_survives_garbage_and_times_out_cleanly():
    codec = hs.Codec(COMPAT)
    seen: list[Any] = []

    def handler(req: Any, peer: str) -> Any:
        seen.append(req)
        return hs.Ack(7)

    ctx = zmq.Context()
    server = hs.SideChannelServer(ctx, "127.0.0.1", 0, codec, handler)
    try:
        raw = ctx.socket(zmq.REQ)
        raw.connect(f"tcp://127.0.0.1:{server.port}")
        raw.send(b"\x00garbage")
        assert raw.poll(5000)
        reply = codec.decode_reply(raw.recv(), "server")
        assert isinstance(reply, hs.Refused) and "malformed" in reply.reason
        raw.close()
        hb = hs.HeartbeatRequest("eng", ["a"], "reader")
        assert hs.call(ctx, "127.0.0.1", server.port, codec, hb, 5) == hs.Ack(7)
        assert seen == [hb]
        with pytest.raises(hs.PeerUnreachable, match="no answer"):
            hs.call(ctx, "127.0.0.1", 1, codec, hb, 0.2)
    finally:
        server.close()
        ctx.term()


# -- leases --------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _claim(req_id: str = "r", blocks=(1, 2), n: int = 20, digest: str = "d", reader: str = "D"):
    return hs.ClaimRequest("P", req_id, list(blocks), n, digest, reader, f"agent-{reader}")


def test_lease_claims_renewals_and_expiry():
    clock = Clock()
    t = LeaseTable("P", "agent-P", lease_s=10, max_hold_s=25, clock=clock)
    t.expect(["r"])
    assert t.claim(_claim()) == hs.Refused("'r' is still being prefilled", retry=True)
    t.add("r", [1, 2], 20, "d")
    for bad, why in [
        (_claim(blocks=(1, 3)), "other blocks"),
        (_claim(n=21), "not 21"),
        (_claim(digest="x"), "prompt differs"),
        (hs.ClaimRequest("Q", "r", [1, 2], 20, "d", "D", "a"), "not Q"),
    ]:
        reply = t.claim(bad)
        assert isinstance(reply, hs.Refused) and why in reply.reason and not reply.retry
    assert t.claim(_claim()) == hs.Granted("agent-P", 10)
    assert t.claim(_claim(reader="E")).reason.endswith("engine D is reading it")  # type: ignore[union-attr]
    clock.t += 8
    assert t.heartbeat("P", ["r", "zzz"], "D") == hs.Renewed({"r": 10}, [])  # to t+10
    clock.t += 9
    assert t.reap() == []
    clock.t += 1.5
    assert t.reap() == ["r"]
    assert "lease expired after 18.5s" in t.take_finished()["r"]
    reply = t.claim(_claim())
    assert isinstance(reply, hs.Refused) and "freed: lease expired" in reply.reason
    assert "holds no blocks" in t.claim(_claim(req_id="never")).reason  # type: ignore[union-attr]
    # Renewals never go past max_hold_s.
    start = clock.t
    t.add("s", [3], 5, "d")
    while not t.reap():
        clock.t += 1
        t.heartbeat("P", ["s"], "D")
    assert clock.t - start == 25


def test_lease_completion_and_release():
    t = LeaseTable("P", "agent-P", lease_s=10, max_hold_s=100, clock=Clock())
    t.add("r", [1, 2], 20, "d")
    assert not t.complete("r", "D", "agent-D")  # nobody claimed it
    t.claim(_claim())
    assert not t.complete("r", "D", "agent-X")  # notification from another agent
    assert t.complete("r", "D", "agent-D")
    assert t.take_finished() == {"r": "read by engine D"}
    # A heartbeat racing the notification learns the blocks were freed after its read.
    assert t.heartbeat("P", ["r"], "D") == hs.Renewed({}, ["r"])
    assert t.heartbeat("P", ["r"], "E") == hs.Renewed({}, [])
    t.add("u", [4], 5, "d")
    rel = hs.ReleaseRequest("P", "u", [4], "D")
    assert t.release(hs.ReleaseRequest("P", "u", [5], "D")).reason.endswith(  # type: ignore[union-attr]
        "other blocks for 'u' than the ones named"
    )
    assert t.release(rel) == hs.Ack(1)
    assert t.release(rel) == hs.Ack(0)  # twice is harmless
    assert t.num_held() == 0 and set(t.take_finished()) == {"u"}


# -- two workers, one real NIXL READ ---------------------------------------------------------


def test_worker_to_worker_read_moves_exactly_the_named_blocks(monkeypatch):
    pytest.importorskip("nixl", reason="needs the nixl package (extra 'nixl')")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    kvc = make_kv_cache_config(32)  # one layer, block 16, 1 head, dim 8, fp32
    shape = (2, 32, 16, 1, 8)
    src = {"model.layers.0.self_attn": torch.randn(shape)}
    dst = {"model.layers.0.self_attn": torch.zeros(shape)}
    p = NixlConnector(nixl_engine_config("eng-P"), KVConnectorRole.WORKER, kvc)
    d = NixlConnector(nixl_engine_config("eng-D"), KVConnectorRole.WORKER, kvc)
    try:
        p.register_kv_caches(src)
        d.register_kv_caches(dst)
        pw, dw = p.connector_worker, d.connector_worker
        assert pw is not None and dw is not None
        digest = token_digest(list(range(40)), 40)
        from kvferry.kv_transfer.connectors.pd.metadata import RecvSpec, RemoteRef, SendSpec

        pw.bind(NixlConnectorMetadata(reqs_to_send=[SendSpec("p-1", [3, 4, 9], 40, digest)]))
        ref = RemoteRef("eng-P", "127.0.0.1", pw.port, "p-1")
        spec = RecvSpec("d-1", ref, [3, 4, 9], [20, 11], 40, digest, first_block=1)
        dw.start_load(NixlConnectorMetadata(reqs_to_recv=[spec]), empty_step=True)
        sent: set[str] = set()
        got: set[str] = set()
        deadline = time.monotonic() + 20
        while not (sent and got) and time.monotonic() < deadline:
            got |= dw.get_finished()[1]
            sent |= pw.get_finished()[0]
        assert got == {"d-1"} and sent == {"p-1"} and not dw.get_failed_recving()
        s, t = src["model.layers.0.self_attn"], dst["model.layers.0.self_attn"]
        assert torch.equal(t[:, [20, 11]], s[:, [4, 9]])  # K and V of the tail blocks
        untouched = [b for b in range(32) if b not in (20, 11)]
        assert not t[:, untouched].any()
        stats = d.get_kv_connector_stats()
        assert stats is not None and stats.data["nixl_read_bytes"] == 2 * 2 * 16 * 8 * 4
    finally:
        p.shutdown()
        d.shutdown()


# -- reader failure paths with a fake transport ----------------------------------------------


class FakeTransport:
    name = "agent-D"

    def __init__(self, state: str, refuse_release: int = 0) -> None:
        self._state, self.refuse_release, self.released = state, refuse_release, 0

    def add_peer(self, info: Any) -> Any:
        from kvferry.kv_transfer.connectors.nixl.agent import KVLayout, RemotePeer

        return RemotePeer(info.agent_name, KVLayout.of_peer(info), None)

    def read(self, peer: Any, local: Any, remote: Any, notif: bytes) -> tuple[Any, str]:
        return object(), "PROC"

    def state(self, handle: Any) -> str:
        return self._state

    def release(self, handle: Any) -> bool:
        if self.refuse_release > 0:
            self.refuse_release -= 1
            return False
        self.released += 1
        return True

    def remove_peer(self, peer: Any) -> None:
        pass


def _reader(transport: FakeTransport, held_s: float = 60.0, **opts: Any) -> Any:
    from concurrent.futures import Future

    from kvferry.kv_transfer.connectors.nixl.agent import KVLayout
    from kvferry.kv_transfer.connectors.nixl.options import NixlOptions
    from kvferry.kv_transfer.connectors.pd.metadata import RecvSpec, RemoteRef
    from kvferry.kv_transfer.connectors.pd.reader import Reader, _Leg, _Read

    layout = KVLayout(32, 512, 16, "DRAM", 0, (4096,))
    options = NixlOptions(handshake_timeout=0.1, **opts)
    stats: dict[str, float] = __import__("collections").defaultdict(float)
    reader = Reader(transport, layout, hs.Codec(COMPAT), zmq.Context(), "D", options, stats)  # type: ignore[arg-type]
    info = hs.AgentInfo("P", "agent-P", b"md", 0, 1, 16, 32, 512, "DRAM", 0, [8192])
    prep: Future[Any] = Future()
    prep.set_result((info, time.monotonic() + held_s))
    spec = RecvSpec("r", RemoteRef("P", "127.0.0.1", 1, "p"), [1, 2], [3, 4], 20, "d")
    reader._reads["r"] = _Read(spec, [_Leg(0, prep)])
    return reader


def test_failed_read_is_reported_only_once_its_handle_is_released():
    transport = FakeTransport("ERR", refuse_release=3)  # each poll retries the release
    reader = _reader(transport)
    reader.poll()  # posts, sees ERR, cannot release: the blocks must stay with the request
    assert reader.take() == (set(), set()) and reader.busy()
    reader.poll()
    assert reader.take() == (set(), set())
    reader.poll()
    assert reader.take() == ({"r"}, {"r"}) and not reader.busy()
    assert reader.stats["failed_reads"] == 1
    reader.shutdown()


def test_read_running_past_transfer_timeout_fails():
    reader = _reader(FakeTransport("PROC"), transfer_timeout=0.05)
    reader.poll()
    assert reader.take() == (set(), set())
    time.sleep(0.06)
    reader.poll()
    assert reader.take() == ({"r"}, {"r"})
    reader.shutdown()


def test_read_completed_after_the_confirmed_hold_is_not_trusted():
    reader = _reader(FakeTransport("DONE"), held_s=-1.0)  # the promised hold already ended
    reader.poll()
    assert reader.take() == ({"r"}, {"r"})
    reader.shutdown()
    reader = _reader(FakeTransport("DONE"))
    reader.poll()
    assert reader.take() == ({"r"}, set()) and reader.stats["reads"] == 1
    reader.shutdown()


def test_a_process_with_a_nixl_agent_exits_cleanly() -> None:
    # With the system's libibverbs installed (Mooncake needs it), UCX's EFA module used to
    # crash every NIXL process at exit (SIGSEGV).
    import os
    import subprocess
    import sys

    code = (
        "from kvferry.kv_transfer.connectors.nixl.agent import NixlTransport\n"
        "t = NixlTransport('exit-check', ['UCX'])\n"
        "t.close()\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
