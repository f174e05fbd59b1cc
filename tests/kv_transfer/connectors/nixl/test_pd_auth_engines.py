"""Trust for P/D between real engine processes (``tests/helpers/nixl_harness.py``): a
prefill instance P and a decode instance D sharing a secret, and a prefill instance P2
with the same folder name and shapes but other weights. Signed P/D is token-identical;
tampered params, forged side-channel messages and other weights change nothing."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch
import zmq

from kvferry.kv_transfer.connectors.pd import handshake as hs
from tests.helpers.pd_auth import LEASE_S, SECRET, _auth, _kv, _refusal

# -- real engine processes ----------------------------------------------------------------------

MAX_TOKENS = 8


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
