"""The paged prefill attention kernel alone: GFLOP/s of one layer's causal prefill.

One request of ``--lengths`` tokens (no cached prefix) over a pool whose blocks sit at random
places, the ``mid`` model's attention shape by default (16 heads / 4 KV heads, head dim 64,
block size 16). Reports the kernel's median time and GFLOP/s (causal score and value FLOPs)
next to torch's SDPA on the same gathered K/V (fp32) and SDPA in the model's dtype on the
fresh K/V as attention holds them (``fresh``: the path bf16 takes with AMX, torch's flash
kernel), and checks the kernel agrees with the fp32 SDPA. ``--kernel amx``: the bf16 kernel on
AMX tiles (``csrc/paged_prefill_amx.c``) in place of the fp32-arithmetic one. ``--context N``:
each chunk comes after N cached tokens. ``--baseline REV``: the same kernel's source at git
revision REV built alongside and timed in turn with this tree's (calls alternating), with the
median of the per-pair speed-ups; with ``--engine MODEL`` as well, instead of the kernel alone,
one engine on benchmark model MODEL prefills fresh one-prompt requests of each length with the
two builds swapped prompt by prompt (each pair the same prompt), as prompt tokens/s.

    .venv/bin/python benchmarks/prefill_kernel.py
    .venv/bin/python benchmarks/prefill_kernel.py --lengths 2048 --dtype bfloat16 --reps 9
    .venv/bin/python benchmarks/prefill_kernel.py --kernel amx --dtype bfloat16 \
        --heads 16 --kv-heads 8 --head-dim 128     # Qwen3-0.6B's attention
    .venv/bin/python benchmarks/prefill_kernel.py --lengths 2048 --context 2048 \
        --baseline HEAD^ --reps 15                  # against the parent commit's build
    .venv/bin/python benchmarks/prefill_kernel.py --engine mid --lengths 512 2048 4096 \
        --baseline HEAD^ --reps 6                   # the same, in an engine's prefills
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.harness.machine import machine_info
from benchmarks.harness.timing import alternating
from kvferry.native.paged_prefill import (
    PagedPrefillAMXKernel,
    PagedPrefillKernel,
    load_paged_prefill,
    load_paged_prefill_amx,
)


def median_s(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def baseline_kernel(rev: str, amx: bool) -> PagedPrefillKernel:
    """The kernel as built from git revision ``rev``'s sources."""
    from benchmarks.harness.revision_build import load_library_at

    source = "paged_prefill_amx.c" if amx else "paged_prefill.c"
    lib = load_library_at(rev, source, f"{Path(source).stem}_baseline")
    return PagedPrefillAMXKernel(lib) if amx else PagedPrefillKernel(lib)


def paired_speedup(
    current: Callable[[], object], baseline: Callable[[], object], reps: int
) -> tuple[float, float]:
    """Median time of ``baseline`` and median of the per-pair ratios baseline / current, the
    two called in turn (the order alternating) ``reps`` times after one call each."""
    current(), baseline()
    base_t, ratios = [], []
    for i in range(reps):
        pair = {}
        for name, fn in alternating((("current", current), ("baseline", baseline)), i):
            start = time.perf_counter()
            fn()
            pair[name] = time.perf_counter() - start
        base_t.append(pair["baseline"])
        ratios.append(pair["baseline"] / pair["current"])
    return statistics.median(base_t), statistics.median(ratios)


def engine_ab(
    model: str, dtype: str, current: PagedPrefillKernel, baseline: PagedPrefillKernel, args: Any
) -> None:
    """Prompt tokens/s of one engine's one-prompt prefills with the two builds in turn."""
    from benchmarks.harness.engines import make_llm
    from benchmarks.harness.models import bench_model, model_vocab_size
    from benchmarks.harness.prompts import random_tokens
    from kvferry import SamplingParams

    longest = max(args.lengths) + 16
    folder = bench_model(model, longest)
    llm = make_llm(
        folder,
        dtype,
        max_model_len=longest,
        enable_prefix_caching=False,
        max_num_batched_tokens=2048,
        num_kv_blocks=longest // 16 + 16,
    )
    kernel = llm.engine.executor.worker.model_runner.attn_workspace.prefill_kernel
    if type(kernel) is not type(current):
        sys.exit(f"this engine's prefill kernel is {kernel and kernel.PATH}, not {current.PATH}")
    builds = {"current": current._fns, "baseline": baseline._fns}
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng, vocab = random.Random(0), model_vocab_size(folder)

    def prefill_s(prompt: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        return time.perf_counter() - start

    prefill_s(random_tokens(rng, min(args.lengths), vocab))  # builds, first touch of the pool
    print(f"{'tokens':>7} {'tok/s':>8} {'baseline tok/s':>15} {'speed-up':>9} {'range':>13}")
    for n in args.lengths:
        times: dict[str, list[float]] = {"current": [], "baseline": []}
        ratios = []
        for i in range(args.reps):
            prompt = random_tokens(rng, n, vocab)
            for name in alternating(("current", "baseline"), i):
                kernel._fns = builds[name]
                times[name].append(prefill_s(prompt))
            ratios.append(times["baseline"][-1] / times["current"][-1])
        kernel._fns = builds["current"]
        rate = {k: n / statistics.median(v) for k, v in times.items()}
        print(
            f"{n:>7} {rate['current']:>8.0f} {rate['baseline']:>15.0f}"
            f" {statistics.median(ratios):>8.3f}x {min(ratios):>6.3f}-{max(ratios):.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernel", choices=["c", "amx"], default="c")
    ap.add_argument("--context", type=int, default=0, help="cached tokens before each chunk")
    ap.add_argument("--baseline", help="a git revision whose kernel to time in turn with this one")
    ap.add_argument("--engine", metavar="MODEL", help="with --baseline: in an engine's prefills")
    args = ap.parse_args()
    if args.engine and not args.baseline:
        sys.exit("--engine compares two builds: add --baseline REV")
    if args.kernel == "amx" and args.dtype != "bfloat16":
        sys.exit("--kernel amx runs bf16 only: add --dtype bfloat16")
    kernel = load_paged_prefill_amx() if args.kernel == "amx" else load_paged_prefill()
    if kernel is None:
        sys.exit(
            f"the {args.kernel} paged prefill kernel is unavailable here (no C compiler, native"
            " kernels off, or for amx no AMX tiles)"
        )
    base = baseline_kernel(args.baseline, args.kernel == "amx") if args.baseline else None
    m = machine_info()
    print(f"{m.get('cpu_model')} ({m.get('cpu_family_model')}, {', '.join(m.get('isa', []))}),")
    print(f"{torch.get_num_threads()} threads, load {m['loadavg']}, git {m.get('git_commit')}")
    if args.engine and base is not None:
        engine_ab(args.engine, args.dtype, kernel, base, args)
        return
    dtype = getattr(torch, args.dtype)
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    gen = torch.Generator().manual_seed(0)
    ctx = args.context
    print(
        f"{'tokens':>7} {'kernel ms':>10} {'GFLOP/s':>8} {'SDPA ms':>8} {'GFLOP/s':>8}"
        f" {'fresh ms':>9} {'GFLOP/s':>8} {'max err':>8}"
        + (f" {'baseline ms':>12} {'speed-up':>9}" if base else "")
    )
    for n in args.lengths:
        seq = ctx + n
        nblocks = -(-seq // bs)
        cache = torch.randn(2, nblocks + 8, bs, kvh, d, generator=gen).to(dtype)
        ids = torch.randperm(nblocks + 8, generator=gen)[:nblocks].contiguous()
        q = torch.randn(n, h, d, generator=gen).to(dtype)
        scale = d**-0.5
        k = cache[0][ids].flatten(0, 1)[:seq].float().transpose(0, 1)
        v = cache[1][ids].flatten(0, 1)[:seq].float().transpose(0, 1)
        qs = q.float().transpose(0, 1).contiguous()
        k, v = k.repeat_interleave(h // kvh, 0).contiguous(), v.repeat_interleave(h // kvh, 0)
        v = v.contiguous()
        # A fresh prompt's mask is torch's own causal one (its faster path).
        causal: dict[str, Any] = {"is_causal": True}
        if ctx:
            causal = {"attn_mask": torch.arange(seq)[None, :] <= (torch.arange(n) + ctx)[:, None]}
        # 4-D (batch of one): torch's flash kernel takes 4-D inputs only.
        sdpa = partial(
            F.scaled_dot_product_attention, qs[None], k[None], v[None], scale=scale, **causal
        )
        # What attention does for a fresh sequence without the kernel: SDPA in the model's
        # dtype on the step's own K/V, laid out as the engine holds them (bf16 with AMX takes
        # torch's flash path on tiles).
        kv_fresh = cache[:, ids].flatten(1, 2)[:, :seq].transpose(1, 2).unsqueeze(1)
        fresh = partial(
            F.scaled_dot_product_attention,
            q.transpose(0, 1).unsqueeze(0),
            kv_fresh[0],
            kv_fresh[1],
            scale=scale,
            enable_gqa=h != kvh,
            **causal,
        )
        paged = partial(kernel, q, cache, ids, ctx, scale)
        err = (paged().float() - sdpa()[0].transpose(0, 1)).abs().max()
        flops = 4 * h * d * n * (ctx + (n + 1) / 2)
        t_kernel = median_s(paged, args.reps)
        t_sdpa = median_s(sdpa, args.reps)
        t_fresh = median_s(fresh, args.reps)
        line = (
            f"{n:>7} {t_kernel * 1e3:>10.1f} {flops / t_kernel / 1e9:>8.0f}"
            f" {t_sdpa * 1e3:>8.1f} {flops / t_sdpa / 1e9:>8.0f}"
            f" {t_fresh * 1e3:>9.1f} {flops / t_fresh / 1e9:>8.0f} {err.item():>8.1e}"
        )
        if base is not None:
            t_base, gain = paired_speedup(
                paged, partial(base, q, cache, ids, ctx, scale), args.reps
            )
            line += f" {t_base * 1e3:>12.1f} {gain:>8.3f}x"
        print(line)


if __name__ == "__main__":
    main()
