"""Decode steps timed one by one on an engine: the step itself, not a difference of two runs
(which goes negative when a small model's steps are shorter than the noise)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any


def random_prompts(engine: Any, rng: random.Random, count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` random token ids of ``engine``'s vocabulary."""
    vocab = engine.config.model_config.arch.vocab_size
    return [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(count)]


def timed_decode_steps(
    engine: Any,
    prompts: list[list[int]],
    steps: int,
    before_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Adds ``prompts`` to ``engine`` (an ``LLMEngine`` with nothing in flight), each to
    generate ``1 + steps`` tokens greedily, and steps it until they finish. Returns the seconds
    of each step that only decoded (no prompt left to prefill), in order; ``before_step(i)``
    runs before the i-th of them."""
    from kvferry import SamplingParams

    params = SamplingParams(max_tokens=1 + steps, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request({"prompt_token_ids": prompt}, params)
    times: list[float] = []
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        decoding = not sched.waiting and all(
            q.num_computed_tokens >= q.num_prompt_tokens for q in sched.running
        )
        if decoding and before_step is not None:
            before_step(len(times))
        t = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t)
    return times
