"""Decode step time per batch size, each dtype against the others, next to its floors.

Each launch is a fresh process with one ``LLM`` in one dtype. For every batch size B it
prefills B fresh random prompts of ``--prompt-len`` tokens and times their ``--steps`` decode
steps one by one, ``--reps`` times; a decode step of B rows is the median of those steps
(:func:`~benchmarks.harness.decode_steps.timed_decode_steps`). Launches alternate between the
dtypes (``--launches`` each), so a machine that drifts slows all alike, and the dtype ratio is
taken launch pair by launch pair.

Floors per step: the weight bytes one pass reads over the machine's copy bandwidth (memory),
and the linear-layer FLOPs of B rows over its fp32 GEMM rate (compute; the bf16 rate where
the CPU has bf16 instructions), both measured before the first launch.

    .venv/bin/python benchmarks/decode_step.py                                  # qwen3-0.6b
    .venv/bin/python benchmarks/decode_step.py --model mid --batches 1,4,8,16 --launches 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.bandwidth import measure_copy_bandwidth, weight_bytes_per_pass
from benchmarks.harness.compute import linear_flops, load_config, measure_matmul_rate
from benchmarks.harness.decode_steps import random_prompts, timed_decode_steps
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.models import bench_model
from benchmarks.harness.paths import REPO_ROOT
from benchmarks.harness.quiet import read_loadavg, wait_until
from benchmarks.harness.results import result_path, run_header, write_json
from benchmarks.harness.throughput.rows import DTYPES

SHORT = {dtype: short for short, dtype in DTYPES.items()}


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One launch: decode step seconds per batch size (median over reps), and the CPU paths."""
    from kvferry import LLM

    llm = LLM(model=args.model_dir, dtype=args.child, max_model_len=args.prompt_len + 64)
    engine = llm.engine
    rng = random.Random(args.seed)
    # Builds the kernels and first touches the KV pool.
    timed_decode_steps(engine, random_prompts(engine, rng, 1, args.prompt_len), 1)
    steps: dict[str, float] = {}
    for batch in args.batches:
        times: list[float] = []
        for _ in range(args.reps):
            prompts = random_prompts(engine, rng, batch, args.prompt_len)
            times += timed_decode_steps(engine, prompts, args.steps)
        steps[str(batch)] = statistics.median(times)
    backend = llm.engine.executor.worker.model_runner.cpu_backend
    return {"step_s": steps, "cpu_paths": backend.describe() if backend else {}}


def launch(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", dtype, "--model-dir", args.model_dir]
    cmd += ["--batches", ",".join(map(str, args.batches)), "--steps", str(args.steps)]
    cmd += ["--reps", str(args.reps), "--prompt-len", str(args.prompt_len)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(args.threads)}
    env.setdefault("KVFERRY_LOG_LEVEL", "WARNING")
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def floors(args: argparse.Namespace, dtypes: list[str]) -> dict[str, Any]:
    """The machine's copy bandwidth and GEMM rates, and each dtype's floors per batch size."""
    from kvferry.worker.cpu_features import cpu_features

    cfg = load_config(args.model_dir)
    copy = measure_copy_bandwidth()
    # Without bf16 instructions torch's bf16 GEMM is an emulation no path of ours takes.
    native = {"float32"} | ({"bfloat16"} if cpu_features().native_bf16 else set())
    rates = {
        d: measure_matmul_rate(d, int(cfg["hidden_size"]), int(cfg["intermediate_size"]))
        for d in sorted(native)
    }
    flops = linear_flops(cfg).per_token
    per: dict[str, dict[str, dict[str, float]]] = {}
    for d in dtypes:
        # Where bf16 is widened to fp32 in registers, fp32's rate bounds it.
        gflops = max(rates[d].gflops if d in rates else 0.0, rates["float32"].gflops)
        mem_s = weight_bytes_per_pass(cfg, d) / (copy.gbps * 1e9)
        per[d] = {
            str(b): {"memory_s": mem_s, "compute_s": b * flops / (gflops * 1e9)}
            for b in args.batches
        }
    return {
        "copy_gbps": copy.gbps,
        "gemm_gflops": {d: r.gflops for d, r in rates.items()},
        "per_dtype": per,
    }


def report(doc: dict[str, Any]) -> str:
    dtypes = doc["settings"]["dtypes"]
    base = dtypes[-1]
    rows = []
    for b in map(str, doc["settings"]["batches"]):
        for d in dtypes:
            steps = [la["step_s"][b] for la in doc["launches"][d]]
            med = statistics.median(steps)
            fl = doc["floors"]["per_dtype"][d][b]
            floor = max(fl["memory_s"], fl["compute_s"])
            ratio = ""
            if d != base:
                pairs = zip(doc["launches"][base], doc["launches"][d], strict=True)
                ratio = (
                    f"{statistics.median(o['step_s'][b] / s['step_s'][b] for o, s in pairs):.2f}x"
                )
            rows.append(
                [
                    b,
                    SHORT.get(d, d),
                    f"{med * 1e3:.1f}",
                    f"{int(b) / med:.1f}",
                    f"{fl['memory_s'] * 1e3:.1f}",
                    f"{fl['compute_s'] * 1e3:.1f}",
                    f"{med / floor:.2f}x",
                    ratio,
                ]
            )
    head = [
        "batch",
        "dtype",
        "ms per step",
        "tok/s",
        "memory floor ms",
        "compute floor ms",
        "of floor",
        f"speed vs {SHORT.get(base, base)}",
    ]
    return markdown_table(head, rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="a benchmark model name, or a folder")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="the last is the baseline")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per batch size and launch")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--launches", type=int, default=2, help="launches per dtype, alternating")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-load", type=float, default=0.5, help="1-min load average to start")
    ap.add_argument("--allow-noise", action="store_true")
    ap.add_argument("--out", help="results JSON (default: .bench/results/decode_step.json)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.batches = [int(v) for v in str(args.batches).split(",")]
    if args.child:
        print(json.dumps(child(args)))
        return
    folder = Path(args.model) if Path(args.model).is_dir() else bench_model(args.model)
    args.model_dir = str(folder)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not args.allow_noise:
        wait_until(read_loadavg, args.max_load, 300.0, "1-min load average", print)
    doc: dict[str, Any] = {**run_header(), "model": folder.name}
    doc["settings"] = {k: v for k, v in vars(args).items() if k not in ("child", "model_dir")}
    doc["settings"]["dtypes"] = dtypes
    doc["floors"] = floors(args, dtypes)
    doc["launches"] = {d: [] for d in dtypes}
    for i in range(args.launches):
        for d in dtypes if i % 2 == 0 else dtypes[::-1]:
            result = launch(args, d)
            doc["launches"][d].append(result)
            steps = ", ".join(f"B={b} {s * 1e3:.1f} ms" for b, s in result["step_s"].items())
            print(f"launch {i} {d}: {steps}", flush=True)
    table = report(doc)
    doc["table"] = table
    out = write_json(Path(args.out) if args.out else result_path("decode_step"), doc)
    print(table)
    print(f"results: {out}")


if __name__ == "__main__":
    main()
