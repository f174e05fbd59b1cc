"""The serving benchmark's plan: its workloads, the rate and prompt count of each run (rates
scaled by each workload's compute per request), and a rough duration for ``--dry-run``."""

from __future__ import annotations

import argparse
import math
from typing import Any

from benchmarks.harness.bench_serve import Workload
from benchmarks.harness.compute import linear_flops
from benchmarks.harness.models import SPECS

BASE_MODEL, BASE_PROMPT = "mid", 512  # the model and prompt length --rates are given for
WARMUP = Workload("warmup", "random", 256, 16)


def workloads(args: argparse.Namespace) -> list[Workload]:
    out = [Workload(f"random-{n}", "random", n, args.output_len) for n in args.inputs]
    if args.prefix_len:
        out.append(
            Workload(
                f"prefix-{args.prefix_len}+{args.suffix_len}",
                "prefix",
                args.suffix_len,
                args.output_len,
                prefix_len=args.prefix_len,
                num_prefixes=args.num_prefixes,
            )
        )
    return out


def _flops(model: str) -> Any:
    spec = SPECS[model]
    cfg = {
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": getattr(spec, "head_dim", None),
        "intermediate_size": spec.intermediate,
        "vocab_size": spec.vocab,
        "tie_word_embeddings": spec.tie_word_embeddings,
    }
    return linear_flops(cfg)


def load_scale(model: str, w: Workload, num_prompts: int) -> float:
    """Compute per request of ``BASE_MODEL`` with ``BASE_PROMPT``-token prompts over that of
    ``w`` on ``model`` (a shared prefix is computed once per prefix)."""
    prefill = w.input_len + w.prefix_len * min(1.0, w.num_prefixes / max(num_prompts, 1))
    base = _flops(BASE_MODEL).total(BASE_PROMPT, w.output_len)
    return base / _flops(model).total(round(prefill), w.output_len)


def _sig2(x: float) -> float:
    return float(f"{x:.2g}")


def plan_runs(model: str, w: Workload, args: argparse.Namespace) -> list[tuple[float, int]]:
    """``(rate, num_prompts)`` of each run of workload ``w`` on ``model``."""
    scale = load_scale(model, w, args.num_prompts) if args.scale_rates else 1.0
    n = max(args.min_prompts, round(args.num_prompts * min(1.0, scale)))
    return [(r if math.isinf(r) else _sig2(r * scale), n) for r in args.rates]


def estimate_s(model: str, ws: list[Workload], args: argparse.Namespace) -> float:
    """Rough wall time of one launch: finite rates take num_prompts / rate; saturated
    runs are guessed from the FLOPs at ~100 GFLOP/s; each client start ~20 s."""
    total = 60.0
    for w in ws:
        for rate, n in plan_runs(model, w, args):
            work = n * _flops(model).total(w.prompt_len, w.output_len) / 100e9
            total += 20 + (work if math.isinf(rate) else max(n / rate, work))
    return total
