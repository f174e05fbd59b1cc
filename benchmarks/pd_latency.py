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
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import RESULTS_DIR, machine_info, make_prompts, markdown_table
from benchmarks.models import get_model, model_vocab_size
from kvferry.entrypoints.demo import Instance, scrape, start, stop, wait_healthy, wait_listening


def _serve(name: str, model: Path, logs: Path, flags: list[str], kv: dict | None) -> Instance:
    argv = ["serve", str(model), "--port", "0", "--served-model-name", "m", *flags]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "KVFERRY_LOG_STATS_INTERVAL": "3600"}
    return start(name, argv, logs, env=env)


def _nixl(port: int) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_port": port,
        "kv_connector_extra_config": {"side_channel_port": 0},
    }


def _one(url: str, prompt: list[int], max_tokens: int, out: dict[str, Any]) -> None:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            n = len(chunk["choices"][0].get("token_ids") or []) if chunk.get("choices") else 0
            stamps.extend([time.perf_counter()] * n)
    out["ttft"] = stamps[0] - t0
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > a]
    out["itl"] = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    out["tokens"] = len(stamps)
    out["max_gap"] = max(gaps) if gaps else 0.0


def workload(url: str, prompts: list[list[int]], rate: float, max_tokens: int) -> list[dict]:
    results: list[dict[str, Any]] = [{} for _ in prompts]
    threads = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=_one, args=(url, p, max_tokens, results[i]))
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
    flags = [
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--max-num-batched-tokens",
        "2048",
        "--kv-cache-memory",
        "1GiB",
    ]
    logs = Path(tempfile.mkdtemp(prefix="kvferry-pd-bench-"))
    warm = [[5 + i for i in range(64)]]

    colo = _serve("colocated", model, logs, flags, None)
    try:
        url = wait_listening(colo)
        wait_healthy(url, inst=colo)
        workload(url, warm, 1.0, 4)
        colocated = _summary("colocated", workload(url, prompts, rate, args.max_tokens))
    finally:
        stop([colo])

    p = _serve("prefill", model, logs, flags, _nixl(16001))
    d = _serve("decode", model, logs, flags, _nixl(16101))
    procs = [p, d]
    try:
        p_url, d_url = wait_listening(p), wait_listening(d)
        proxy = start(
            "proxy", ["proxy", "--port", "0", "--prefill", p_url, "--decode", d_url], logs
        )
        procs.append(proxy)
        x_url = wait_listening(proxy)
        for inst in procs:
            wait_healthy(inst.url, inst=inst)
        workload(x_url, warm, 1.0, 4)
        pd = _summary("P/D (NixlConnector)", workload(x_url, prompts, rate, args.max_tokens))
        d_metrics = scrape(d_url)
    finally:
        stop(procs)

    xfer = {k: v for k, v in d_metrics.items() if "kv_connector" in k}
    result = {
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": model.name,
        "rate": rate,
        "max_tokens": args.max_tokens,
        "prompt_len": [lo, hi],
        "colocated": colocated,
        "pd": pd,
        "decode_transfer": xfer,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / ("pd_latency_quick.json" if args.quick else "pd_latency.json")
    out.write_text(json.dumps(result, indent=2))
    print(
        f"## P/D vs colocated ({model.name}, fp32, {args.requests} requests at {rate} req/s, "
        f"prompts {lo}-{hi} tokens, {args.max_tokens} output tokens, streamed)\n"
    )
    print(
        markdown_table(
            ["setup", "TTFT median (s)", "TTFT p90 (s)", "ITL mean (ms)", "max gap (ms)"],
            [
                [
                    s["name"],
                    f"{s['ttft_median']:.2f}",
                    f"{s['ttft_p90']:.2f}",
                    f"{1000 * s['itl_mean']:.1f}",
                    f"{1000 * s['max_gap']:.0f}",
                ]
                for s in (colocated, pd)
            ],
        )
    )
    print("\ndecode-side connector stats:", json.dumps(xfer))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
