"""The paged decode-attention kernel (``csrc/paged_decode.c``) against its build at another git
revision, both loaded in one process.

``kernel``: one call per layer of a model's shape (its kv heads, head dim and query heads, the
layers' pools ``--pool-mib`` each, blocks at random places, so the K/V come from memory), for
each ``requests x tokens`` case and dtype; the best of ``--rounds`` alternating rounds of the
two builds, as GB/s of K/V a step reads.

``engine``: one ``LLM`` whose decode kernel has its entry points swapped between the two builds
step by step over the 32 decode steps of fresh random prompts
(:func:`~benchmarks.harness.revision_build.paired_decode_steps`); the paired speed-up per
round.

    .venv/bin/python benchmarks/paged_decode_ab.py --baseline 17ae970^
    .venv/bin/python benchmarks/paged_decode_ab.py --baseline 17ae970^ --parts engine \\
        --model qwen3-0.6b --engine-cases 1x512,1x2048 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.compute import kv_bytes_per_token, load_config
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.revision_build import (
    add_ab_arguments,
    load_library_at,
    paired_decode_steps,
    parse_cases,
    resolve_ab_arguments,
    run_ab,
    step_summary,
)

BLOCK = 16


def baseline_kernel(rev: str, variant: str) -> Any:
    """The decode kernel as built from ``rev``'s sources, in ``variant`` where that build has
    variants (its entry points take none before they had)."""
    from kvferry.native import paged_decode
    from kvferry.native.paged_kv import PagedKVKernel

    lib = load_library_at(rev, "paged_decode.c", "paged_decode_baseline")
    if hasattr(lib, "kvf_paged_decode_variants"):
        return paged_decode.PagedDecodeKernel(lib, variant)  # type: ignore[arg-type]
    kernel = paged_decode.PagedDecodeKernel.__new__(paged_decode.PagedDecodeKernel)
    argtypes = paged_decode._ARGTYPES[:-1]
    PagedKVKernel.__init__(kernel, lib, "kvf_paged_decode", argtypes, "baseline decode")
    kernel.variant = "avx2"

    def without_variant(fn: Any) -> Any:
        # The calls pass (..., window, variant, out, threads): drop the variant.
        return lambda *a: fn(*a[:-3], *a[-2:])

    kernel._fns = {dt: without_variant(fn) for dt, fn in kernel._fns.items()}
    kernel._code = 0
    return kernel


def kernel_part(args: argparse.Namespace, kernels: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    cfg = load_config(Path(args.model_dir))
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    layers = int(cfg["num_hidden_layers"])
    rows: list[dict[str, Any]] = []
    rng = random.Random(args.seed)
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        block_bytes = 2 * BLOCK * kv_heads * head_dim * dtype.itemsize
        pool_blocks = max(1, (args.pool_mib << 20) // block_bytes)
        shape = (2, pool_blocks, BLOCK, kv_heads, head_dim)
        pools = [torch.randn(shape).to(dtype) for _ in range(layers)]
        for nreq, ctx in args.cases:
            nblocks = -(-ctx // BLOCK)
            if nreq * nblocks > pool_blocks:
                sys.exit(f"{nreq}x{ctx} needs more than --pool-mib {args.pool_mib} per layer")
            table = torch.tensor(
                [rng.sample(range(pool_blocks), nblocks) for _ in range(nreq)], dtype=torch.int64
            )
            lens = torch.full((nreq,), ctx, dtype=torch.int64)
            q = torch.randn(nreq, heads, head_dim).to(dtype)
            outs = {n: k(q, pools[0], table, lens, head_dim**-0.5) for n, k in kernels.items()}
            diff = (outs["current"].float() - outs["baseline"].float()).abs().max().item()
            times: dict[str, list[float]] = {n: [] for n in kernels}
            for r in range(args.rounds):
                for name in list(kernels) if r % 2 == 0 else list(kernels)[::-1]:
                    t = time.perf_counter()
                    for pool in pools:
                        kernels[name](q, pool, table, lens, head_dim**-0.5)
                    times[name].append(time.perf_counter() - t)
            step_bytes = kv_bytes_per_token(cfg, dtype_name) * nreq * ctx
            gbps = {n: step_bytes / min(v) / 1e9 for n, v in times.items()}
            rows.append(
                {
                    "dtype": dtype_name,
                    "requests": nreq,
                    "tokens": ctx,
                    "gbps": gbps,
                    "gain": gbps["current"] / gbps["baseline"],
                    "max_abs_diff": diff,
                }
            )
            print(
                f"{dtype_name} {nreq}x{ctx}: baseline {gbps['baseline']:.1f} GB/s, current"
                f" {gbps['current']:.1f} GB/s, {rows[-1]['gain']:.2f}x",
                flush=True,
            )
    return rows


def _switcher(kernel: Any, builds: dict[str, Any]) -> Callable[[str], None]:
    """Points ``kernel``'s entry points and variant at a build's (``builds[name]``)."""

    def use(name: str) -> None:
        kernel._fns, kernel._code = builds[name]._fns, builds[name]._code

    return use


def engine_part(args: argparse.Namespace, current: Any, baseline: Any) -> list[dict[str, Any]]:
    from kvferry import LLM

    rows: list[dict[str, Any]] = []
    longest = max(ctx for _, ctx in args.engine_cases)
    for dtype in args.dtypes:
        llm = LLM(model=args.model_dir, dtype=dtype, max_model_len=longest + 64)
        executor: Any = llm.engine.executor  # in-process: UniProcExecutor
        kernel = executor.worker.model_runner.attn_workspace.decode_kernel
        if kernel is None:
            sys.exit("this engine has no C decode kernel (KVFERRY_NATIVE_KERNELS=0?)")
        use = _switcher(kernel, {"current": current, "baseline": baseline})
        rng = random.Random(args.seed)

        for nreq, ctx in args.engine_cases:
            step = paired_decode_steps(llm, use, nreq, ctx, args.rounds, rng)
            summary = step_summary(step, f"{dtype} {nreq}x{ctx}")
            rows.append({"dtype": dtype, "requests": nreq, "tokens": ctx, **summary})
    return rows


def _cells(r: dict[str, Any], before: str, after: str, change: str) -> list[str]:
    return [r["dtype"], f"{r['requests']} x {r['tokens']:,}", before, after, change]


def report(doc: dict[str, Any]) -> str:
    parts = []
    if doc.get("kernel"):
        head = ["dtype", "requests x tokens", "baseline GB/s", "current GB/s", "gain"]
        rates = [(r, r["gbps"]["baseline"], r["gbps"]["current"]) for r in doc["kernel"]]
        body = [_cells(r, f"{b:.1f}", f"{c:.1f}", f"{r['gain']:.2f}x") for r, b, c in rates]
        parts.append(markdown_table(head, body))
    if doc.get("engine"):
        head = ["dtype", "requests x prompt tokens", "baseline ms", "ms per step", "speed-up"]
        body = []
        for r in doc["engine"]:
            g = r["gains"]
            change = f"{statistics.median(g):.3f} ({min(g):.3f}-{max(g):.3f})"
            ms = r["step_ms"]
            body.append(_cells(r, f"{ms['baseline']:.1f}", f"{ms['current']:.1f}", change))
        parts.append(markdown_table(head, body))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_ab_arguments(ap, "paged_decode_ab")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--cases", default="1x160,1x512,1x2048,4x512,8x512,8x160")
    ap.add_argument("--engine-cases", default="1x512")
    ap.add_argument("--variant", help="the current build's variant (default: the engine's)")
    ap.add_argument(
        "--baseline-variant", help="the baseline's variant, where it has them (default: --variant)"
    )
    ap.add_argument("--pool-mib", type=int, default=72, help="one layer's pool in the kernel part")
    args = ap.parse_args(argv)
    resolve_ab_arguments(ap, args)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.cases = parse_cases(args.cases)
    args.engine_cases = parse_cases(args.engine_cases)

    from kvferry.native.paged_decode import load_paged_decode
    from kvferry.worker.cpu_features import cpu_features

    variant = args.variant or cpu_features().isa
    current = load_paged_decode(variant)
    if current is None:
        sys.exit(f"the decode kernel's {variant} variant is not built here")
    baseline = baseline_kernel(args.baseline, args.baseline_variant or variant)
    measures: dict[str, Callable[[], Any]] = {
        "kernel": lambda: kernel_part(args, {"baseline": baseline, "current": current}),
        "engine": lambda: engine_part(args, current, baseline),
    }
    chosen = {p: m for p, m in measures.items() if p in args.parts}
    run_ab(
        "paged_decode_ab",
        args,
        chosen,
        report,
        model=Path(args.model_dir).name,
        baseline=args.baseline,
    )


if __name__ == "__main__":
    main()
