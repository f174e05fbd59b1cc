"""One throughput row measured: models, compute and memory-bandwidth floors, every
backend's launches in alternating order, and the agreement of their greedy outputs."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.harness.bandwidth import CopyBandwidth, bandwidth_floor, measure_copy_bandwidth
from benchmarks.harness.cli import log
from benchmarks.harness.compute import LinearFlops, MatmulRate, linear_flops, measure_matmul_rate
from benchmarks.harness.markdown import fmt_bytes
from benchmarks.harness.models import SPECS, get_model
from benchmarks.harness.roofline import roofline_floor_s, schedule_passes
from benchmarks.harness.throughput.backends import RowInputs, RunResult, merge_rounds, run_backend
from benchmarks.harness.throughput.rows import Row
from benchmarks.harness.timing import alternating

WARMUP_AUTO_FLOOR_S = 10.0  # --warmup auto: same-shape warm-up only below this floor


def prepare_models(rows: list[Row]) -> tuple[dict[str, Path], dict[str, LinearFlops]]:
    """Every model the rows use (built on first use), with its linear-layer FLOPs."""
    model_dirs: dict[str, Path] = {}
    flops: dict[str, LinearFlops] = {}
    for name in dict.fromkeys(r.model for r in rows):
        log(f"[model] {name}: preparing ...")
        model_dirs[name] = get_model(name)
        flops[name] = linear_flops(model_dirs[name])
        log(
            f"[model] {name}: {model_dirs[name]} params={flops[name].num_params / 1e6:.1f}M "
            f"linear FLOPs/token={flops[name].per_token / 1e6:.1f}M"
        )
    return model_dirs, flops


def floor_rates(rows: list[Row]) -> dict[tuple[str, str], MatmulRate]:
    """The GEMM rate each (model, dtype) floor divides by.

    For half-precision rows it is the better of the dtype's own GEMMs and fp32 GEMMs: on
    CPUs without native bf16 (AVX2 here) emulated bf16 GEMMs are several times slower
    than fp32, and an engine may upcast (kvferry does).
    """
    measured: dict[tuple[str, str], MatmulRate] = {}
    rates: dict[tuple[str, str], MatmulRate] = {}
    for model, dtype in dict.fromkeys((r.model, r.dtype) for r in rows):
        candidates = [dtype] if dtype == "float32" else [dtype, "float32"]
        for d in candidates:
            if (model, d) not in measured:
                measured[(model, d)] = measure_matmul_rate(d, SPECS[model].hidden)
                m = measured[(model, d)]
                log(f"[matmul] {model} {d}: {m.gflops:.1f} GFLOP/s (per shape {m.per_shape})")
        rates[(model, dtype)] = max(
            (measured[(model, d)] for d in candidates), key=lambda m: m.gflops
        )
    return rates


def copy_bandwidth() -> CopyBandwidth:
    """This machine's copy bandwidth, measured once per run (like the GEMM rates)."""
    bw = measure_copy_bandwidth()
    log(f"[memcpy] {bw.gbps:.1f} GB/s ({bw.buffer_bytes >> 20} MiB buffer, {bw.threads} threads)")
    return bw


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Exact-match count and mean common-prefix fraction of ``other`` against ``ref``."""
    exact, prefix_frac = 0, 0.0
    for a, b in zip(ref, other, strict=True):
        exact += a == b
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        prefix_frac += n / max(len(a), 1)
    return {
        "exact": exact,
        "total": len(ref),
        "mean_prefix_frac": prefix_frac / max(len(ref), 1),
    }


def _launch_rounds(
    inputs: RowInputs, backends: list[str], args: argparse.Namespace
) -> dict[str, RunResult]:
    """Each backend launched ``args.rounds`` times, in alternating order so that neither
    always runs first after a change; a backend that fails is not launched again."""
    runs: dict[str, list[RunResult]] = {b: [] for b in backends}
    for rnd in range(args.rounds):
        for backend in alternating(backends, rnd):
            if runs[backend] and runs[backend][-1].status != "ok":
                continue
            tag = f"{inputs.row.name} {backend}" + (f" round {rnd + 1}" if args.rounds > 1 else "")
            log(f"[run] {tag} ...")
            res = run_backend(backend, inputs, args)
            runs[backend].append(res)
            if res.status == "ok":
                log(
                    f"[run] {tag}: {res.tokens_per_s:.1f} tok/s, "
                    f"gen {res.gen_s:.2f}s, startup {res.startup_s:.1f}s, "
                    f"peak RSS {fmt_bytes(res.peak_rss_bytes)}"
                )
            else:
                log(f"[run] {tag}: {res.status.upper()}: {res.message}")
    return {b: merge_rounds(rs) for b, rs in runs.items()}


def measure_row(
    row: Row,
    model_dir: Path,
    flops: LinearFlops,
    rate: MatmulRate,
    bandwidth: CopyBandwidth,
    backends: list[str],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The row's document for the results JSON, and each backend's output token ids."""
    prompts = row.prompts()
    max_tokens = row.max_tokens()
    prompt_tokens, output_tokens = sum(len(p) for p in prompts), sum(max_tokens)
    total_flops = flops.total(prompt_tokens, output_tokens)
    floor_s = total_flops / (rate.gflops * 1e9)
    bw = bandwidth_floor(
        model_dir,
        row.dtype,
        [len(p) for p in prompts],
        max_tokens,
        args.max_num_batched_tokens,
        bandwidth,
    )
    passes = schedule_passes([len(p) for p in prompts], max_tokens, args.max_num_batched_tokens)
    # The schedule's roofline; never below either floor (the compute floor also counts each
    # request's last output token through the layers, which no pass needs).
    roof_s = max(
        roofline_floor_s(passes, flops, rate.gflops, bw.weight_bytes_per_pass, bw.copy_gbps),
        floor_s,
        bw.floor_s,
    )
    warmup = args.warmup
    if warmup == "auto":
        warmup = "full" if floor_s < WARMUP_AUTO_FLOOR_S else "short"
    inputs = RowInputs(row, model_dir, prompts, max_tokens, warmup)
    results = _launch_rounds(inputs, backends, args)
    ok = {b: res for b, res in results.items() if res.status == "ok" and res.token_ids}
    ref_backend = "hf" if "hf" in ok else next(iter(ok), None)
    agree: dict[str, dict[str, Any]] = {}
    if ref_backend is not None:
        ref_ids = ok[ref_backend].token_ids
        assert ref_ids is not None
        for b, res in ok.items():
            if b != ref_backend and res.token_ids is not None:
                agree[b] = agreement(ref_ids, res.token_ids)
    doc = {
        "row": asdict(row),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "linear_gflops_total": total_flops / 1e9,
        "matmul": asdict(rate),
        "floor_s": floor_s,
        "ceiling_tokens_per_s": output_tokens / floor_s,
        "bandwidth": {**asdict(bw), "floor_s": bw.floor_s},
        "bw_floor_s": bw.floor_s,
        "bw_ceiling_tokens_per_s": output_tokens / bw.floor_s,
        "schedule_passes": len(passes),
        "roofline_floor_s": roof_s,
        "roofline_ceiling_tokens_per_s": output_tokens / roof_s,
        "warmup": warmup,
        "agreement_reference": ref_backend,
        "agreement": agree,
        "results": {
            b: {k: v for k, v in asdict(res).items() if k != "token_ids"}
            for b, res in results.items()
        },
    }
    return doc, {b: res.token_ids for b, res in ok.items()}
