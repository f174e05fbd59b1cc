"""What the deployment secret costs P/D: TTFT and throughput with authentication on vs off.

Two parts:

1. **In process**: the extra work authentication adds to one P/D request, timed in
   isolation (sign the params, verify them at the decode instance's intake and scheduling,
   MAC and check the claim, its proof and its answer, one heartbeat and its answer; minus the
   same handling without a secret), as a share of the measured TTFT. This is the cost that
   does not drown in the noise of a shared machine.
2. **End to end**: a prefill and a decode ``kvferry serve`` (NixlConnector, NIXL/UCX on
   loopback) behind ``kvferry proxy``, started once without and once with a deployment secret
   (``KVFERRY_KV_SECRET_FILE``), modes alternating per round: sequential streamed requests
   (TTFT), then the same prompts ``--concurrency`` at a time (throughput).

    .venv/bin/python benchmarks/pd_auth_cost.py                # tiny model, ~1 minute
    .venv/bin/python benchmarks/pd_auth_cost.py --rounds 3     # less noise
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.kv_configs import nixl_kv
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.models import get_model, model_vocab_size
from benchmarks.harness.prompts import make_prompts
from benchmarks.harness.results import result_path, run_header, write_json
from benchmarks.harness.serving import pd_deployment, serve_env, stream_completion
from benchmarks.harness.timing import alternating

FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-batched-tokens", "2048"]


def auth_work_per_request(n: int = 2000) -> float:
    """Seconds of extra work authentication adds to one P/D request (both instances): the
    same side-channel and params handling timed with and without a secret."""
    from kvferry.kv_transfer.connectors.nixl import handshake as hs
    from kvferry.kv_transfer.connectors.nixl.auth import EnvelopeAuth, ParamsSigner, PeerAuth
    from kvferry.kv_transfer.connectors.nixl.params import (
        check_signature,
        decode_params,
        parse_remote,
    )
    from kvferry.kv_transfer.secret import DeploymentSecret

    secret = DeploymentSecret(os.urandom(32), "bench")
    compat = hs.Compat("model=m weights=w dtype=float32 layout=kv2xNxB16xH2xD64xL4 protocol=2")
    blocks = list(range(64))  # a 1k-token prompt

    def auth() -> PeerAuth:
        return PeerAuth(
            EnvelopeAuth(secret.key_for("nixl-side-channel"), 60.0),
            ParamsSigner(secret.key_for("nixl-kv-params"), 660.0),
            "bench",
        )

    def request_work(secured: bool) -> float:
        p_codec = hs.Codec(compat, auth() if secured else None)
        d_codec = hs.Codec(compat, auth() if secured else None)
        signer = auth().params if secured else None

        def one_request() -> None:
            params = decode_params(
                engine_id="eng-P", request_id="cmpl-1", host="127.0.0.1", port=5600,
                block_ids=blocks, num_tokens=1024, cached_tokens=0, signer=signer,
            )  # fmt: skip
            for _ in range(2):  # intake, then scheduling
                remote = parse_remote(params, 16)
                check_signature(remote, signer)
            claim = hs.ClaimRequest(
                "eng-P", "cmpl-1", blocks, 1024, "d" * 32, "eng-D", "agent-D", remote.proof()
            )
            heartbeat = hs.HeartbeatRequest("eng-P", ["cmpl-1"], "eng-D")
            for req, reply in [
                (claim, hs.Granted("agent-P", 30.0)),
                (heartbeat, hs.Renewed({"cmpl-1": 30.0}, [])),
            ]:
                frame, nonce = d_codec.encode_request(req)
                p_codec.decode_request(frame, "d")  # MAC, freshness, proof
                d_codec.decode_reply(p_codec.encode_reply(reply, nonce), "p", nonce)

        return min(timeit.repeat(one_request, number=n // 5, repeat=5)) / (n // 5)

    return request_work(True) - request_work(False)


def run_mode(
    model: Path,
    logs: Path,
    secret: Path | None,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
) -> dict[str, Any]:
    env = serve_env()
    env.pop("KVFERRY_KV_SECRET", None)
    env.pop("KVFERRY_KV_SECRET_FILE", None)
    if secret is not None:
        env["KVFERRY_KV_SECRET_FILE"] = str(secret)
    tag = "on" if secret else "off"
    kvs = (nixl_kv(16201), nixl_kv(16301))
    with pd_deployment(model, logs, FLAGS, kvs, env=env, proxy_env=env, tag=f"-{tag}") as urls:
        url = urls.proxy
        for warm in prompts[:2]:
            stream_completion(url, warm, 4, {})
        seq: list[dict[str, Any]] = [{} for _ in prompts]
        for prompt, out in zip(prompts, seq, strict=True):
            stream_completion(url, prompt, max_tokens, out)
        par: list[dict[str, Any]] = [{} for _ in prompts]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(
                pool.map(
                    lambda a: stream_completion(url, a[0], max_tokens, a[1]),
                    zip(prompts, par, strict=True),
                )
            )
        wall = time.perf_counter() - t0
    log = (logs / f"decode-{tag}.log").read_text()
    authenticated = "side channel authenticated" in log
    assert authenticated == (secret is not None), f"decode-{tag}: authentication not as asked"
    return {
        "ttft": [r["ttft"] for r in seq],
        "tokens_per_s": sum(r["tokens"] for r in par) / wall,
        "requests_per_s": len(prompts) / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    model = get_model(args.model)
    prompts = make_prompts(
        args.requests, model_vocab_size(model), seed=3, min_len=256, max_len=1024
    )
    logs = Path(tempfile.mkdtemp(prefix="kvferry-pd-auth-"))
    secret = logs / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)

    work_s = auth_work_per_request()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for rnd in range(args.rounds):
        for mode in alternating(("off", "on"), rnd):
            res = run_mode(
                model,
                logs,
                secret if mode == "on" else None,
                prompts,
                args.max_tokens,
                args.concurrency,
            )
            runs[mode].append(res)

    off, on = _aggregate(runs["off"]), _aggregate(runs["on"])
    result = {
        **run_header(),
        "model": model.name,
        "args": vars(args),
        "auth_work_per_request_s": work_s,
        "auth_work_share_of_ttft": work_s / off["ttft_median_s"],
        "off": off,
        "on": on,
        "runs": runs,
    }
    out = write_json(result_path("pd_auth_cost"), result)
    print(report(result, args))
    print(f"results: {out}")


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, float]:
    ttft = [t for r in runs for t in r["ttft"]]
    return {
        "ttft_median_s": statistics.median(ttft),
        "ttft_mean_s": statistics.mean(ttft),
        "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in runs),
        "requests_per_s": statistics.mean(r["requests_per_s"] for r in runs),
    }


def _cost(a: float, b: float, lower_is_better: bool) -> str:
    change = (b - a) / a if lower_is_better else (a - b) / a
    return f"{100 * change:+.1f}%"


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    off, on, work_s = result["off"], result["on"], result["auth_work_per_request_s"]
    rows = [
        ("TTFT median (ms)", "ttft_median_s", 1000, True),
        ("TTFT mean (ms)", "ttft_mean_s", 1000, True),
        (f"throughput, {args.concurrency} at a time (tok/s)", "tokens_per_s", 1, False),
    ]
    table = markdown_table(
        ["metric", "auth off", "auth on", "cost"],
        [
            [label, f"{scale * off[k]:.1f}", f"{scale * on[k]:.1f}", _cost(off[k], on[k], lower)]
            for label, k, scale, lower in rows
        ],
    )
    return (
        f"## P/D with authentication off vs on ({result['model']}, fp32, {args.requests} "
        f"prompts of 256-1024 tokens, {args.max_tokens} output tokens, {args.rounds} "
        f"round(s))\n\n{table}\n\nauthentication work per request, in process: "
        f"{1e6 * work_s:.0f} us ({100 * work_s / off['ttft_median_s']:.2f}% of the TTFT median)"
    )


if __name__ == "__main__":
    main()
