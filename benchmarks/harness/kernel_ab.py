"""Paired rounds of one engine with a kernel attached and detached (``fused_ops_ab.py``,
``f32_linear_ab.py``): everything else (weights, other paths, the KV pool) is the same object,
so the per-round ratio is the kernel's effect alone."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness.connector_cost import paired_summary


def ab_arguments(ap: argparse.ArgumentParser, name: str, prompts: int) -> None:
    """The options every A/B script takes: model, prompts per run, tokens, rounds, out."""
    ap.add_argument(
        "--model", default="mid", help="a benchmark model name (benchmarks/models.py), or a folder"
    )
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", help=f"results JSON (default: .bench/results/{name}.json)")


def ab_rounds(
    llm: Any,
    attach: Callable[[bool], None],
    names: tuple[str, str],
    *,
    prompts: int,
    max_tokens: int,
    rounds: int,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Output tok/s of ``names[0]`` (``attach(True)``) and ``names[1]`` (``attach(False)``) per
    round, the order alternating; fresh random prompts of 64-256 tokens for every run, after
    one warm-up run with the kernel attached (builds, first touch of the KV pool)."""
    from kvferry import SamplingParams

    vocab = llm.engine.config.model_config.arch.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def run(on: bool) -> float:
        attach(on)
        batch = [
            {"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(64, 256))]}
            for _ in range(prompts)
        ]
        t = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return prompts * max_tokens / (time.perf_counter() - t)

    run(True)
    rates: dict[str, list[float]] = {names[0]: [], names[1]: []}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rates[name].append(run(name == names[0]))
        print(f"round {r}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in names))
    return rates


def ab_summary(label: str, rates: dict[str, list[float]], names: tuple[str, str]) -> dict[str, Any]:
    """The paired gain of ``names[0]`` over ``names[1]``, printed with both medians."""
    gains = [a / b - 1.0 for a, b in zip(rates[names[0]], rates[names[1]], strict=True)]
    summary: dict[str, Any] = paired_summary(gains)
    print(
        f"{label}: {names[0]} {statistics.median(rates[names[0]]):.1f} vs {names[1]}"
        f" {statistics.median(rates[names[1]]):.1f} output tok/s; paired gain"
        f" {summary['median']:+.1%} [{summary['ci95'][0]:+.1%}, {summary['ci95'][1]:+.1%}]"
    )
    return summary
