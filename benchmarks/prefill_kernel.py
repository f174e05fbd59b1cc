"""The paged prefill attention kernel alone: GFLOP/s of one layer's causal prefill.

One request of ``--lengths`` tokens (no cached prefix) over a pool whose blocks sit at random
places, the ``mid`` model's attention shape by default (16 heads / 4 KV heads, head dim 64,
block size 16). Reports the kernel's median time and GFLOP/s (causal score and value FLOPs)
next to torch's SDPA on the same gathered K/V (fp32) and SDPA in the model's dtype on the
fresh K/V as attention holds them (``fresh``: the path bf16 takes with AMX, torch's flash
kernel), and checks the kernel agrees with the fp32 SDPA. ``--kernel amx``: the bf16 kernel on
AMX tiles (``csrc/paged_prefill_amx.c``) in place of the fp32-arithmetic one.

    .venv/bin/python benchmarks/prefill_kernel.py
    .venv/bin/python benchmarks/prefill_kernel.py --lengths 2048 --dtype bfloat16 --reps 9
    .venv/bin/python benchmarks/prefill_kernel.py --kernel amx --dtype bfloat16 \
        --heads 16 --kv-heads 8 --head-dim 128     # Qwen3-0.6B's attention
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.harness.machine import machine_info
from kvferry.native.paged_prefill import load_paged_prefill, load_paged_prefill_amx


def median_s(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    args = ap.parse_args()
    if args.kernel == "amx" and args.dtype != "bfloat16":
        sys.exit("--kernel amx runs bf16 only: add --dtype bfloat16")
    kernel = load_paged_prefill_amx() if args.kernel == "amx" else load_paged_prefill()
    if kernel is None:
        sys.exit(
            f"the {args.kernel} paged prefill kernel is unavailable here (no C compiler, native"
            " kernels off, or for amx no AMX tiles)"
        )
    m = machine_info()
    print(f"{m.get('cpu_model')} ({m.get('cpu_family_model')}, {', '.join(m.get('isa', []))}),")
    print(f"{torch.get_num_threads()} threads, load {m['loadavg']}, git {m.get('git_commit')}")
    dtype = getattr(torch, args.dtype)
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    gen = torch.Generator().manual_seed(0)
    print(
        f"{'tokens':>7} {'kernel ms':>10} {'GFLOP/s':>8} {'SDPA ms':>8} {'GFLOP/s':>8}"
        f" {'fresh ms':>9} {'GFLOP/s':>8} {'max err':>8}"
    )
    for n in args.lengths:
        nblocks = -(-n // bs)
        cache = torch.randn(2, nblocks + 8, bs, kvh, d, generator=gen).to(dtype)
        ids = torch.randperm(nblocks + 8, generator=gen)[:nblocks].contiguous()
        q = torch.randn(n, h, d, generator=gen).to(dtype)
        scale = d**-0.5
        k = cache[0][ids].flatten(0, 1)[:n].float().transpose(0, 1)
        v = cache[1][ids].flatten(0, 1)[:n].float().transpose(0, 1)
        qs = q.float().transpose(0, 1).contiguous()
        k, v = k.repeat_interleave(h // kvh, 0).contiguous(), v.repeat_interleave(h // kvh, 0)
        v = v.contiguous()
        sdpa = partial(F.scaled_dot_product_attention, qs, k, v, is_causal=True, scale=scale)
        # What attention does for a fresh sequence without the kernel: SDPA in the model's
        # dtype on the step's own K/V, laid out as the engine holds them (bf16 with AMX takes
        # torch's flash path on tiles).
        kv_fresh = cache[:, ids].flatten(1, 2)[:, :n].transpose(1, 2).unsqueeze(1)
        fresh = partial(
            F.scaled_dot_product_attention,
            q.transpose(0, 1).unsqueeze(0),
            kv_fresh[0],
            kv_fresh[1],
            is_causal=True,
            scale=scale,
            enable_gqa=h != kvh,
        )
        paged = partial(kernel, q, cache, ids, 0, scale)
        err = (paged().float() - sdpa().transpose(0, 1)).abs().max()
        flops = 4 * h * d * n * (n + 1) / 2
        t_kernel = median_s(paged, args.reps)
        t_sdpa = median_s(sdpa, args.reps)
        t_fresh = median_s(fresh, args.reps)
        print(
            f"{n:>7} {t_kernel * 1e3:>10.1f} {flops / t_kernel / 1e9:>8.0f}"
            f" {t_sdpa * 1e3:>8.1f} {flops / t_sdpa / 1e9:>8.0f}"
            f" {t_fresh * 1e3:>9.1f} {flops / t_fresh / 1e9:>8.0f} {err.item():>8.1e}"
        )


if __name__ == "__main__":
    main()
