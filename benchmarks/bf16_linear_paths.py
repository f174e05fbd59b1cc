"""Time of one decoder layer's linear layers (plus the logits) in bf16 or fp32, per path and
step size.

The paths a model's linear layers can take on a CPU (``kvferry.worker.cpu_backend``), bf16:

    torch      F.linear on the bf16 weights (oneDNN's bf16 GEMM where the CPU has bf16
               instructions, a slow emulation where it does not)
    packed     oneDNN-packed bf16 weights (torch.ops.mkldnn._reorder_linear_weight)
    widen      the weight widened to fp32 for the call, then an fp32 GEMM
    c-<isa>    the C kernel that reads bf16 weights as they are (csrc/bf16_linear.c), in each
               variant this CPU runs (amx, avx512bf16, avx512, avx2, scalar)
    amx-gemm   the AMX GEMM kernel on its packed copy of the weights (csrc/bf16_amx_gemm.c;
               AMX only), for steps of a few hundred rows

and with ``--dtype float32``: ``torch``, ``packed``, ``c-<isa>`` (the dense-weight kernel,
csrc/f32_linear.c: avx512, avx2, scalar) and ``panels`` (csrc/f32_panel_linear.c on its copy of
the weights laid out in panels; AVX-512 only).

Shapes: ``mid`` (hidden 1024, intermediate 2048, 16/4 heads of 64, vocab 32000) and
``qwen3-0.6b`` (hidden 1024, intermediate 3072, q 2048 / kv 1024, vocab 151936). Paths are
interleaved rep by rep and each cell is the median, so a busy machine slows all alike; the
CPU's features are printed first. ``--no-logits`` leaves the vocabulary matrix out (prefill
steps compute logits only for the rows they sample).

    .venv/bin/python benchmarks/bf16_linear_paths.py
    .venv/bin/python benchmarks/bf16_linear_paths.py --shape qwen3-0.6b --rows 1,8,64 --paths torch,c-avx2
    .venv/bin/python benchmarks/bf16_linear_paths.py --rows 512,2048 --no-logits --paths torch,packed,widen
    .venv/bin/python benchmarks/bf16_linear_paths.py --shape qwen3-0.6b --layers 28 --no-logits \
        --rows 1,2,4,8,16 --paths packed,c-avx512bf16,c-avx512
    .venv/bin/python benchmarks/bf16_linear_paths.py --dtype float32 --layers 12 --no-logits \
        --rows 1,2,4,8,16,32,64,128 --paths packed,c-avx512,panels
    .venv/bin/python benchmarks/bf16_linear_paths.py --shape qwen3-0.6b --layers 8 --no-logits \
        --rows 144,192,256,384,528,640,768,1024 --paths torch,packed,c-amx,amx-gemm --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from kvferry.native.bf16_amx_gemm import load_bf16_amx_gemm
from kvferry.native.bf16_linear import VARIANTS, load_bf16_linear
from kvferry.native.f32_linear import load_f32_linear
from kvferry.native.f32_panel_linear import load_f32_panel_linear
from kvferry.worker.cpu_features import ISA_LEVELS, cpu_features

# (out, in) of qkv, o, gate_up, down; then the logits matrix.
SHAPES: dict[str, tuple[list[tuple[int, int]], tuple[int, int]]] = {
    "mid": ([(1536, 1024), (1024, 1024), (4096, 1024), (1024, 2048)], (32000, 1024)),
    "qwen3-0.6b": ([(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)], (151936, 1024)),
}
Path_ = Callable[[torch.Tensor, int], torch.Tensor]


def build_paths(names: list[str], weights: list[torch.Tensor]) -> dict[str, Path_]:
    paths: dict[str, Path_] = {}
    for name in names:
        if name == "torch":
            paths[name] = lambda x, i: F.linear(x, weights[i])
        elif name == "packed":
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
            paths[name] = lambda x, i, p=packed: torch.ops.mkldnn._linear_pointwise(
                x, p[i], None, "none", [], ""
            )
        elif name == "widen":
            paths[name] = lambda x, i: F.linear(x.float(), weights[i].float()).bfloat16()
        elif name == "panels":
            panel = load_f32_panel_linear() if weights[0].dtype == torch.float32 else None
            if panel is None or cpu_features().cpu_isa != "avx512":
                print(f"skipping {name}: needs fp32 weights, an AVX-512 CPU and the kernel")
                continue
            laid = [(panel.pack(w), w.shape[0]) for w in weights]
            paths[name] = lambda x, i, k=panel, laid=laid: k(x, *laid[i])
        elif name == "amx-gemm":
            gemm = load_bf16_amx_gemm() if weights[0].dtype == torch.bfloat16 else None
            if gemm is None or not all(gemm.packs(w) for w in weights):
                print(f"skipping {name}: needs bf16 weights of sizes multiple of 32 and AMX")
                continue
            tiles = [(gemm.pack(w), w.shape[0]) for w in weights]
            paths[name] = lambda x, i, k=gemm, tiles=tiles: k(x, *tiles[i])
        elif name.startswith("c-"):
            load = load_f32_linear if weights[0].dtype == torch.float32 else load_bf16_linear
            kernel = load(name[2:])  # type: ignore[arg-type]
            if kernel is None:
                print(f"skipping {name}: kernel unavailable")
                continue
            paths[name] = lambda x, i, k=kernel: k(x, weights[i])
        else:
            raise SystemExit(f"unknown path {name!r}")
    return paths


def main(argv: list[str] | None = None) -> None:
    features = cpu_features()
    own = ISA_LEVELS.index(features.cpu_isa)
    levels = [v for v in VARIANTS if v in ISA_LEVELS and v != "scalar"]
    runnable = [f"c-{v}" for v in levels if ISA_LEVELS.index(v) <= own]
    if features.bf16_dot:
        runnable.insert(0, "c-avx512bf16")
    if features.bf16_dot and features.amx_bf16:
        runnable[:0] = ["amx-gemm", "c-amx"]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--shape", choices=list(SHAPES), default="mid")
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--paths", help="comma-separated (default: every path of --dtype here)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--no-logits", action="store_true")
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="decoder layers of weights (more than the last-level cache holds: from memory)",
    )
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    if args.paths is None:
        if args.dtype == "float32":
            fp32 = [f"c-{v}" for v in ("avx512", "avx2") if ISA_LEVELS.index(v) <= own]
            extra = ["panels"] if features.cpu_isa == "avx512" else []
            args.paths = ",".join(["torch", "packed", *fp32, *extra])
        else:
            args.paths = ",".join(["torch", "packed", *runnable, "widen"])
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    print("cpu", cpu_features().as_dict(), "threads", args.threads)
    layer, logits = SHAPES[args.shape]
    shapes = layer * args.layers if args.no_logits else [*(layer * args.layers), logits]
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=g) * 0.02).to(dtype) for o, i in shapes]
    paths = build_paths(args.paths.split(","), weights)
    print(
        f"dtype={args.dtype} shape={args.shape} layers={args.layers} logits={not args.no_logits}"
        " median ms per pass over them"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, w.shape[1], generator=g).to(dtype) for w in weights]
        times: dict[str, list[float]] = {p: [] for p in paths}
        for rep in range(args.reps + 1):
            for name, fn in paths.items():
                t = time.perf_counter()
                for i, x in enumerate(xs):
                    fn(x, i)
                if rep:  # the first round warms caches and builds
                    times[name].append(time.perf_counter() - t)
        cells = " ".join(f"{p}={statistics.median(v) * 1e3:.2f}" for p, v in times.items())
        print(f"rows={rows} {cells}", flush=True)


if __name__ == "__main__":
    main()
