"""The throughput benchmark's rows: ``{tiny, mid} x {fp32, bf16} x {p8, p64, mixed}``,
``qwen3-0.6b x {fp32, bf16} x {p8, p64}`` and ``tiny-hybrid-fp32-p64``."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from benchmarks.harness.models import SPECS
from benchmarks.harness.prompts import make_output_lengths, make_prompts

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# Models measured at fixed output lengths only: the realistic-size row is about decode
# speed against its bandwidth floor, which mixed lengths add nothing to (and double its time).
FIXED_ONLY = frozenset({"qwen3-0.6b"})
# Models with a single row: the hybrid (sliding-window) model checks its KV cache path's
# cost against ``tiny``'s at one shape.
SINGLE_ROW = {"tiny-hybrid": "tiny-hybrid-fp32-p64"}


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    dtype: str  # "float32" | "bfloat16"
    num_prompts: int
    output_len: int | None  # fixed output length, or None for mixed
    mixed_range: tuple[int, int] | None = None  # per-request max_tokens drawn in [lo, hi]
    prompt_range: tuple[int, int] = (64, 256)
    seed: int = 0

    def max_tokens(self) -> list[int]:
        if self.mixed_range is not None:
            lo, hi = self.mixed_range
            return make_output_lengths(self.num_prompts, lo, hi, seed=self.seed)
        assert self.output_len is not None
        return [self.output_len] * self.num_prompts

    def prompts(self) -> list[list[int]]:
        return make_prompts(
            self.num_prompts,
            SPECS[self.model].vocab,
            seed=self.seed,
            min_len=self.prompt_range[0],
            max_len=self.prompt_range[1],
        )

    def describe(self) -> str:
        """One line for ``--list``."""
        mt = (
            f"{self.mixed_range[0]}..{self.mixed_range[1]}" if self.mixed_range else self.output_len
        )
        return (
            f"{self.name:20s} model={self.model} dtype={self.dtype} prompts={self.num_prompts} "
            f"prompt_len={self.prompt_range[0]}..{self.prompt_range[1]} max_tokens={mt}"
        )


def build_rows(quick: bool) -> list[Row]:
    rows = []
    for model in SPECS:
        for short, dtype in DTYPES.items():
            if quick:
                pr: tuple[int, int] = (16, 64)
                these = [
                    Row(f"{model}-{short}-p8", model, dtype, 4, 16, prompt_range=pr),
                    Row(f"{model}-{short}-p64", model, dtype, 16, 16, prompt_range=pr),
                    Row(f"{model}-{short}-mixed", model, dtype, 16, None, (4, 32), pr),
                ]
            else:
                these = [
                    Row(f"{model}-{short}-p8", model, dtype, 8, 64),
                    Row(f"{model}-{short}-p64", model, dtype, 64, 64),
                    Row(f"{model}-{short}-mixed", model, dtype, 64, None, (8, 256)),
                ]
            these = [r for r in these if r.mixed_range is None or model not in FIXED_ONLY]
            if model in SINGLE_ROW:
                these = [r for r in these if r.name == SINGLE_ROW[model]]
            rows += these
    return rows


def select_rows(rows: list[Row], patterns: str | None, quick: bool) -> list[Row]:
    """Rows whose name matches one of the comma-separated globs ``patterns``; without
    patterns every row, or only the ``tiny`` rows of a quick run."""
    if not patterns:
        return [r for r in rows if r.model == "tiny"] if quick else rows
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return [r for r in rows if any(fnmatch.fnmatch(r.name, p) or p == r.name for p in pats)]
