"""Prefill/decode disaggregation with the NixlConnector across real process boundaries.

Each instance is its own Python process (``tests/nixl_harness.py``): a prefill instance P, a
decode instance D1 (``kv_load_failure_policy="fail"``) and a decode instance D2
(``recompute``). The last test has P kill itself in the middle of a transfer. Params travel from P
to D through this test, as the proxy would carry them; the side channel and the NIXL READs
(UCX over loopback, host memory) cross the process boundary. Greedy outputs are compared
with a single ordinary instance in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, SamplingParams

pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")

HARNESS = Path(__file__).with_name("nixl_harness.py")
MAX_TOKENS = 12
LEASE_S = 4.0


class Instance:
    """A harness process: send commands, wait for their replies by id."""

    def __init__(self, name: str, model_dir: Path, kv: dict[str, Any], log: Path):
        self.name, self.log_path = name, log
        env = {**os.environ, "UCX_NET_DEVICES": "lo", "KVFERRY_LOG_LEVEL": "INFO"}
        cmd = [sys.executable, str(HARNESS), str(model_dir), json.dumps(kv)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env=env,
        )
        self._replies: dict[str, dict[str, Any]] = {}
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self._cv:
                self._replies[msg.get("id") or "ready"] = msg
                self._cv.notify_all()

    def wait(self, cid: str, timeout: float = 60.0) -> dict[str, Any]:
        with self._cv:
            if not self._cv.wait_for(
                lambda: cid in self._replies or self.proc.poll() is not None, timeout
            ):
                raise TimeoutError(f"{self.name}: no reply to {cid} in {timeout}s\n{self.log()}")
            if cid not in self._replies:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode})\n{self.log()}")
            return self._replies.pop(cid)

    def submit(self, op: str, **kw: Any) -> str:
        cid = uuid.uuid4().hex[:8]
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "id": cid, **kw}) + "\n")
        self.proc.stdin.flush()
        return cid

    def call(self, op: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        return self.wait(self.submit(op, **kw), timeout)

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.submit("exit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _kv(role: str, policy: str = "fail", **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "side_channel_port": 0,
            "handshake_timeout": 1.5,
            "transfer_timeout": 10.0,
            "kv_lease_duration": LEASE_S,
            "heartbeat_interval": 0.5,
            **extra,
        },
    }


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("nixl-logs")
    specs = {
        "P": _kv("kv_producer"),
        "D1": _kv("kv_consumer", "fail"),
        "D2": _kv("kv_consumer", "recompute"),
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


def _prefill(p: Instance, prompt: list[int]) -> str:
    return p.submit(
        "generate", prompt=prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )


def _decode(d: Instance, prompt: list[int], params: Any) -> str:
    return d.submit("generate", prompt=prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)


def _assert_all_free(inst: Instance, within: float) -> float:
    st = inst.call("wait_idle", timeout=within + 30, within=within)
    assert st["idle"] and st["free_blocks"] == st["num_blocks"], (inst.name, st)
    return float(st["elapsed"])


def test_pd_is_token_identical_and_frees_prefill_blocks(cluster, prompts, reference):
    p, d = cluster["P"], cluster["D1"]
    keys = list(PROMPT_LENS)
    pre = {k: _prefill(p, prompts[k]) for k in keys}
    dec = {}
    for k in keys:  # each decode starts as soon as its prefill is done, as behind a proxy
        out = p.wait(pre[k])
        assert out["tokens"] == reference[k][:1], k
        params = out["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        assert params["remote_num_tokens"] == len(prompts[k])
        assert len(params["remote_block_ids"]) == -(-len(prompts[k]) // 16)
        dec[k] = _decode(d, prompts[k], params)
    for k in keys:
        out = d.wait(dec[k])
        assert out["finish_reason"] == "length", out
        assert out["tokens"] == reference[k], k
        assert out["external_cached"] == len(prompts[k]), out
    # Read-completion notifications free the prefill side's blocks long before the lease.
    assert _assert_all_free(p, within=LEASE_S * 3) < LEASE_S
    _assert_all_free(d, within=5)


def test_decode_with_local_prefix_hit_reads_only_the_rest(cluster, prompts, reference):
    p, d = cluster["P"], cluster["D1"]
    first = p.wait(_prefill(p, prompts["block_multiple"]))["kv_transfer_params"]
    d.wait(_decode(d, prompts["block_multiple"], first))
    params = p.wait(_prefill(p, prompts["extended"]))["kv_transfer_params"]
    out = d.wait(_decode(d, prompts["extended"], params))
    assert out["tokens"] == reference["extended"]
    assert (out["local_cached"], out["external_cached"]) == (64, 30)
    assert _assert_all_free(p, within=LEASE_S * 3) < LEASE_S
    _assert_all_free(d, within=5)


def test_lease_frees_blocks_when_decode_never_comes(cluster, prompts):
    p = cluster["P"]
    p.wait(_prefill(p, prompts["long"]))
    st = p.call("status")
    assert st["busy"] and st["free_blocks"] < st["num_blocks"]
    elapsed = _assert_all_free(p, within=LEASE_S * 4)
    assert LEASE_S * 0.7 <= elapsed <= LEASE_S + 3
    assert "lease expired" in p.log()


def test_release_frees_at_once_and_twice_is_harmless(cluster, prompts):
    p = cluster["P"]
    params = p.wait(_prefill(p, prompts["short"]))["kv_transfer_params"]
    p.call("release", kv_transfer_params=params)
    assert _assert_all_free(p, within=LEASE_S * 3) < LEASE_S
    p.call("release", kv_transfer_params=params)
    _assert_all_free(p, within=2)


def test_forged_params_fail_clearly_and_hold_nothing(cluster, prompts, reference):
    p, d = cluster["P"], cluster["D1"]
    prompt = prompts["forged"]
    good = p.wait(_prefill(p, prompt))["kv_transfer_params"]
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
        out = d.wait(_decode(d, pr, params))
        assert out["finish_reason"] == "rejected" and message in out["error"], out
    claimed = [  # (prompt, params, what the decode instance's log must say)
        (prompt, {**good, "remote_request_id": "nope"}, "holds no blocks for request 'nope'"),
        (prompt, {**good, "remote_block_ids": other}, "other blocks"),
        (changed, good, "prompt differs from the prompt prefilled here"),
    ]
    ids = [_decode(d, pr, params) for pr, params, _ in claimed]
    for cid, (_, _, message) in zip(ids, claimed, strict=True):
        out = d.wait(cid)
        assert out["finish_reason"] == "error" and "KV cache load failed" in out["error"], out
        assert message in d.log(), message
    # The genuine params still work: the forged ones disturbed nothing.
    out = d.wait(_decode(d, prompt, good))
    assert out["tokens"] == reference["forged"]
    assert _assert_all_free(p, within=LEASE_S * 3) < LEASE_S
    _assert_all_free(d, within=5)


def _fake_params(prompt: list[int], engine_id: str, port: int) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": engine_id,
        "remote_request_id": "r1",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": list(range(-(-len(prompt) // 16))),
        "remote_num_tokens": len(prompt),
        "tp_size": 1,
    }


def test_incompatible_or_impostor_peer_is_refused(cluster, prompts, caplog):
    import zmq

    from kvferry.kv_transfer.connectors.nixl import handshake as hs

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
            _decode(d, prompt, _fake_params(prompt, "fake", servers[0].port)),
            _decode(d, prompt, _fake_params(prompt, "fake2", servers[1].port)),
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
    _assert_all_free(d, within=5)


def test_prefill_killed_mid_transfer(cluster, prompts, reference):
    """P dies right after granting D2's claim (D2 posts its READ after that): D2 recomputes
    (policy recompute); D1 then asks the dead P for another request and fails (policy fail).
    Both keep serving."""
    p, d1, d2 = cluster["P"], cluster["D1"], cluster["D2"]
    a = p.wait(_prefill(p, prompts["kill_a"]))["kv_transfer_params"]
    b = p.wait(_prefill(p, prompts["kill_b"]))["kv_transfer_params"]
    d2.call("slow_post", engine_id=a["remote_engine_id"], delay=0.5)
    p.call("die_after_claim")
    out = d2.wait(_decode(d2, prompts["kill_a"], a))
    assert p.proc.wait(10) == -9
    assert out["finish_reason"] == "length" and out["tokens"] == reference["kill_a"], out
    assert "NIXL transfer error" in d2.log()
    out = d1.wait(_decode(d1, prompts["kill_b"], b))
    assert out["finish_reason"] == "error", out
    assert "no answer from the NIXL side channel" in d1.log()
    for d in (d1, d2):
        out = d.wait(d.submit("generate", prompt=prompts["short"], max_tokens=MAX_TOKENS))
        assert out["tokens"] == reference["short"]
        _assert_all_free(d, within=5)
