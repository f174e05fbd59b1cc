"""A row's roofline floor: its schedule's forward passes, each at the slower of compute and
weight bandwidth.

The compute floor (all FLOPs at the GEMM rate) and the bandwidth floor (the fewest passes,
each reading every weight) each bound a run alone; a run that prefills and then decodes
pays the compute-bound prefill *and* the bandwidth-bound decode passes. This floor plays the
row through the schedule continuous-batching engines follow (every running request decodes
one token per pass, the rest of the token budget goes to waiting prompts in order, chunked)
and charges each pass ``max(its FLOPs / GEMM rate, weight bytes / copy bandwidth)``: what
that schedule would take with perfect kernels.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness.compute import LinearFlops


@dataclass(frozen=True)
class Pass:
    """One forward pass: tokens it feeds through the decoder layers, tokens it samples
    (each needs the lm_head)."""

    fed: int
    sampled: int


def schedule_passes(
    prompt_lens: Sequence[int], max_tokens: Sequence[int], token_budget: int
) -> list[Pass]:
    """The passes of a decode-first, chunked-prefill schedule with no limit on running
    requests (the throughput rows allow all of them at once).

    A request's last prefill chunk samples its first output token; each later pass it is
    running in feeds its previous token and samples the next, until ``max_tokens``.
    """
    if token_budget < 1:
        raise ValueError("token_budget must be positive")
    waiting = deque(i for i, n in enumerate(max_tokens) if n > 0)
    prompt_left = list(prompt_lens)
    left = list(max_tokens)
    running: list[int] = []
    passes: list[Pass] = []
    while waiting or running:
        fed = sampled = len(running)
        for r in running:
            left[r] -= 1
        running = [r for r in running if left[r] > 0]
        budget = token_budget - fed
        while waiting and budget > 0:
            r = waiting[0]
            take = min(prompt_left[r], budget)
            prompt_left[r] -= take
            fed += take
            budget -= take
            if prompt_left[r]:
                break  # a partial chunk; the prompt continues next pass
            waiting.popleft()
            sampled += 1
            left[r] -= 1
            if left[r] > 0:
                running.append(r)
        passes.append(Pass(fed, sampled))
    return passes


def roofline_floor_s(
    passes: Sequence[Pass],
    flops: LinearFlops,
    gemm_gflops: float,
    weight_bytes_per_pass: int,
    copy_gbps: float,
) -> float:
    """Seconds for ``passes`` with every pass at the slower of its two limits."""
    weights_s = weight_bytes_per_pass / (copy_gbps * 1e9)
    rate = gemm_gflops * 1e9
    return sum(
        max((p.fed * flops.per_token_body + p.sampled * flops.lm_head) / rate, weights_s)
        for p in passes
    )
