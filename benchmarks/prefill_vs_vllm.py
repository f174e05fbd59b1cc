"""Prefill speed online, kvferry vs vLLM CPU: prompt tokens/s of one prompt at a time.

Each server (``kvferry serve``, ``vllm serve``: the serving benchmark's matched settings, one
at a time, launches alternating over ``--rounds``) gets random token-id prompts of each
length, one request at a time, ``max_tokens=1``, every prompt new (no prefix-cache hits). The
time of a request is one prefill, one logits row and the HTTP round trip, as a user sees it.
The median over each launch's prompts is reported per length, then the median over launches.

    .venv/bin/python benchmarks/prefill_vs_vllm.py                         # mid fp32, 512/2048/4096
    .venv/bin/python benchmarks/prefill_vs_vllm.py --lengths 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.harness.machine import machine_info
from benchmarks.harness.models import bench_model
from benchmarks.harness.paths import RESULTS_DIR
from benchmarks.harness.quiet import read_loadavg, wait_until
from benchmarks.harness.vllm_env import default_vllm_python
from benchmarks.harness.vllm_server import BACKENDS, LABELS, ServerSettings, serving


def time_prompts(url: str, lengths: list[int], reps: int, rng: random.Random) -> dict[int, float]:
    """Median seconds of one ``max_tokens=1`` completion per prompt length."""
    times: dict[int, list[float]] = {n: [] for n in lengths}
    with httpx.Client(timeout=600.0) as client:

        def complete(ids: list[int]) -> float:
            body = {"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            r = client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            return time.perf_counter() - start

        complete([rng.randrange(1000, 30000) for _ in range(64)])  # warm-up
        for _ in range(reps):
            for n in lengths:
                times[n].append(complete([rng.randrange(1000, 30000) for _ in range(n)]))
    return {n: statistics.median(ts) for n, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="mid")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", default="512,2048,4096")
    ap.add_argument("--reps", type=int, default=3, help="prompts per length and launch")
    ap.add_argument("--rounds", type=int, default=2, help="launches per server (alternating)")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--max-load", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "prefill_vs_vllm.json")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    backends = args.backends.split(",")
    model = bench_model(args.model, max(lengths) + 64)
    settings = ServerSettings(model_dir=model, dtype=args.dtype, max_model_len=max(lengths) + 64)
    vllm_python = default_vllm_python()
    rng = random.Random(0)
    runs: dict[str, list[dict[int, float]]] = {b: [] for b in backends}
    for r in range(args.rounds):
        order = backends if r % 2 == 0 else backends[::-1]
        for backend in order:
            wait_until(read_loadavg, args.max_load, 300.0, "load average", print)
            logs = RESULTS_DIR / "prefill_vs_vllm_logs"
            with serving(backend, settings, logs, vllm_python) as srv:
                medians = time_prompts(srv.url, lengths, args.reps, rng)
            runs[backend].append(medians)
            print(backend, {n: f"{n / s:.0f} tok/s" for n, s in medians.items()}, flush=True)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "args": vars(args) | {"out": str(args.out)},
    }
    print(f"\n{'prompt':>7} " + " ".join(f"{LABELS[b]:>14}" for b in backends) + "   ratio")
    rows = []
    for n in lengths:
        rate = {b: n / statistics.median(run[n] for run in runs[b]) for b in backends}
        ratio = rate["kvferry"] / rate["vllm"] if {"kvferry", "vllm"} <= set(rate) else None
        rows.append({"prompt": n, "tok_s": rate, "kvferry_over_vllm": ratio})
        cells = " ".join(f"{rate[b]:>10.0f} t/s" for b in backends)
        print(f"{n:>7} {cells}   {'' if ratio is None else f'{ratio:.2f}x'}")
    report["rows"] = rows
    report["runs"] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
