"""Prefill speed: prompt tokens/s for one prompt at a time, and where a prefill step goes.

Each prompt runs alone with ``max_tokens=1`` and prefix caching off, so the time is one
prefill (split into ``--batch-tokens`` chunks) plus one logits row and one sample. Lengths
are interleaved round by round and the median over rounds is reported, next to the compute
floor (linear-layer plus causal-attention FLOPs over the measured fp32 GEMM rate).

``--profile`` also runs one prompt of each length with a timer around each part of the
step (the linear layers, the attention, the K/V write, the fused norm / rotary / SiLU ops)
and prints where the step's time goes; the C kernels, which ``torch.profiler`` does not see,
are timed too.

    .venv/bin/python benchmarks/prefill_speed.py                      # 512/2048/4096, mid fp32
    .venv/bin/python benchmarks/prefill_speed.py --profile --rounds 3
    .venv/bin/python benchmarks/prefill_speed.py --ab   # with vs without the prefill kernel
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.compute import linear_flops, load_config, measure_matmul_rate
from benchmarks.harness.engines import make_llm
from benchmarks.harness.models import bench_model, model_vocab_size
from benchmarks.harness.prompts import random_tokens
from kvferry import SamplingParams
from kvferry.model.attention import Attention
from kvferry.model.layers import Linear
from kvferry.native.fused_ops import FusedOps
from kvferry.native.kv_write import KVWriteKernel
from kvferry.native.paged_prefill import load_paged_prefill

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

# The parts of a step --profile times: (part, class, method). Only the outermost timed call
# counts, so a part never includes another's time.
_PARTS: list[tuple[str, type, str]] = [
    ("linear layers", Linear, "forward"),
    ("attention", Attention, "_attend"),
    ("kv write", KVWriteKernel, "__call__"),
    ("kv write", Attention, "_write"),
    *[
        ("norm/rotary/silu", FusedOps, m)
        for m in ("rms_norm", "add_rms_norm_", "rotary_", "qk_norm_rotary_", "silu_mul")
    ],
]


@contextlib.contextmanager
def part_timers() -> Iterator[dict[str, float]]:
    """Seconds spent in each part of :data:`_PARTS` while the block runs (in this process:
    the methods are wrapped for its duration and restored after)."""
    spent: dict[str, float] = defaultdict(float)
    depth = [0]
    saved = [(cls, name, cls.__dict__[name]) for _, cls, name in _PARTS]

    def timed(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[part] += time.perf_counter() - start

        return wrapper

    for part, cls, name in _PARTS:
        setattr(cls, name, timed(part, cls.__dict__[name]))
    try:
        yield spent
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def attention_flops(config: dict[str, Any], prompt: int) -> int:
    """Score and value FLOPs of a causal prefill of ``prompt`` tokens (each query attends to
    the keys up to its own position)."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    pairs = prompt * (prompt + 1) // 2
    return 4 * heads * head_dim * pairs * int(config["num_hidden_layers"])


def time_prompt(llm: Any, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], ONE, use_tqdm=False)
    return time.perf_counter() - start


def profile(llm: Any, prompt: list[int]) -> dict[str, float]:
    """Milliseconds per part of the step for one prompt, the rest as "other", and the wall
    time."""
    with part_timers() as spent:
        wall = time_prompt(llm, prompt)
    parts = {k: v * 1e3 for k, v in spent.items()}
    parts["other"] = wall * 1e3 - sum(parts.values())
    parts["wall"] = wall * 1e3
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mid")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-floor", action="store_true", help="skip the GEMM-rate measurement")
    ap.add_argument(
        "--ab",
        action="store_true",
        help="alternate each prompt with and without the paged prefill kernel (A/B)",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    model = bench_model(args.model, max(args.lengths) + 16)
    cfg = dict(load_config(model))
    vocab = model_vocab_size(model)
    llm = make_llm(
        model,
        args.dtype,
        max_model_len=max(args.lengths) + 16,
        enable_prefix_caching=False,
        max_num_batched_tokens=args.batch_tokens,
        num_kv_blocks=(max(args.lengths) + 16) // 16 + 16,
    )
    rng = random.Random(0)
    time_prompt(llm, random_tokens(rng, 256, vocab))  # warm-up: kernels, buffers
    workspace = llm.engine.executor.worker.model_runner.attn_workspace
    chosen = workspace.prefill_kernel
    # A/B: the kernel the backend chose (the AMX one for bf16 where the CPU has it), else the
    # fp32-arithmetic kernel, against torch's SDPA.
    kernel = (chosen or load_paged_prefill()) if args.ab else chosen
    variants = ["kernel", "torch"] if args.ab else ["default"]
    times: dict[tuple[str, int], list[float]] = {(x, n): [] for x in variants for n in args.lengths}
    for _ in range(args.rounds):
        for n in args.lengths:
            prompt = random_tokens(rng, n, vocab)
            for x in variants:
                workspace.prefill_kernel = None if x == "torch" else kernel
                times[x, n].append(time_prompt(llm, prompt))
    workspace.prefill_kernel = chosen
    rate = None
    if not args.no_floor:
        rate = measure_matmul_rate(
            args.dtype, int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        )
    flops = linear_flops(cfg)
    results: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "rows": []}
    print(
        f"{'variant':>8} {'prompt':>7} {'median s':>9} {'tok/s':>8} {'min..max tok/s':>16}"
        f" {'floor tok/s':>11}"
    )
    for n in args.lengths:
        for x in variants:
            ts = times[x, n]
            med = statistics.median(ts)
            work = n * flops.per_token_body + flops.lm_head + attention_flops(cfg, n)
            floor = None if rate is None else n / (work / (rate.gflops * 1e9))
            spread = f"{n / max(ts):.0f}..{n / min(ts):.0f}"
            floor_s = "-" if floor is None else f"{floor:.0f}"
            print(f"{x:>8} {n:>7} {med:>9.3f} {n / med:>8.0f} {spread:>16} {floor_s:>11}")
            results["rows"].append(
                {
                    "variant": x,
                    "prompt": n,
                    "median_s": med,
                    "tok_s": n / med,
                    "times": ts,
                    "floor_tok_s": floor,
                }
            )
    if rate is not None:
        print(f"fp32 GEMM rate {rate.gflops:.0f} GFLOP/s at {rate.shape}")
        results["gemm_gflops"] = rate.gflops
    if args.profile:
        for n in args.lengths:
            parts = profile(llm, random_tokens(rng, n, vocab))
            wall = parts["wall"]
            shares = ", ".join(
                f"{k} {v:.1f} ms ({v / wall:.0%})"
                for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
                if k != "wall"
            )
            print(f"profile {n}: wall {wall:.1f} ms: {shares}")
            results.setdefault("profile", {})[n] = {"wall_ms": wall, **parts}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
