"""What the deployment secret costs P/D: TTFT and throughput with authentication on vs off.

Two parts:

1. **In process**: the extra work authentication adds to one P/D request, timed in
   isolation (sign the params, verify them at the decode instance's intake and scheduling,
   MAC and check the claim, its proof and its answer, one heartbeat and its answer; minus the
   same handling without a secret), as a share of the measured TTFT. This is the cost that
   does not drown in the noise of a shared machine.
2. **End to end**: two P/D deployments, each a prefill and a decode ``kvferry serve``
   (NixlConnector, NIXL/UCX on loopback) behind ``kvferry proxy``, one without and one with a
   deployment secret (``KVFERRY_KV_SECRET_FILE``), both up at once. Every prompt goes to one
   and then the other, the order alternating, and the cost is the median of the per-pair
   ratios with a bootstrap interval: drift on a shared machine hits both halves of a pair
   alike. TTFT pairs are single streamed requests; throughput pairs are bursts of
   ``--concurrency`` fresh prompts.

    .venv/bin/python benchmarks/pd_auth_cost.py                 # tiny model, ~3 minutes
    .venv/bin/python benchmarks/pd_auth_cost.py --requests 100 --bursts 30   # tighter interval
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import timeit
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm

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
    from kvferry.kv_transfer.connectors.pd import handshake as hs
    from kvferry.kv_transfer.connectors.pd.auth import EnvelopeAuth, ParamsSigner, PeerAuth
    from kvferry.kv_transfer.connectors.pd.params import (
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


def _env(secret: Path | None) -> dict[str, str]:
    env = serve_env()
    env.pop("KVFERRY_KV_SECRET", None)
    env.pop("KVFERRY_KV_SECRET_FILE", None)
    if secret is not None:
        env["KVFERRY_KV_SECRET_FILE"] = str(secret)
    return env


def _median_ci(values: list[float], reps: int = 2000) -> tuple[float, float, float]:
    """Median of ``values`` and a bootstrap 95% interval around it."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    return statistics.median(values), meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def measure(
    model: Path,
    logs: Path,
    secret: Path,
    prompts: list[list[int]],
    bursts: list[list[list[int]]],
    max_tokens: int,
) -> dict[str, Any]:
    """Both deployments up at once, idle but for the request being timed: every prompt goes
    to one and then the other (order alternating), so each pair sees the same machine."""
    with ExitStack() as stack:
        urls = {
            "off": stack.enter_context(
                pd_deployment(model, logs, FLAGS, (nixl_kv(16201), nixl_kv(16301)),
                              env=_env(None), proxy_env=_env(None), tag="-off")
            ).proxy,
            "on": stack.enter_context(
                pd_deployment(model, logs, FLAGS, (nixl_kv(16401), nixl_kv(16501)),
                              env=_env(secret), proxy_env=_env(secret), tag="-on")
            ).proxy,
        }  # fmt: skip
        for url in urls.values():
            for warm in make_prompts(2, 1000, seed=99, min_len=256, max_len=512):
                stream_completion(url, warm, 4, {})
        ttft: dict[str, list[float]] = {"off": [], "on": []}
        for i, prompt in enumerate(tqdm(prompts, desc="TTFT pairs")):
            for mode in alternating(("off", "on"), i):
                out: dict[str, Any] = {}
                stream_completion(urls[mode], prompt, max_tokens, out)
                ttft[mode].append(out["ttft"])
        tput: dict[str, list[float]] = {"off": [], "on": []}
        for i, burst in enumerate(tqdm(bursts, desc="throughput pairs")):
            for mode in alternating(("off", "on"), i):
                tput[mode].append(_burst(urls[mode], burst, max_tokens))
    for tag, secured in (("off", False), ("on", True)):
        log = (logs / f"decode-{tag}.log").read_text()
        authenticated = "side channel authenticated" in log
        assert authenticated == secured, f"decode-{tag}: authentication not as asked"
    return {"ttft": ttft, "tokens_per_s": tput}


def _burst(url: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tokens per second of ``prompts`` sent all at once."""
    outs: list[dict[str, Any]] = [{} for _ in prompts]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(
            pool.map(
                lambda a: stream_completion(url, a[0], max_tokens, a[1]),
                zip(prompts, outs, strict=True),
            )
        )
    return sum(o["tokens"] for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=40, help="TTFT pairs")
    ap.add_argument("--bursts", type=int, default=12, help="throughput pairs")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    model = get_model(args.model)
    vocab = model_vocab_size(model)
    prompts = make_prompts(args.requests, vocab, seed=3, min_len=256, max_len=1024)
    flat = make_prompts(args.bursts * args.concurrency, vocab, seed=4, min_len=256, max_len=1024)
    bursts = [flat[i : i + args.concurrency] for i in range(0, len(flat), args.concurrency)]
    logs = Path(tempfile.mkdtemp(prefix="kvferry-pd-auth-"))
    secret = logs / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)

    work_s = auth_work_per_request()
    raw = measure(model, logs, secret, prompts, bursts, args.max_tokens)
    ttft, tput = raw["ttft"], raw["tokens_per_s"]
    ttft_ratio = [b / a for a, b in zip(ttft["off"], ttft["on"], strict=True)]
    tput_ratio = [b / a for a, b in zip(tput["off"], tput["on"], strict=True)]
    result = {
        **run_header(),
        "model": model.name,
        "args": vars(args),
        "auth_work_per_request_s": work_s,
        "ttft_median_s": {m: statistics.median(v) for m, v in ttft.items()},
        "tokens_per_s_median": {m: statistics.median(v) for m, v in tput.items()},
        "ttft_ratio_median_ci": _median_ci(ttft_ratio),
        "tokens_per_s_ratio_median_ci": _median_ci(tput_ratio),
        "raw": raw,
    }
    out = write_json(result_path("pd_auth_cost"), result)
    print(report(result, args))
    print(f"results: {out}")


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    work_s = result["auth_work_per_request_s"]
    ttft, tput = result["ttft_median_s"], result["tokens_per_s_median"]
    t_med, t_lo, t_hi = result["ttft_ratio_median_ci"]
    r_med, r_lo, r_hi = result["tokens_per_s_ratio_median_ci"]

    def pct(x: float) -> str:
        return f"{100 * (x - 1):+.1f}%"

    table = markdown_table(
        ["metric", "auth off", "auth on", "on / off, median of pairs", "95% interval"],
        [
            ["TTFT median (ms)", f"{1000 * ttft['off']:.1f}", f"{1000 * ttft['on']:.1f}",
             pct(t_med), f"{pct(t_lo)} .. {pct(t_hi)}"],
            [f"throughput, {args.concurrency} at a time (tok/s)", f"{tput['off']:.1f}",
             f"{tput['on']:.1f}", pct(r_med), f"{pct(r_lo)} .. {pct(r_hi)}"],
        ],
    )  # fmt: skip
    return (
        f"## P/D with authentication off vs on ({result['model']}, fp32, prompts of 256-1024 "
        f"tokens, {args.max_tokens} output tokens; {args.requests} TTFT pairs, {args.bursts} "
        f"throughput pairs)\n\n{table}\n\nauthentication work per request, in process: "
        f"{1e6 * work_s:.0f} us ({100 * work_s / ttft['off']:.2f}% of the TTFT median)"
    )


if __name__ == "__main__":
    main()
