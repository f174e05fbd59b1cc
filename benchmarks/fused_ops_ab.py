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
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.kernel_ab import ab_arguments, ab_rounds, ab_summary
from benchmarks.harness.models import bench_model
from benchmarks.harness.results import result_path, write_results_json


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ab_arguments(ap, "fused_ops_ab", prompts=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)

    from kvferry import LLM

    folder = Path(args.model) if Path(args.model).is_dir() else bench_model(args.model)
    llm = LLM(model=str(folder), dtype=args.dtype, max_model_len=2048)
    model = llm.engine.executor.worker.model
    modules = [m for m in model.modules() if getattr(m, "fused", None) is not None]
    if not modules:
        sys.exit("no fused kernels attached (no C compiler, or KVFERRY_NATIVE_KERNELS=0)")
    ops = modules[0].fused

    def attach(on: bool) -> None:
        for m in modules:
            m.fused = ops if on else None

    names = ("fused", "torch")
    rates = ab_rounds(
        llm, attach, names, prompts=args.prompts, max_tokens=args.max_tokens, rounds=args.rounds
    )
    summary = ab_summary(f"{folder.name} {args.dtype} p{args.prompts}", rates, names)
    out = write_results_json(
        args.out or result_path("fused_ops_ab"),
        {"settings": vars(args), "tokens_per_s": rates, "paired_gain": summary},
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
