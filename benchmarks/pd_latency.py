"""TTFT and inter-token latency: P/D disaggregation vs one colocated instance.

The same open-loop workload (requests sent at a fixed rate, 1k-4k-token prompts, streamed
greedy answers) goes first to one colocated ``kvferry serve`` instance, then through
``kvferry proxy`` to a prefill and a decode instance connected by NixlConnector (NIXL/UCX on
loopback). TTFT is measured at the client (request sent -> first streamed token), ITL as the
mean gap between later tokens. On a 2-core machine the P and D instances share the cores the
colocated instance has to itself, so this shows the protocol's cost, not P/D's capacity gain.

    .venv/bin/python benchmarks/pd_latency.py                 # mid model, 10 requests
    .venv/bin/python benchmarks/pd_latency.py --quick         # tiny model smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.kv_configs import nixl_kv
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.models import get_model, model_vocab_size
from benchmarks.harness.prompts import make_prompts
from benchmarks.harness.results import result_path, run_header, write_json
from benchmarks.harness.serving import pd_deployment, start_serve, stream_completion
from kvferry.entrypoints.demo import scrape, stop, wait_healthy, wait_listening


def workload(url: str, prompts: list[list[int]], rate: float, max_tokens: int) -> list[dict]:
    results: list[dict[str, Any]] = [{} for _ in prompts]
    threads = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=stream_completion, args=(url, p, max_tokens, results[i]))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return results


def _summary(name: str, res: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = sorted(r["ttft"] for r in res)
    return {
        "name": name,
        "ttft_median": statistics.median(ttft),
        "ttft_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "itl_mean": statistics.mean(r["itl"] for r in res),
        "max_gap": max(r["max_gap"] for r in res),
        "requests": res,
    }


FLAGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "4096",
    "--max-num-batched-tokens",
    "2048",
    "--kv-cache-memory",
    "1GiB",
]
WARM = [[5 + i for i in range(64)]]


def measure(
    model: Path, prompts: list[list[int]], rate: float, max_tokens: int
) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    """The workload on one colocated instance, then on P/D (prefill + decode + proxy): both
    summaries and the decode side's connector metrics."""
    logs = Path(tempfile.mkdtemp(prefix="kvferry-pd-bench-"))
    colo = start_serve("colocated", model, logs, FLAGS)
    try:
        url = wait_listening(colo)
        wait_healthy(url, inst=colo)
        workload(url, WARM, 1.0, 4)
        colocated = _summary("colocated", workload(url, prompts, rate, max_tokens))
    finally:
        stop([colo])
    with pd_deployment(model, logs, FLAGS, (nixl_kv(16001), nixl_kv(16101))) as urls:
        workload(urls.proxy, WARM, 1.0, 4)
        pd = _summary("P/D (NixlConnector)", workload(urls.proxy, prompts, rate, max_tokens))
        d_metrics = scrape(urls.decode)
    return colocated, pd, {k: v for k, v in d_metrics.items() if "kv_connector" in k}


def report(result: dict[str, Any], requests: int) -> str:
    lo, hi = result["prompt_len"]
    table = markdown_table(
        ["setup", "TTFT median (s)", "TTFT p90 (s)", "ITL mean (ms)", "max gap (ms)"],
        [
            [
                s["name"],
                f"{s['ttft_median']:.2f}",
                f"{s['ttft_p90']:.2f}",
                f"{1000 * s['itl_mean']:.1f}",
                f"{1000 * s['max_gap']:.0f}",
            ]
            for s in (result["colocated"], result["pd"])
        ],
    )
    return (
        f"## P/D vs colocated ({result['model']}, fp32, {requests} requests at "
        f"{result['rate']} req/s, prompts {lo}-{hi} tokens, {result['max_tokens']} output "
        f"tokens, streamed)\n\n{table}\n\ndecode-side connector stats: "
        f"{json.dumps(result['decode_transfer'])}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--rate", type=float, default=None, help="requests per second")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    model = get_model("tiny" if args.quick else "mid")
    lo, hi = (256, 1024) if args.quick else (1024, 4000)
    rate = args.rate or (1.0 if args.quick else 0.1)
    prompts = make_prompts(args.requests, model_vocab_size(model), seed=7, min_len=lo, max_len=hi)
    colocated, pd, xfer = measure(model, prompts, rate, args.max_tokens)
    result = {
        **run_header(),
        "model": model.name,
        "rate": rate,
        "max_tokens": args.max_tokens,
        "prompt_len": [lo, hi],
        "colocated": colocated,
        "pd": pd,
        "decode_transfer": xfer,
    }
    out = write_json(result_path("pd_latency", args.quick), result)
    print(report(result, args.requests))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
