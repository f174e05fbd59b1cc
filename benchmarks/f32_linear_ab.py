"""The small-step linear C kernel in front of oneDNN's packed GEMM against oneDNN alone, in one
engine: fp32 (``csrc/f32_linear.c``; with ``--kernel panels`` the AVX-512 panel kernel,
``csrc/f32_panel_linear.c``), or with ``--dtype bfloat16`` the bf16 kernel's AVX512-BF16 or
AMX variant (``csrc/bf16_linear.c``) in front of the packed bf16 weights.

One ``LLM`` on a benchmark model (fp32 on a CPU where the backend picks the kernel: the AVX2 or
AVX-512 level; bf16 on a CPU with AVX512_BF16); each round generates fresh prompts twice, once
with the kernel serving steps of at most ``--max-rows`` rows and once with every step on
oneDNN, in alternating order (see ``harness/kernel_ab.py``). Several ``--max-rows`` values run
one after the other, each against oneDNN, to place the crossover.

    .venv/bin/python benchmarks/f32_linear_ab.py --model mid --prompts 8
    .venv/bin/python benchmarks/f32_linear_ab.py --model mid --prompts 32 --max-rows 16,32,48
    .venv/bin/python benchmarks/f32_linear_ab.py --model mid --prompts 32 --kernel panels
    .venv/bin/python benchmarks/f32_linear_ab.py --model qwen3-0.6b --dtype bfloat16 \
        --prompts 1 --max-rows 1,2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.kernel_ab import ab_arguments, ab_rounds, ab_summary
from benchmarks.harness.models import bench_model
from benchmarks.harness.results import result_path, write_results_json


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ab_arguments(ap, "f32_linear_ab", prompts=8)
    ap.add_argument("--max-rows", default="32", help="comma-separated row limits to try")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--kernel",
        default="dense",
        choices=("dense", "panels"),
        help="the hooks switched: the dense-weight kernel's, or fp32's panel kernel's (AVX-512)",
    )
    args = ap.parse_args(argv)
    limits = [int(v) for v in args.max_rows.split(",")]

    from kvferry import LLM
    from kvferry.worker.cpu_backend import PackedStepsLinear, SmallStepsLinear

    folder = Path(args.model) if Path(args.model).is_dir() else bench_model(args.model)
    llm = LLM(model=str(folder), dtype=args.dtype, max_model_len=2048)
    model = llm.engine.executor.worker.model
    hooks = [getattr(m, "kernel", None) for m in model.modules()] + [model.logits_kernel]
    chain: list[Any] = []  # every hook and the ones behind it
    for h in hooks:
        while h is not None:
            chain.append(h)
            h = getattr(h, "rest", None)
    kind = PackedStepsLinear if args.kernel == "panels" else SmallStepsLinear
    small = [h for h in chain if isinstance(h, kind)]
    if not small:
        sys.exit(
            f"no {args.kernel} small-step kernel is attached (fp32 dense: not the AVX2 or AVX-512"
            " level; fp32 panels: not the AVX-512 level; bf16: no AVX512_BF16; no C compiler;"
            " or KVFERRY_NATIVE_KERNELS=0)"
        )

    results: dict[str, Any] = {}
    names = ("kernel", "onednn")
    for limit in limits:

        def attach(on: bool, limit: int = limit) -> None:
            for h in small:
                h.max_rows = limit if on else 0

        rates = ab_rounds(
            llm, attach, names, prompts=args.prompts, max_tokens=args.max_tokens, rounds=args.rounds
        )
        label = f"{folder.name} {args.dtype} p{args.prompts} kernel<={limit} rows"
        results[str(limit)] = {
            "tokens_per_s": rates,
            "paired_gain": ab_summary(label, rates, names),
        }
    out = write_results_json(
        args.out or result_path("f32_linear_ab"), {"settings": vars(args), "max_rows": results}
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
