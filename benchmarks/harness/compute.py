"""Compute floors: a model's linear-layer FLOPs and this machine's GEMM rate.

A row's floor is its FLOPs divided by the best GEMM rate measured here: no implementation
can beat it, which makes it a fixed yardstick for engines measured on different days.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TORCH_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


@dataclass
class MatmulRate:
    """Best measured GEMM rate for one dtype, with the shape that reached it."""

    dtype: str
    gflops: float
    shape: tuple[int, int, int]  # (tokens, in_features, out_features)
    threads: int
    per_shape: dict[str, float] = field(default_factory=dict)


def _torch_dtype(dtype: str) -> Any:
    import torch

    try:
        return getattr(torch, _TORCH_DTYPES[dtype])
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def measure_matmul_rate(
    dtype: str,
    hidden: int,
    intermediate: int | None = None,
    tokens: Sequence[int] = (64, 256, 1024),
    min_time: float = 0.2,
    rounds: int = 3,
    seed: int = 0,
) -> MatmulRate:
    """Measure this machine's GEMM rate (GFLOP/s) for ``dtype`` with linear-layer shapes.

    Shapes are ``[tokens x hidden] @ [hidden x intermediate]`` (an MLP up-projection,
    ``intermediate`` defaults to ``4 * hidden``) for each token count, through both GEMM
    paths a CPU engine can take: ``torch.nn.functional.linear`` (MKL) and a oneDNN-packed
    weight (where this torch has oneDNN; on AVX-512 CPUs it runs over twice MKL's rate). The
    best rate over all shapes, paths and ``rounds`` passes is returned: used as the divisor
    of a compute floor, a high rate gives a floor that no implementation can beat (and
    several passes make it robust to a passing burst of other load).
    """
    import torch

    tdtype = _torch_dtype(dtype)
    out_features = intermediate or 4 * hidden
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, hidden, generator=gen).to(tdtype)
    best = MatmulRate(dtype, 0.0, (0, hidden, out_features), torch.get_num_threads())
    paths = [lambda x: torch.nn.functional.linear(x, weight)]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        paths.append(lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    except (AttributeError, RuntimeError):
        pass  # no oneDNN in this torch
    with torch.inference_mode():
        inputs = {m: torch.randn(m, hidden, generator=gen).to(tdtype) for m in tokens}
        for x in inputs.values():
            for gemm in paths:
                for _ in range(2):  # warm-up: oneDNN / MKL primitive creation
                    gemm(x)
        for _, (m, x), gemm in itertools.product(range(rounds), inputs.items(), paths):
            iters, elapsed = 0, 0.0
            start = time.perf_counter()
            while elapsed < min_time or iters < 3:
                gemm(x)
                iters += 1
                elapsed = time.perf_counter() - start
            rate = 2.0 * m * hidden * out_features * iters / elapsed / 1e9
            key = f"{m}x{hidden}x{out_features}"
            best.per_shape[key] = max(best.per_shape.get(key, 0.0), round(rate, 2))
            if rate > best.gflops:
                best.gflops = rate
                best.shape = (m, hidden, out_features)
    return best


@dataclass
class LinearFlops:
    """Linear-layer FLOPs for one token (2 * weights of every matmul it goes through)."""

    per_token_body: int  # all decoder layers (attention projections + MLP)
    lm_head: int  # final vocabulary projection (counted even when tied to embeddings)
    num_params: int  # total parameter count incl. embeddings and norms (tied counted once)

    @property
    def per_token(self) -> int:
        return self.per_token_body + self.lm_head

    def total(self, prompt_tokens: int, output_tokens: int) -> int:
        """FLOPs to prefill ``prompt_tokens`` and decode ``output_tokens``.

        Every prompt and output token runs through the decoder layers; only positions
        that produce a sampled token (one per output token) need the lm_head.
        """
        return (prompt_tokens + output_tokens) * self.per_token_body + output_tokens * self.lm_head


def load_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> Mapping[str, Any]:
    """An HF ``config.json`` given parsed, as a file path or as its model directory."""
    if isinstance(config, Mapping):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    parsed: Mapping[str, Any] = json.loads(path.read_text())
    return parsed


def linear_flops(config: Mapping[str, Any] | str | os.PathLike[str]) -> LinearFlops:
    """Linear-layer FLOPs per token for a Llama/Mistral/Qwen2/Qwen3-style HF ``config.json``.

    ``config`` is the parsed dict, a ``config.json`` path or a model directory. Attention
    score / softmax / value FLOPs are not linear layers and are not counted (they are
    small next to the projections for the context lengths benchmarked here).
    """
    cfg = load_config(config)
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg["intermediate_size"])
    vocab = int(cfg["vocab_size"])
    tied = bool(cfg.get("tie_word_embeddings", False))
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * inter  # gate, up, down
    layer_linear = attn + mlp
    attn_bias = 0
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        attn_bias = heads * head_dim + 2 * kv_heads * head_dim
    norms = layers * 2 * hidden + hidden
    if cfg.get("model_type") == "qwen3":
        norms += layers * 2 * head_dim  # per-head RMSNorm weights of q and k
    embed = vocab * hidden
    num_params = layers * (layer_linear + attn_bias) + norms + embed + (0 if tied else embed)
    return LinearFlops(
        per_token_body=2 * layers * layer_linear,
        lm_head=2 * hidden * vocab,
        num_params=num_params,
    )


def kv_bytes_per_token(config: Mapping[str, Any] | str | os.PathLike[str], dtype: str) -> int:
    """Bytes of K and V cache one token takes over all layers (``dtype``: float32 or 16-bit)."""
    cfg = load_config(config)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    elt = 4 if dtype == "float32" else 2
    return int(cfg["num_hidden_layers"]) * 2 * kv_heads * head_dim * elt
