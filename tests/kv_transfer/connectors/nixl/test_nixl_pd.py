"""Prefill/decode disaggregation with the NixlConnector across real process boundaries.

Each instance is its own Python process (``tests/helpers/nixl_harness.py``): a prefill
instance P, a decode instance D1 (``kv_load_failure_policy="fail"``) and a decode instance D2
(``recompute``). The last test has P kill itself in the middle of a transfer. Params travel from P
to D through this test, as the proxy would carry them; the side channel and the NIXL READs
(UCX over loopback, host memory) cross the process boundary. Greedy outputs are compared
with a single ordinary instance in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvferry import LLM, SamplingParams
from tests.helpers.nixl_instance import (
    LEASE_S,
    MAX_TOKENS,
    Instance,
    assert_all_free,
    fake_params,
    nixl_kv,
    submit_decode,
    submit_prefill,
)

pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("nixl-logs")
    specs = {
        "P": nixl_kv("kv_producer"),
        "D1": nixl_kv("kv_consumer", "fail"),
        "D2": nixl_kv("kv_consumer", "recompute"),
    }
    procs = {
        name: Instance(name, model_dir, kv, logs / f"{name}.log") for name, kv in specs.items()
    }
    try:
        for inst in procs.values():
            inst.ready = inst.wait("ready", 120)  # type: ignore[attr-defined]
        yield procs
    finally:
        for inst in procs.values():
            inst.close()


PROMPT_LENS = {"short": 5, "block_multiple": 64, "long": 3000}


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    out = {k: torch.randint(3, 2000, (n,), generator=g).tolist() for k, n in PROMPT_LENS.items()}
    out["extended"] = out["block_multiple"] + torch.randint(3, 2000, (30,), generator=g).tolist()
    for key, n in (("forged", 50), ("kill_a", 40), ("kill_b", 33)):
        out[key] = torch.randint(3, 2000, (n,), generator=g).tolist()
    return out


@pytest.fixture(scope="module")
def reference(model_dir, prompts) -> dict[str, list[int]]:
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=4096, num_kv_blocks=512)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], sp, use_tqdm=False)
    return {k: o.outputs[0].token_ids for k, o in zip(prompts, outs, strict=True)}


def test_pd_is_token_identical_and_frees_prefill_blocks(cluster, prompts, reference):
    p, d = cluster["P"], cluster["D1"]
    keys = list(PROMPT_LENS)
    pre = {k: submit_prefill(p, prompts[k]) for k in keys}
    dec = {}
    for k in keys:  # each decode starts as soon as its prefill is done, as behind a proxy
        out = p.wait(pre[k])
        assert out["tokens"] == reference[k][:1], k
        params = out["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        assert params["remote_num_tokens"] == len(prompts[k])
        assert len(params["remote_block_ids"]) == -(-len(prompts[k]) // 16)
        dec[k] = submit_decode(d, prompts[k], params)
    for k in keys:
        out = d.wait(dec[k])
        assert out["finish_reason"] == "length", out
        assert out["tokens"] == reference[k], k
        assert out["external_cached"] == len(prompts[k]), out
    # Read-completion notifications free the prefill side's blocks long before the lease.
    assert assert_all_free(p, within=LEASE_S * 3) < LEASE_S
    assert_all_free(d, within=5)


def test_decode_with_local_prefix_hit_reads_only_the_rest(cluster, prompts, reference):
    p, d = cluster["P"], cluster["D1"]
    first = p.wait(submit_prefill(p, prompts["block_multiple"]))["kv_transfer_params"]
    d.wait(submit_decode(d, prompts["block_multiple"], first))
    params = p.wait(submit_prefill(p, prompts["extended"]))["kv_transfer_params"]
    out = d.wait(submit_decode(d, prompts["extended"], params))
    assert out["tokens"] == reference["extended"]
    assert (out["local_cached"], out["external_cached"]) == (64, 30)
    assert assert_all_free(p, within=LEASE_S * 3) < LEASE_S
    assert_all_free(d, within=5)


def test_lease_frees_blocks_when_decode_never_comes(cluster, prompts):
    p = cluster["P"]
    p.wait(submit_prefill(p, prompts["long"]))
    st = p.call("status")
    assert st["busy"] and st["free_blocks"] < st["num_blocks"]
    elapsed = assert_all_free(p, within=LEASE_S * 4)
    assert LEASE_S * 0.7 <= elapsed <= LEASE_S + 3
    assert "lease expired" in p.log()


def test_release_frees_at_once_and_twice_is_harmless(cluster, prompts):
    p = cluster["P"]
    params = p.wait(submit_prefill(p, prompts["short"]))["kv_transfer_params"]
    p.call("release", kv_transfer_params=params)
    assert assert_all_free(p, within=LEASE_S * 3) < LEASE_S
    p.call("release", kv_transfer_params=params)
    assert_all_free(p, within=2)


def test_forged_params_fail_clearly_and_hold_nothing(cluster, prompts, reference):
    p, d = cluster["P"], cluster["D1"]
    prompt = prompts["forged"]
    good = p.wait(submit_prefill(p, prompt))["kv_transfer_params"]
    blocks = good["remote_block_ids"]
    other = [b + 100 for b in blocks]
    changed = [prompt[0] + 1, *prompt[1:]]
    # Malformed params are refused when the request arrives (validate_kv_transfer_params);
    # well-formed forgeries are refused by the prefill instance's claim check.
    intake = [  # (prompt, params, what the refusal says)
        (prompt, {**good, "remote_block_ids": "all"}, "Expected `array`, got `str`"),
        (prompt, {**good, "remote_block_ids": [-1, *blocks[1:]]}, "Expected `int` >= 0"),
        (prompt, {**good, "remote_port": "80"}, "at `$.remote_port`"),
        (prompt, {**good, "do_remote_prefill": "yes"}, "must be true or false"),
        (prompt, {**good, "remote_block_ids": blocks[:-1]}, "needs 4 blocks"),
    ]
    for pr, params, message in intake:
        out = d.wait(submit_decode(d, pr, params))
        assert out["finish_reason"] == "rejected" and message in out["error"], out
    claimed = [  # (prompt, params, what the decode instance's log must say)
        (prompt, {**good, "remote_request_id": "nope"}, "holds no blocks for request 'nope'"),
        (prompt, {**good, "remote_block_ids": other}, "other blocks"),
        (changed, good, "prompt differs from the prompt prefilled here"),
    ]
    ids = [submit_decode(d, pr, params) for pr, params, _ in claimed]
    for cid, (_, _, message) in zip(ids, claimed, strict=True):
        out = d.wait(cid)
        assert out["finish_reason"] == "error" and "KV cache load failed" in out["error"], out
        assert message in d.log(), message
    # The genuine params still work: the forged ones disturbed nothing.
    out = d.wait(submit_decode(d, prompt, good))
    assert out["tokens"] == reference["forged"]
    assert assert_all_free(p, within=LEASE_S * 3) < LEASE_S
    assert_all_free(d, within=5)


def test_incompatible_or_impostor_peer_is_refused(cluster, prompts, caplog):
    import zmq

    from kvferry.kv_transfer.connectors.pd import handshake as hs

    d = cluster["D1"]
    ours = d.ready["compat"]
    theirs = ours.replace("dtype=float32", "dtype=bfloat16")
    info = hs.AgentInfo("impostor", "agent-x", b"md", 0, 1, 16, 64, 4096, "DRAM", 0, [1] * 4)
    ctx = zmq.Context()
    servers = [
        hs.SideChannelServer(ctx, "127.0.0.1", 0, hs.Codec(hs.Compat(theirs)), lambda r, p: info),
        hs.SideChannelServer(ctx, "127.0.0.1", 0, hs.Codec(hs.Compat(ours)), lambda r, p: info),
    ]
    try:
        prompt = prompts["short"]
        ids = [
            submit_decode(d, prompt, fake_params(prompt, "fake", servers[0].port)),
            submit_decode(d, prompt, fake_params(prompt, "fake2", servers[1].port)),
        ]
        for cid in ids:
            out = d.wait(cid)
            assert out["finish_reason"] == "error", out
        log = d.log()
        # The refusing side logs both descriptions; the peer only learns it was refused.
        assert "refused: incompatible" in log and "dtype=bfloat16" not in log
        assert "the peer is engine 'impostor', but kv_transfer_params name engine 'fake2'" in log
        assert any(
            "incompatible peer" in m and "dtype=bfloat16" in m and "dtype=float32" in m
            for m in (r.getMessage() for r in caplog.records)
        )
    finally:
        for server in servers:
            server.close()
        ctx.term()
    assert_all_free(d, within=5)


def test_prefill_killed_mid_transfer(cluster, prompts, reference):
    """P dies right after granting D2's claim (D2 posts its READ after that): D2 recomputes
    (policy recompute); D1 then asks the dead P for another request and fails (policy fail).
    Both keep serving."""
    p, d1, d2 = cluster["P"], cluster["D1"], cluster["D2"]
    a = p.wait(submit_prefill(p, prompts["kill_a"]))["kv_transfer_params"]
    b = p.wait(submit_prefill(p, prompts["kill_b"]))["kv_transfer_params"]
    d2.call("slow_post", engine_id=a["remote_engine_id"], delay=0.5)
    p.call("die_after_claim")
    out = d2.wait(submit_decode(d2, prompts["kill_a"], a))
    assert p.proc.wait(10) == -9
    assert out["finish_reason"] == "length" and out["tokens"] == reference["kill_a"], out
    assert "NIXL transfer error" in d2.log()
    out = d1.wait(submit_decode(d1, prompts["kill_b"], b))
    assert out["finish_reason"] == "error", out
    assert "no answer from the NIXL side channel" in d1.log()
    for d in (d1, d2):
        out = d.wait(d.submit("generate", prompt=prompts["short"], max_tokens=MAX_TOKENS))
        assert out["tokens"] == reference["short"]
        assert_all_free(d, within=5)
