"""Memory-bandwidth floors: the weight bytes a forward pass reads and this machine's copy rate.

Every forward pass (one engine step) reads every weight matrix once, whatever its batch, so
a row needs at least ``passes x weight bytes / bandwidth`` seconds. At small batches that
floor is above the compute floor (decode is bound by weight bytes, not FLOPs); the larger of
the two is the row's floor.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.compute import kv_bytes_per_token, linear_flops, load_config

COPY_BUFFER_BYTES = 512 << 20  # far larger than any last-level cache here (tens of MiB)


@dataclass
class CopyBandwidth:
    """Best measured memcpy rate, counted as STREAM does: bytes read + bytes written."""

    gbps: float  # GB/s (1e9 bytes)
    buffer_bytes: int
    threads: int


def measure_copy_bandwidth(
    buffer_bytes: int = COPY_BUFFER_BYTES, min_time: float = 0.3, rounds: int = 3
) -> CopyBandwidth:
    """Copy one ``buffer_bytes`` buffer into another with ``Tensor.copy_`` (torch's threads,
    as an engine's kernels use them) and return the best rate over ``rounds`` passes.

    The buffer is far larger than the last-level cache, so the rate is DRAM's. A read of
    weights streams at about this rate too (a copy reads one byte for each it writes, and
    reads and writes share the memory channels), which is why it divides weight bytes.
    """
    import torch

    n = buffer_bytes // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults belong to no pass
    best = 0.0
    for _ in range(rounds):
        iters, elapsed = 0, 0.0
        start = time.perf_counter()
        while elapsed < min_time or iters < 2:
            dst.copy_(src)
            iters += 1
            elapsed = time.perf_counter() - start
        best = max(best, 2.0 * n * 4 * iters / elapsed / 1e9)
    return CopyBandwidth(round(best, 2), n * 4, torch.get_num_threads())


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("float32", "fp32") else 2


def weight_bytes_per_pass(config: Mapping[str, Any] | str | os.PathLike[str], dtype: str) -> int:
    """Bytes of weights one forward pass reads in ``dtype``: every decoder layer's matrices
    and norms, the final norm and the lm_head.

    A tied embedding is counted once, as the lm_head: the input embedding lookup reads only
    the batch's rows, which is negligible next to the vocabulary projection.
    """
    cfg = load_config(config)
    fl = linear_flops(cfg)
    embed = int(cfg["vocab_size"]) * int(cfg["hidden_size"])
    untied_extra = 0 if cfg.get("tie_word_embeddings", False) else embed
    # num_params counts the embedding once, plus an untied lm_head; the pass reads the
    # lm_head but not the (untied) input embedding.
    return (fl.num_params - untied_extra) * dtype_bytes(dtype)


def min_forward_passes(
    prompt_lens: Sequence[int], max_tokens: Sequence[int], max_num_batched_tokens: int
) -> int:
    """The fewest forward passes any engine needs for these requests.

    The longest request needs one pass per output token (the first comes from its prefill,
    each later one from feeding back the previous token), and no pass takes more than the
    token budget: the prompts plus every fed-back output token (all but each request's last).
    """
    fed = sum(prompt_lens) + sum(max_tokens) - len(max_tokens)
    return max(max(max_tokens, default=0), math.ceil(fed / max_num_batched_tokens))


def kv_read_bytes(prompt_lens: Sequence[int], max_tokens: Sequence[int], kv_per_token: int) -> int:
    """KV-cache bytes decode attention reads: each request's decode step ``s`` (1-based,
    after the prefill) attends over its prompt and its first ``s`` outputs. Not part of
    the floor (which counts weights); recorded because at large batches it rivals them."""
    total = 0
    for p, n in zip(prompt_lens, max_tokens, strict=True):
        steps = max(n - 1, 0)
        total += steps * p + steps * (steps + 1) // 2
    return total * kv_per_token


@dataclass
class BandwidthFloor:
    """One row's memory-bandwidth floor."""

    weight_bytes_per_pass: int
    passes: int
    copy_gbps: float
    kv_read_bytes: int

    @property
    def floor_s(self) -> float:
        return self.passes * self.weight_bytes_per_pass / (self.copy_gbps * 1e9)


def bandwidth_floor(
    model_dir: Path,
    dtype: str,
    prompt_lens: Sequence[int],
    max_tokens: Sequence[int],
    max_num_batched_tokens: int,
    bandwidth: CopyBandwidth,
) -> BandwidthFloor:
    return BandwidthFloor(
        weight_bytes_per_pass=weight_bytes_per_pass(model_dir, dtype),
        passes=min_forward_passes(prompt_lens, max_tokens, max_num_batched_tokens),
        copy_gbps=bandwidth.gbps,
        kv_read_bytes=kv_read_bytes(prompt_lens, max_tokens, kv_bytes_per_token(model_dir, dtype)),
    )
