"""Trust for P/D: the deployment secret on the NIXL side channel and on kv_transfer_params,
the weights fingerprint in the compatibility check, terse refusals, and start-up policy.

In process first (codec, side-channel server, params signing, options, fingerprint, two NIXL
agents), then real engine processes (``tests/helpers/nixl_harness.py``): a prefill instance P
and a decode instance D sharing a secret, and a prefill instance P2 with the same folder name and
shapes but other weights.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
import zmq

from kvferry.config import ConfigError, KVTransferConfig
from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.nixl import handshake as hs
from kvferry.kv_transfer.connectors.nixl.auth import (
    EnvelopeAuth,
    ParamsSigner,
    PeerAuth,
    SignedFields,
)
from kvferry.kv_transfer.connectors.nixl.connector import NixlConnector
from kvferry.kv_transfer.connectors.nixl.options import NixlOptions
from kvferry.kv_transfer.connectors.nixl.params import ParamsError, ParamsProof, decode_params
from kvferry.kv_transfer.connectors.nixl.scheduler import NixlConnectorScheduler
from kvferry.kv_transfer.secret import DeploymentSecret
from kvferry.model.fingerprint import weights_fingerprint
from tests.helpers.nixl_config import nixl_engine_config
from tests.helpers.scheduler import make_kv_cache_config

SECRET = DeploymentSecret(b"s3cret-for-the-tests-0123456789", "test")
OTHER = DeploymentSecret(b"another-secret-entirely-987654321", "test")
COMPAT = hs.Compat("model=m weights=w dtype=float32 layout=x protocol=2")


def _auth(secret: DeploymentSecret = SECRET, window: float = 60.0, clock: Any = time.time):
    return PeerAuth(
        EnvelopeAuth(secret.key_for("nixl-side-channel"), window, clock),
        ParamsSigner(secret.key_for("nixl-kv-params"), 600.0, clock),
        secret.source,
    )


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


def _refusal(frame: bytes) -> hs.Envelope:
    env = msgspec.msgpack.decode(frame, type=hs.Envelope)
    assert (env.compat_hash, env.compat_desc) == ("", ""), env  # nothing about this instance
    return env


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


# -- signed params ----------------------------------------------------------------------------


def _sched(auth: PeerAuth | None) -> NixlConnectorScheduler:
    kvt = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", engine_id="P")
    config = SimpleNamespace(kv_transfer_config=kvt)
    return NixlConnectorScheduler(
        config,  # type: ignore[arg-type]
        make_kv_cache_config(64),
        NixlOptions(side_channel_port=5555),
        "P",
        auth,
    )


def _issued(auth: PeerAuth | None = None) -> dict[str, Any]:
    signer = (auth or _auth()).params
    return decode_params(
        engine_id="P",
        request_id="p-1",
        host="127.0.0.1",
        port=5555,
        block_ids=[3, 4, 9],
        num_tokens=40,
        cached_tokens=16,
        signer=signer,
    )


@pytest.mark.parametrize(
    "change",
    [
        {"remote_host": "10.9.8.7"},
        {"remote_port": 5556},
        {"remote_engine_id": "Q"},
        {"remote_request_id": "p-2"},
        {"remote_block_ids": [3, 4, 10]},
        {"remote_prefill_cached_tokens": 0},
        {"kv_signature": None},
        {"kv_signature": "1.99999999999.deadbeef"},
        {"kv_signature": 7},
    ],
)
def test_decode_intake_refuses_altered_or_unsigned_params(change) -> None:
    sched = _sched(_auth())
    params = _issued()
    sched.validate(params)  # as issued: accepted
    forged = {**params, **change}
    if forged["kv_signature"] is None:
        del forged["kv_signature"]
    with pytest.raises(ParamsError, match="kv_signature|not signed|kv_transfer_params"):
        sched.validate(forged)


def test_params_signed_elsewhere_or_expired_are_refused() -> None:
    sched = _sched(_auth())
    with pytest.raises(ParamsError, match="does not verify"):
        sched.validate(_issued(_auth(OTHER)))
    past = _auth(clock=lambda: time.time() - 3600)
    with pytest.raises(ParamsError, match="expired"):
        sched.validate(_issued(past))
    # Without a secret nothing is signed and nothing is checked.
    plain = _sched(None)
    params = _issued()
    del params["kv_signature"]
    plain.validate(params)


# -- start-up policy --------------------------------------------------------------------------


def test_no_unauthenticated_side_channel_beyond_loopback(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVFERRY_KV_SECRET", raising=False)
    monkeypatch.delenv("KVFERRY_KV_SECRET_FILE", raising=False)
    kvc = make_kv_cache_config(32)
    role = KVConnectorRole.SCHEDULER
    with pytest.raises(ConfigError, match="allow_unauthenticated: true"):
        NixlConnector(nixl_engine_config("eng-x", "0.0.0.0"), role, kvc)
    with pytest.raises(ConfigError, match="KVFERRY_KV_SECRET_FILE"):
        NixlConnector(nixl_engine_config("eng-x", "10.1.2.3"), role, kvc)
    NixlConnector(nixl_engine_config("eng-x", "0.0.0.0", allow_unauthenticated=True), role, kvc)
    NixlConnector(nixl_engine_config("eng-x", "127.0.0.1"), role, kvc)
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET.value + b"\n")
    conn = NixlConnector(nixl_engine_config("eng-x", "0.0.0.0", secret_file=str(secret)), role, kvc)
    assert conn.connector_scheduler is not None and conn.connector_scheduler.signer is not None
    monkeypatch.setenv("KVFERRY_KV_SECRET_FILE", str(secret))
    NixlConnector(nixl_engine_config("eng-x", "10.1.2.3"), role, kvc)
    with pytest.raises(ConfigError, match="at least 16"):
        secret.write_bytes(b"short")
        NixlConnector(nixl_engine_config("eng-x", "127.0.0.1"), role, kvc)


def _hold_and_read(p: NixlConnector, d: NixlConnector, signer: ParamsSigner, port: int) -> tuple:
    """P holds blocks [3, 4] of a 32-token prompt; D reads them into [7, 8] with params
    that ``signer`` issued naming side-channel port ``port`` (as D's scheduler would)."""
    from kvferry.kv_transfer.connectors.nixl.metadata import (
        NixlConnectorMetadata,
        RecvSpec,
        SendSpec,
    )
    from kvferry.kv_transfer.connectors.nixl.params import parse_remote, token_digest
    from kvferry.kv_transfer.connectors.nixl.scheduler import _ref

    pw, dw = p.connector_worker, d.connector_worker
    assert pw is not None and dw is not None
    digest = token_digest(list(range(32)), 32)
    pw.bind(NixlConnectorMetadata(reqs_to_send=[SendSpec("p-1", [3, 4], 32, digest)]))
    params = decode_params(
        engine_id="eng-x", request_id="p-1", host="127.0.0.1", port=port, block_ids=[3, 4],
        num_tokens=32, cached_tokens=0, signer=signer,
    )  # fmt: skip
    remote = parse_remote({**params, "remote_port": pw.port}, 16)
    spec = RecvSpec("d-1", _ref(remote), [3, 4], [7, 8], 32, digest)
    dw.start_load(NixlConnectorMetadata(reqs_to_recv=[spec]), empty_step=True)
    got: set[str] = set()
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        got |= dw.get_finished()[1]
        pw.get_finished()
    return got, dw.get_failed_recving()


def test_two_agents_with_a_secret_read_and_warn_only_without(tmp_path, monkeypatch, caplog):
    pytest.importorskip("nixl", reason="needs the nixl package (extra 'nixl')")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.delenv("KVFERRY_KV_SECRET", raising=False)
    monkeypatch.delenv("KVFERRY_KV_SECRET_FILE", raising=False)
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET.value)
    kvc = make_kv_cache_config(16)
    shape = (2, 16, 16, 1, 8)
    role = KVConnectorRole.WORKER
    with caplog.at_level(logging.WARNING):
        d_plain = NixlConnector(nixl_engine_config("eng-x", "127.0.0.1"), role, kvc)
    warned = [r for r in caplog.records if "not authenticated" in r.getMessage()]
    assert len(warned) == 1
    d_plain.shutdown()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        p = NixlConnector(
            nixl_engine_config("eng-x", "127.0.0.1", secret_file=str(secret)), role, kvc
        )
        d = NixlConnector(
            nixl_engine_config("eng-x", "127.0.0.1", secret_file=str(secret)), role, kvc
        )
    assert not [r for r in caplog.records if "not authenticated" in r.getMessage()]
    src = {"model.layers.0.self_attn": torch.randn(shape)}
    dst = {"model.layers.0.self_attn": torch.zeros(shape)}
    try:
        p.register_kv_caches(src)
        d.register_kv_caches(dst)
        assert p.connector_worker is not None
        port = p.connector_worker.port
        # Params naming another port than the one signed: P refuses the claim, D reads nothing.
        assert _hold_and_read(p, d, _auth().params, port + 1) == ({"d-1"}, {"d-1"})
        assert not dst["model.layers.0.self_attn"].any()
        assert _hold_and_read(p, d, _auth().params, port) == ({"d-1"}, set())
        s, t = src["model.layers.0.self_attn"], dst["model.layers.0.self_attn"]
        assert torch.equal(t[:, [7, 8]], s[:, [3, 4]])
    finally:
        p.shutdown()
        d.shutdown()


# -- weights fingerprint ----------------------------------------------------------------------


def test_weights_fingerprint_tells_other_weights_apart(tiny_model_factory, tmp_path) -> None:
    a = tiny_model_factory("llama", layers=2, hidden=64, heads=2, kv_heads=1, vocab=512)
    b = tiny_model_factory("llama", layers=2, hidden=64, heads=2, kv_heads=1, vocab=512, seed=1)
    copy = tmp_path / "elsewhere" / a.name
    shutil.copytree(a, copy)
    fa, fb = weights_fingerprint(a), weights_fingerprint(b)
    assert fa != fb and len(fa) == 32
    assert weights_fingerprint(copy) == fa  # content, not location
    assert weights_fingerprint(tmp_path / "nothing") == "none"
    # A change inside a sampled region of the data changes it (the file's last bytes are one).
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert weights_fingerprint(copy) != fa
    cfg = json.loads((a / "config.json").read_text())
    assert cfg == json.loads((b / "config.json").read_text())  # same shapes, same config


def _weights_config(model: Path) -> Any:
    arch = SimpleNamespace(architecture="LlamaForCausalLM", layers=2)
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(model), arch=arch),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def test_compat_hash_includes_the_weights(tiny_model_factory) -> None:
    a = tiny_model_factory("llama", layers=2, hidden=64, heads=2, kv_heads=1, vocab=512)
    b = tiny_model_factory("llama", layers=2, hidden=64, heads=2, kv_heads=1, vocab=512, seed=1)
    kvc = make_kv_cache_config(16)
    ca = hs.Compat.of(_weights_config(a), kvc)  # type: ignore[arg-type]
    cb = hs.Compat.of(_weights_config(b), kvc)  # type: ignore[arg-type]
    assert f"weights={weights_fingerprint(a)}" in ca.desc
    assert ca.hash != cb.hash


# -- real engine processes ----------------------------------------------------------------------

MAX_TOKENS = 8
LEASE_S = 4.0


def _kv(secret: Path, policy: str = "fail") -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "side_channel_port": 0,
            "handshake_timeout": 1.5,
            "transfer_timeout": 10.0,
            "kv_lease_duration": LEASE_S,
            "heartbeat_interval": 0.5,
            "secret_file": str(secret),
        },
    }


@pytest.fixture(scope="module")
def models(tiny_model_factory, tmp_path_factory) -> dict[str, Path]:
    """Two checkpoints in folders of the same name, same shapes, other weights (seeds)."""
    root = tmp_path_factory.mktemp("same-name")
    out = {}
    for key, seed in (("a", 0), ("b", 1)):
        out[key] = root / key / "tiny"
        shutil.copytree(tiny_model_factory("llama", seed=seed), out[key])
    return out


@pytest.fixture(scope="module")
def secured(models, tmp_path_factory):
    pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")
    from tests.helpers.nixl_instance import Instance

    tmp = tmp_path_factory.mktemp("pd-auth")
    secret = tmp / "secret"
    secret.write_bytes(SECRET.value)
    specs = {
        "P": (models["a"], _kv(secret)),
        "P2": (models["b"], _kv(secret)),
        "D": (models["a"], _kv(secret, "recompute")),
    }
    procs = {n: Instance(n, m, kv, tmp / f"{n}.log") for n, (m, kv) in specs.items()}
    try:
        for inst in procs.values():
            inst.ready = inst.wait("ready", 180)  # type: ignore[attr-defined]
        yield procs
    finally:
        for inst in procs.values():
            inst.close()


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    lens = {"pd": 70, "tampered": 40, "forged": 33, "weights": 50}
    return {k: torch.randint(3, 2000, (n,), generator=g).tolist() for k, n in lens.items()}


@pytest.fixture(scope="module")
def reference(models, prompts) -> dict[str, list[int]]:
    from kvferry import LLM, SamplingParams

    llm = LLM(model=str(models["a"]), dtype="float32", max_model_len=4096, num_kv_blocks=256)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], sp, use_tqdm=False)
    return {k: o.outputs[0].token_ids for k, o in zip(prompts, outs, strict=True)}


def _prefill(p: Any, prompt: list[int]) -> dict[str, Any]:
    out = p.call(
        "generate", prompt=prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    return out["kv_transfer_params"]  # type: ignore[no-any-return]


def _decode(d: Any, prompt: list[int], params: Any) -> dict[str, Any]:
    return d.call("generate", prompt=prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)  # type: ignore[no-any-return]


def _all_free(inst: Any, within: float) -> float:
    st = inst.call("wait_idle", timeout=within + 30, within=within)
    assert st["idle"] and st["free_blocks"] == st["num_blocks"], (inst.name, st)
    return float(st["elapsed"])


def test_pd_with_a_secret_is_token_identical(secured, prompts, reference) -> None:
    p, d = secured["P"], secured["D"]
    params = _prefill(p, prompts["pd"])
    assert params["kv_signature"].startswith("1.")
    out = _decode(d, prompts["pd"], params)
    assert out["tokens"] == reference["pd"]
    assert out["external_cached"] == len(prompts["pd"]), out
    assert _all_free(p, within=LEASE_S * 3) < LEASE_S
    assert "side channel authenticated" in p.log() and "not authenticated" not in p.log()


def test_tampered_params_are_refused_at_intake(secured, prompts, reference) -> None:
    p, d = secured["P"], secured["D"]
    prompt = prompts["tampered"]
    good = _prefill(p, prompt)
    unsigned = {k: v for k, v in good.items() if k != "kv_signature"}
    for forged, message in [
        ({**good, "remote_host": "10.11.12.13"}, "does not verify"),
        ({**good, "remote_port": good["remote_port"] + 1}, "does not verify"),
        (unsigned, "not signed"),
    ]:
        out = _decode(d, prompt, forged)
        assert out["finish_reason"] == "rejected" and message in out["error"], out
        # The server's release path refuses them too (a 400 there), P keeps its blocks.
        assert message in p.call("try_release", kv_transfer_params=forged)["error"]
    st = p.call("status")
    assert st["free_blocks"] < st["num_blocks"]
    out = _decode(d, prompt, good)  # the genuine params still work
    assert out["tokens"] == reference["tampered"] and out["external_cached"] == len(prompt)
    _all_free(p, within=LEASE_S * 3)


def test_forged_side_channel_messages_change_nothing(secured, prompts, reference) -> None:
    p, d = secured["P"], secured["D"]
    prompt = prompts["forged"]
    good = _prefill(p, prompt)
    eid, rid, blocks = good["remote_engine_id"], good["remote_request_id"], good["remote_block_ids"]
    compat = hs.Compat(p.ready["compat"])  # the right description: only the key is missing
    outsider = hs.Codec(compat)
    ctx = zmq.Context()
    port = p.ready["port"]
    try:
        forged = [
            hs.HandshakeRequest(eid, 0),
            hs.ReleaseRequest(eid, rid, blocks, "intruder"),
            hs.ClaimRequest(eid, rid, blocks, len(prompt), "x", "intruder", "agent-x"),
            hs.HeartbeatRequest(eid, [rid], "intruder"),
        ]
        for req in forged:
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(outsider.encode_request(req)[0])
            assert sock.poll(5000)
            frame = sock.recv()
            sock.close()
            env = _refusal(frame)
            assert msgspec.msgpack.decode(env.body, type=hs.Refused).reason == "not authenticated"
            assert len(frame) < 200 and eid.encode() not in frame
        st = p.call("status")
        assert st["free_blocks"] < st["num_blocks"]  # nothing was released
        # A genuine message, recorded and replayed, is refused the second time.
        insider = hs.Codec(compat, _auth())
        frame, nonce = insider.encode_request(hs.HeartbeatRequest(eid, [rid], "replayer"))
        replies = []
        for _ in range(2):
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(frame)
            assert sock.poll(5000)
            replies.append(insider.decode_reply(sock.recv(), "P", nonce))
            sock.close()
        assert isinstance(replies[0], hs.Renewed) and rid in replies[0].held
        assert replies[1] == hs.Refused("not authenticated")
        # Even with the key, a release must name params P signed.
        release = hs.ReleaseRequest(eid, rid, blocks, "insider")
        reply = hs.call(ctx, "127.0.0.1", port, insider, release, 5)
        assert reply == hs.Refused("not authenticated")
    finally:
        ctx.term()
    st = p.call("status")
    assert st["free_blocks"] < st["num_blocks"]
    out = _decode(d, prompt, good)
    assert out["tokens"] == reference["forged"] and out["external_cached"] == len(prompt)
    assert "unauthenticated message" in p.log() and "a replay" in p.log()
    _all_free(p, within=LEASE_S * 3)


def test_other_weights_same_name_and_shapes_are_refused(secured, prompts, reference) -> None:
    p2, d = secured["P2"], secured["D"]
    assert p2.ready["compat"] != d.ready["compat"]
    prompt = prompts["weights"]
    params = _prefill(p2, prompt)
    out = _decode(d, prompt, params)
    # D's policy is recompute: its own (right) weights answer; nothing was read from P2.
    assert out["finish_reason"] == "length" and out["tokens"] == reference["weights"], out
    assert "refused: incompatible" in d.log() and "kv_load_failure_policy applies" in d.log()
    assert "incompatible peer" in p2.log() and "weights=" in p2.log()
    assert d.ready["compat"] not in d.log().split("NIXL connector ready")[-1]
    _all_free(p2, within=LEASE_S * 3)


# -- HTTP: the release path and the proxy ---------------------------------------------------------


def test_release_endpoint_needs_signed_params(models, tmp_path, monkeypatch) -> None:
    pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")
    import httpx

    from tests.helpers.servers import metric, ready, start_server, stop

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET.value)
    kv = _kv(secret)
    kv["kv_connector_extra_config"]["kv_lease_duration"] = 60.0
    p = start_server("prefill", models["a"], tmp_path, kv)
    try:
        ready(p)
        body = {
            "model": "tiny",
            "prompt": list(range(5, 45)),
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        r = httpx.post(p.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        held = "kvferry_num_requests_held_by_connector"
        assert metric(p.url, held) == 1
        unsigned = {k: v for k, v in params.items() if k != "kv_signature"}
        for forged in ({**params, "remote_request_id": "someone-else"}, unsigned):
            r = httpx.post(p.url + "/v1/kv/release", json={"kv_transfer_params": forged})
            assert r.status_code == 400, r.text
            assert "kv_transfer_params" in r.json()["error"]["message"]
        assert metric(p.url, held) == 1
        r = httpx.post(p.url + "/v1/kv/release", json={"kv_transfer_params": params})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while metric(p.url, held) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(p.url, held) == 0
    finally:
        stop([p])
    assert "Traceback" not in p.log.read_text()


def test_proxy_sends_its_upstream_key_everywhere(tmp_path) -> None:
    import httpx
    from fastapi.testclient import TestClient

    from kvferry.entrypoints.proxy import PDProxy, build_proxy_app, read_api_key_file

    key_file = tmp_path / "key"
    key_file.write_text("upstream-key\n")
    seen: list[tuple[str, str | None]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.host == "p1":
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(500, json={"error": {"message": "boom"}})  # -> a release

    key = read_api_key_file(str(key_file))
    proxy = PDProxy(["http://p1"], ["http://d1"], upstream_api_key=key)
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    with TestClient(build_proxy_app(proxy)) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        r = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer client"})
        assert r.status_code == 502
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [p for p, _ in seen] == ["/v1/completions", "/v1/completions", "/v1/kv/release"]
    assert {a for _, a in seen} == {"Bearer upstream-key"}
    key_file.write_text("two words")
    with pytest.raises(ConfigError, match="one key"):
        read_api_key_file(str(key_file))
