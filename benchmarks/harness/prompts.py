"""Deterministic random prompts (token ids) and output lengths, standard library only.

Ids below ``LOW_ID`` are left out so that prompts hold no special token (kvferry's model
generator uses ids 0..4 for them).
"""

from __future__ import annotations

import random

LOW_ID = 5


def make_prompts(
    num: int,
    vocab_size: int,
    seed: int = 0,
    min_len: int = 64,
    max_len: int = 256,
    low_id: int = LOW_ID,
) -> list[list[int]]:
    """``num`` prompts with lengths uniform in ``[min_len, max_len]`` and ids uniform in
    ``[low_id, vocab_size)``, the same for the same arguments."""
    rng = random.Random(f"prompts-{seed}")
    prompts = []
    for _ in range(num):
        n = rng.randint(min_len, max_len)
        prompts.append([rng.randrange(low_id, vocab_size) for _ in range(n)])
    return prompts


def make_output_lengths(num: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Deterministic per-request ``max_tokens`` drawn uniformly from ``[lo, hi]``."""
    rng = random.Random(f"output-lengths-{seed}")
    return [rng.randint(lo, hi) for _ in range(num)]


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` ids from ``rng``, uniform in ``[LOW_ID, vocab)``."""
    return [rng.randrange(LOW_ID, vocab) for _ in range(n)]
