"""Sampler: turns the last-position logits of each request into its next token.

Greedy rows take the argmax. Random rows apply temperature, then top-k, then top-p, and draw
with the request's own generator when it set a seed (reproducible regardless of batch mates)
or with the engine's generator otherwise. Logprobs come from the raw logits, before any
sampling transform, as in vLLM's default.

A random row whose transformed probabilities are no distribution (non-finite, or all zero:
e.g. a NaN or tiny temperature, a top_p below float32 resolution) fails alone: it gets no
token and an error message; the other rows are sampled as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvferry.native.argmax import ArgmaxKernel
from kvferry.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # per-request when seeded


@dataclass
class SamplerOutput:
    # Per row: the sampled token, or None when the row failed (see ``errors``).
    token_ids: list[int | None]
    # Per row: {token: logprob} with the sampled token and the top-n, or None when not asked
    # (or the row failed).
    logprobs: list[dict[int, float] | None]
    # Failed rows: row index -> why.
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    """Picks each row's next token from its fp32 logits. ``argmax`` (CPU engines): a faster
    greedy pick that returns the same indices as ``torch.argmax``."""

    def __init__(self, generator: torch.Generator, argmax: ArgmaxKernel | None = None) -> None:
        self.generator = generator
        self.argmax = argmax

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        logits = logits.float()
        if self.argmax is not None and self.argmax.supports(logits):
            tokens = self.argmax(logits)
        else:
            tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        errors: dict[int, str] = {}
        if random_rows:
            tokens = tokens.clone()
            for i in random_rows:
                try:
                    tokens[i] = self._sample_row(logits[i], rows[i])
                except Exception as e:  # e.g. torch refusing an invalid distribution
                    p = rows[i].params
                    errors[i] = (
                        f"sampling failed (temperature={p.temperature!r}, top_p={p.top_p!r}, "
                        f"top_k={p.top_k!r}): {e}"
                    )
        token_list: list[int | None] = tokens.tolist()
        for i in errors:
            token_list[i] = None
        return SamplerOutput(token_list, self._logprobs(logits, rows, token_list), errors)

    def _sample_row(self, row_logits: torch.Tensor, row: SamplingRow) -> int:
        p = row.params
        scaled = row_logits / p.temperature
        if p.top_k is not None and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        gen = row.generator if row.generator is not None else self.generator
        if probs.device.type != "cpu":
            probs = probs.cpu()
        return int(torch.multinomial(probs, 1, generator=gen).item())

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, rows: list[SamplingRow], tokens: list[int | None]
    ) -> list[dict[int, float] | None]:
        want = [r.params.logprobs for r in rows]
        if all(n is None for n in want):
            return [None] * len(rows)
        logp = torch.log_softmax(logits, dim=-1)
        out: list[dict[int, float] | None] = []
        for i, n in enumerate(want):
            token = tokens[i]
            if n is None or token is None:
                out.append(None)
                continue
            entry = {token: float(logp[i, token])}
            if n > 0:
                vals, idx = torch.topk(logp[i], min(n, logp.shape[-1]))
                entry.update(zip(idx.tolist(), vals.tolist(), strict=True))
            out.append(entry)
        return out
