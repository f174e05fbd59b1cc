"""The small-step linear kernels (``csrc/bf16_linear.c``, ``csrc/f32_linear.c``) against their
build at another git revision, both loaded in one process.

``kernel``: every linear weight of a model's shape (each layer's qkv, o, gate_up and down, and
the logits matrix) as a random tensor of its own in the kernel's dtype, so that a pass reads
the weights from memory, not from cache; for each ``--rows`` count, a pass is one call per
matrix on random inputs of that many rows; the best pass of ``--rounds`` alternating rounds
of the two builds, as ms and as GB/s of weights read, and the largest difference between
the two builds' outputs.

``engine``: one ``LLM`` whose linear layers and logits have the kernel's entry point swapped
between the two builds step by step over the 32 decode steps of fresh random prompts
(:func:`~benchmarks.harness.revision_build.paired_decode_steps`); the paired speed-up per
round.

    .venv/bin/python benchmarks/rows_linear_ab.py --baseline HEAD --rows 1,2,3,4,8
    .venv/bin/python benchmarks/rows_linear_ab.py --baseline HEAD~2 --kernel f32 \\
        --parts kernel,engine --engine-cases 1x160,8x160 --model mid
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.compute import load_config
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.revision_build import (
    BUILDS,
    add_ab_arguments,
    load_library_at,
    paired_decode_steps,
    parse_cases,
    resolve_ab_arguments,
    run_ab,
    step_summary,
)
from benchmarks.harness.timing import alternating

if TYPE_CHECKING:
    import torch

    from kvferry.native.rows_linear import RowsLinearKernel

DTYPES = {"bf16": "bfloat16", "f32": "float32"}
# Why an engine may serve its linear layers without the kernel, per kernel.
NO_HOOK = {
    "bf16": "on a CPU with bf16 instructions oneDNN's bf16 GEMM serves them instead",
    "f32": "the backend uses it at the AVX2 level only",
}

Weights = list[tuple[str, "torch.Tensor"]]


def kernel_class(kind: str) -> type[RowsLinearKernel]:
    if kind == "bf16":
        from kvferry.native.bf16_linear import BF16LinearKernel

        return BF16LinearKernel
    from kvferry.native.f32_linear import F32LinearKernel

    return F32LinearKernel


def check_variant(variant: str) -> None:
    """Exits where this CPU cannot run ``variant``: a kernel would die on an illegal
    instruction rather than fail."""
    from kvferry.worker.cpu_features import ISA_LEVELS, cpu_features

    own = cpu_features().cpu_isa
    if ISA_LEVELS.index(variant) > ISA_LEVELS.index(own):
        sys.exit(f"this CPU runs up to the {own} level; it cannot run the {variant} variant")


def current_kernel(kind: str, variant: str) -> RowsLinearKernel:
    from kvferry.native.build import load_library
    from kvferry.native.rows_linear import load_rows_kernel

    kernel = load_rows_kernel(kernel_class(kind), variant)
    if kernel is not None:
        return kernel
    name = kernel_class(kind).NAME
    if load_library(name) is None:
        sys.exit(f"the {name} kernel is not built here (no C compiler, or native kernels off)")
    sys.exit(f"this tree's {name} build has no {variant!r} variant")


def baseline_kernel(rev: str, kind: str, variant: str) -> RowsLinearKernel:
    """The kernel as built from ``rev``'s sources, in ``variant``."""
    cls = kernel_class(kind)
    lib = load_library_at(rev, f"{cls.NAME}.c", f"{cls.NAME}_baseline")
    try:
        return cls(lib, variant)
    except ValueError as e:
        sys.exit(f"{rev}'s {cls.NAME}.c: {e}")
    except AttributeError as e:  # a revision whose entry points this tree does not call
        sys.exit(f"{rev}'s {cls.NAME}.c lacks an entry point: {e}")


def layer_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """``{matrix: (outputs, inputs)}`` of one decoder layer, the projections fused as the
    engine fuses them."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg["intermediate_size"])
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def model_weights(cfg: Mapping[str, Any], dtype: torch.dtype, seed: int) -> Weights:
    """Every linear weight of ``cfg``'s shape, each layer's its own tensor, as ``(matrix,
    weight)``; scaled by 1/sqrt(inputs), so that outputs are near 1 and a difference between
    the builds reads in units of the dtype's rounding there."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    layer = layer_shapes(cfg)
    plan = [item for _ in range(int(cfg["num_hidden_layers"])) for item in layer.items()]
    plan.append(("logits", (int(cfg["vocab_size"]), int(cfg["hidden_size"]))))
    return [
        (name, torch.randn(n, k, generator=gen, dtype=dtype).mul_(k**-0.5)) for name, (n, k) in plan
    ]


def _pass(kernel: RowsLinearKernel, weights: Weights, xs: Mapping[str, torch.Tensor]) -> float:
    """Seconds for one call per weight."""
    t = time.perf_counter()
    for name, w in weights:
        kernel(xs[name], w)
    return time.perf_counter() - t


def _max_diff(
    kernels: Mapping[str, RowsLinearKernel], weights: Weights, xs: Mapping[str, torch.Tensor]
) -> float:
    """Largest difference between the builds' outputs, over one matrix of each kind."""
    first: dict[str, torch.Tensor] = {}
    for name, w in weights:
        first.setdefault(name, w)
    diff = 0.0
    for name, w in first.items():
        a, b = (kernels[n](xs[name], w).float() for n in BUILDS)
        diff = max(diff, (a - b).abs().max().item())
    return diff


def kernel_part(args: argparse.Namespace, kernels: dict[str, RowsLinearKernel]) -> dict[str, Any]:
    import torch

    dtype = getattr(torch, DTYPES[args.kernel])
    weights = model_weights(load_config(Path(args.model_dir)), dtype, args.seed)
    weight_bytes = sum(w.numel() * w.element_size() for _, w in weights)
    print(f"{len(weights)} matrices, {weight_bytes / 2**20:,.0f} MiB of {dtype}", flush=True)
    gen = torch.Generator().manual_seed(args.seed + 1)
    rows: list[dict[str, Any]] = []
    ks = {name: w.shape[1] for name, w in weights}
    for m in args.rows:
        xs = {name: torch.randn(m, k, generator=gen, dtype=dtype) for name, k in ks.items()}
        diff = _max_diff(kernels, weights, xs)
        times: dict[str, list[float]] = {n: [] for n in BUILDS}
        for r in range(args.rounds):
            for name in alternating(BUILDS, r):
                times[name].append(_pass(kernels[name], weights, xs))
        best = {n: min(v) for n, v in times.items()}
        rows.append(
            {
                "rows": m,
                "pass_ms": {n: s * 1e3 for n, s in best.items()},
                "gbps": {n: weight_bytes / s / 1e9 for n, s in best.items()},
                "gain": best["baseline"] / best["current"],
                "max_abs_diff": diff,
            }
        )
        gbps = rows[-1]["gbps"]
        print(
            f"{m} rows: baseline {gbps['baseline']:.1f} GB/s, current {gbps['current']:.1f}"
            f" GB/s, {rows[-1]['gain']:.2f}x; max abs diff {diff:.3g}",
            flush=True,
        )
    return {"weight_bytes": weight_bytes, "matrices": len(weights), "rows": rows}


def engine_kernels(llm: Any, cls: type[RowsLinearKernel]) -> list[RowsLinearKernel]:
    """The ``cls`` kernel objects behind the model's linear and logits hooks (one per
    backend, shared by its hooks, but nothing here relies on that)."""
    from kvferry.worker.cpu_backend import SmallStepsLinear

    model = llm.engine.executor.worker.model  # in-process: UniProcExecutor
    hooks = [getattr(m, "kernel", None) for m in model.modules()] + [model.logits_kernel]
    found = {
        id(h.kernel): h.kernel
        for h in hooks
        if isinstance(h, SmallStepsLinear) and isinstance(h.kernel, cls)
    }
    return list(found.values())


def _switcher(
    targets: list[RowsLinearKernel], builds: Mapping[str, RowsLinearKernel]
) -> Callable[[str], None]:
    """Points every target's entry point at a build's. The variant code travels with it:
    the engine picks its variant from the CPU, which may not be ``--variant``."""
    entries = {name: (k._fn, k._code) for name, k in builds.items()}

    def use(name: str) -> None:
        for k in targets:
            k._fn, k._code = entries[name]

    return use


def engine_part(
    args: argparse.Namespace, kernels: dict[str, RowsLinearKernel]
) -> list[dict[str, Any]]:
    from kvferry import LLM

    longest = max(ctx for _, ctx in args.engine_cases)
    llm = LLM(model=args.model_dir, dtype=DTYPES[args.kernel], max_model_len=longest + 64)
    cls = kernel_class(args.kernel)
    targets = engine_kernels(llm, cls)
    if not targets:
        sys.exit(
            f"this engine serves no linear layer with the {cls.NAME} kernel"
            f" ({NO_HOOK[args.kernel]}: try KVFERRY_CPU_ISA=avx2; or KVFERRY_NATIVE_KERNELS=0)"
        )
    use = _switcher(targets, kernels)
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    for nreq, ctx in args.engine_cases:
        step = paired_decode_steps(llm, use, nreq, ctx, args.rounds, rng)
        rows.append({"requests": nreq, "tokens": ctx, **step_summary(step, f"{nreq}x{ctx}")})
    return rows


def report(doc: dict[str, Any]) -> str:
    label = f"{doc['linear_kernel']} {doc['variant']}"
    parts = []
    if doc.get("kernel"):
        head = ["kernel", "rows", "baseline ms", "current ms", "baseline GB/s", "current GB/s"]
        head += ["gain", "max abs diff"]
        body = []
        for r in doc["kernel"]["rows"]:
            ms, gbps = r["pass_ms"], r["gbps"]
            body.append(
                [label, r["rows"], f"{ms['baseline']:.2f}", f"{ms['current']:.2f}"]
                + [f"{gbps['baseline']:.1f}", f"{gbps['current']:.1f}", f"{r['gain']:.2f}x"]
                + [f"{r['max_abs_diff']:.3g}"]
            )
        parts.append(markdown_table(head, body))
    if doc.get("engine"):
        head = ["kernel", "requests x prompt tokens", "baseline ms", "ms per step", "speed-up"]
        body = []
        for r in doc["engine"]:
            g, ms = r["gains"], r["step_ms"]
            change = f"{statistics.median(g):.3f} ({min(g):.3f}-{max(g):.3f})"
            case = f"{r['requests']} x {r['tokens']:,}"
            body.append([label, case, f"{ms['baseline']:.1f}", f"{ms['current']:.1f}", change])
        parts.append(markdown_table(head, body))
    return "\n\n".join(parts)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_ab_arguments(ap, "rows_linear_ab")
    ap.add_argument("--kernel", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--variant", choices=("scalar", "avx2", "avx512"), default="avx2")
    ap.add_argument("--rows", default="1,2,3,4,8", help="x rows per call in the kernel part")
    ap.add_argument("--engine-cases", default="1x160,8x160", help="requests x prompt tokens")
    args = ap.parse_args(argv)
    resolve_ab_arguments(ap, args)
    args.rows = _ints(args.rows)
    args.engine_cases = parse_cases(args.engine_cases)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    check_variant(args.variant)
    kernels = {
        "current": current_kernel(args.kernel, args.variant),
        "baseline": baseline_kernel(args.baseline, args.kernel, args.variant),
    }
    measures: dict[str, Callable[[], Any]] = {
        "kernel": lambda: kernel_part(args, kernels),
        "engine": lambda: engine_part(args, kernels),
    }
    run_ab(
        "rows_linear_ab",
        args,
        {p: m for p, m in measures.items() if p in args.parts},
        report,
        model=Path(args.model_dir).name,
        baseline=args.baseline,
        linear_kernel=kernel_class(args.kernel).NAME,
        variant=args.variant,
    )


if __name__ == "__main__":
    main()
