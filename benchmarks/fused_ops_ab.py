"""The fused elementwise kernels (``csrc/fused_ops.c``) against the torch ops, in one engine.

One ``LLM`` on a benchmark model; each round generates fresh prompts twice, once with the
fused kernels attached to every norm, attention and MLP module and once with them detached
(the torch ops), in alternating order. Everything else (weights, GEMM path, attention kernels,
KV pool) is the same object, so the paired ratio per round is the kernels' effect alone.

    .venv/bin/python benchmarks/fused_ops_ab.py --model mid --dtype bfloat16 --prompts 64
    .venv/bin/python benchmarks/fused_ops_ab.py --model qwen3-0.6b --dtype bfloat16 --prompts 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.connector_cost import paired_summary
from benchmarks.harness.models import bench_model
from benchmarks.harness.results import result_path, write_results_json


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="mid", help="a benchmark model name (benchmarks/models.py), or a folder"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", help="results JSON (default: .bench/results/fused_ops_ab.json)")
    args = ap.parse_args(argv)

    from kvferry import LLM, SamplingParams

    folder = Path(args.model) if Path(args.model).is_dir() else bench_model(args.model)
    llm = LLM(model=str(folder), dtype=args.dtype, max_model_len=2048)
    vocab = llm.engine.config.model_config.arch.vocab_size
    model = llm.engine.executor.worker.model
    modules = [m for m in model.modules() if getattr(m, "fused", None) is not None]
    if not modules:
        sys.exit("no fused kernels attached (no C compiler, or KVFERRY_NATIVE_KERNELS=0)")
    ops = modules[0].fused
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def run(fused: bool) -> float:
        for m in modules:
            m.fused = ops if fused else None
        prompts = [
            {"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(64, 256))]}
            for _ in range(args.prompts)
        ]
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return args.prompts * args.max_tokens / (time.perf_counter() - t)

    run(True)  # warm-up: kernel builds, first touch of the KV pool
    rates: dict[str, list[float]] = {"fused": [], "torch": []}
    for r in range(args.rounds):
        for name in ("fused", "torch") if r % 2 == 0 else ("torch", "fused"):
            rates[name].append(run(name == "fused"))
        print(f"round {r}: fused {rates['fused'][-1]:.1f} tok/s, torch {rates['torch'][-1]:.1f}")
    gains = [f / t - 1.0 for f, t in zip(rates["fused"], rates["torch"], strict=True)]
    summary: dict[str, Any] = paired_summary(gains)
    print(
        f"{folder.name} {args.dtype} p{args.prompts}: fused {statistics.median(rates['fused']):.1f}"
        f" vs torch {statistics.median(rates['torch']):.1f} output tok/s; paired gain"
        f" {summary['median']:+.1%} [{summary['ci95'][0]:+.1%}, {summary['ci95'][1]:+.1%}]"
    )
    out = write_results_json(
        args.out or result_path("fused_ops_ab"),
        {"settings": vars(args), "tokens_per_s": rates, "paired_gain": summary},
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
