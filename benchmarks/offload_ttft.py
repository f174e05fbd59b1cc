"""TTFT vs prompt length: recompute vs a host-tier hit vs a disk-tier hit.

One request at a time, ``max_tokens=1`` (its time to first token), on the ~140M ``mid``
model in bf16, prompts of 512..8192 tokens. Modes:

* ``recompute``: no connector; the whole prompt is prefilled.
* ``host``: OffloadingConnector; the prompt ran once before, then the engine's own prefix
  cache was reset, so the prefix comes back from host memory.
* ``disk``: host tier of one chunk; the prompt's chunks went to files, and come back from
  there (files this engine wrote, so they are loaded straight away; the OS page cache is
  warm, as it would be on a busy server).
* ``disk-restart``: a new engine on the same folder: each file is read and checksummed
  once before it is offered, then loaded.

    .venv/bin/python benchmarks/offload_ttft.py            # full run, writes docs
    .venv/bin/python benchmarks/offload_ttft.py --quick    # smoke run: tiny model, short
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.cli import fill_quick_defaults
from benchmarks.harness.engines import drain, make_llm
from benchmarks.harness.kv_configs import offload_kv
from benchmarks.harness.markdown import markdown_table, update_doc
from benchmarks.harness.models import bench_model, model_vocab_size
from benchmarks.harness.paths import IMG_DIR, OFFLOAD_SCRATCH
from benchmarks.harness.plots import line_plot
from benchmarks.harness.prompts import random_tokens
from benchmarks.harness.results import result_path, write_results_json
from kvferry import SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
MODES = ["recompute", "host", "disk", "disk-restart"]


def ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    out = llm.generate([{"prompt_token_ids": prompt}], ONE, use_tqdm=False)[0]
    return float(out.metrics.ttft), int(out.metrics.num_external_cached_tokens)


def reset_local(llm: Any) -> None:
    drain(llm)
    assert llm.engine.scheduler.reset_prefix_cache(), "the engine still holds blocks"


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = bench_model(args.model, max(args.lengths) + 64)
    vocab = model_vocab_size(model)
    folder = OFFLOAD_SCRATCH / "ttft-disk"
    shutil.rmtree(folder, ignore_errors=True)
    engine_args = {
        "max_model_len": max(args.lengths) + 64,
        "num_kv_blocks": (max(args.lengths) + 64) // 16 + 16,
        "max_num_batched_tokens": args.batch_tokens,
    }
    chunk = {"blocks_per_chunk": args.blocks_per_chunk}
    configs = {
        "recompute": offload_kv("off"),
        "host": offload_kv("offload", **chunk),
        "disk": offload_kv("disk", folder, num_cpu_chunks=1, **chunk),
    }
    rng = random.Random(0)
    prompts = {n: [random_tokens(rng, n, vocab) for _ in range(args.reps)] for n in args.lengths}
    warm = random_tokens(rng, 256, vocab)
    results: dict[str, dict[int, list[float]]] = {m: {} for m in MODES}
    hits: dict[str, dict[int, int]] = {m: {} for m in MODES}

    def measure(mode: str, llm: Any, prompt: list[int], store_first: bool) -> None:
        if store_first:
            ttft(llm, prompt)  # computes it, and offloads it
            reset_local(llm)
        t, hit = ttft(llm, prompt)
        reset_local(llm)
        results[mode].setdefault(len(prompt), []).append(t)
        hits[mode][len(prompt)] = hit
        print(f"{mode:>12} {len(prompt):>6} tokens: ttft {t * 1e3:9.1f} ms, {hit} from offload")

    for mode in args.modes:
        restart = mode == "disk-restart"
        llm = make_llm(model, args.dtype, configs["disk" if restart else mode], **engine_args)
        # Warm up the very path measured (first calls of a shape set up kernels).
        for _ in range(2):
            ttft(llm, warm)
            reset_local(llm)
        for n in args.lengths:
            for prompt in prompts[n]:
                measure(mode, llm, prompt, store_first=mode in ("host", "disk"))
        drain(llm)
        llm.engine.shutdown()
    shutil.rmtree(folder, ignore_errors=True)
    results = {m: r for m, r in results.items() if r}
    median = {m: {n: statistics.median(v) for n, v in r.items()} for m, r in results.items()}
    return {"model": args.model, "dtype": args.dtype, "ttft_s": median, "hit_tokens": hits}


def report(res: dict[str, Any], lengths: list[int], write_docs: bool, quick: bool) -> str:
    med = res["ttft_s"]
    modes = [m for m in MODES if m in med]
    hit_modes = [m for m in modes if m != "recompute"]
    rows = []
    for n in lengths:
        row: list[Any] = [n] + [med[m][n] * 1e3 for m in modes]
        if "recompute" in med:
            row += [med["recompute"][n] / med[m][n] for m in hit_modes]
        rows.append(row)
    headers = ["prompt tokens"] + [f"{m} ms" for m in modes]
    if "recompute" in med:
        headers += [f"{m} speedup" for m in hit_modes]
    table = markdown_table(headers, rows)
    print(table)
    if write_docs and {"recompute", "host"} <= set(med):
        name = "offload_ttft_quick.png" if quick else "offload_ttft.png"
        plot = line_plot(
            IMG_DIR / name,
            lengths,
            {m: [med[m][n] * 1e3 for n in lengths] for m in modes},
            f"TTFT vs prompt length ({res['model']}, {res['dtype']})",
            "prompt tokens",
            "TTFT (ms)",
        )
        target = lengths[min(range(len(lengths)), key=lambda i: abs(lengths[i] - 4096))]
        speedup = med["recompute"][target] / med["host"][target]
        verdict = "met" if speedup >= 20 else "NOT met"
        if quick:
            verdict = "applies to the mid model at 4k tokens, not to this smoke run"
        update_doc(
            "offload_ttft" + ("_quick" if quick else ""),
            f"### TTFT vs prompt length{' (smoke run)' if quick else ''}\n\n"
            f"`benchmarks/offload_ttft.py{' --quick' if quick else ''}`: one request at a "
            f"time, model `{res['model']}` {res['dtype']}, median of the repetitions.\n\n"
            f"{table}\n\nHost-tier hit at {target} tokens: {speedup:.1f}x faster than "
            f"recompute (target >= 20x: {verdict}).\n\n![TTFT](img/{plot.name})\n",
        )
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, short prompts")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", type=int, nargs="*", default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--blocks-per-chunk", type=int, default=1)
    ap.add_argument(
        "--modes", nargs="*", default=MODES, choices=MODES, help="disk-restart needs disk first"
    )
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()
    fill_quick_defaults(
        args,
        model=("tiny", "mid"),
        lengths=([128, 256, 512], [512, 1024, 2048, 4096, 8192]),
        reps=(1, 3),
    )
    res = run(args)
    write_results_json(result_path("offload_ttft", args.quick), res)
    report(res, args.lengths, not args.no_docs, args.quick)


if __name__ == "__main__":
    main()
