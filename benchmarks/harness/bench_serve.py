"""Driving a server with vLLM's own load generator, ``vllm bench serve``, and reading its
result JSON.

The client runs from vLLM's venv through ``vllm_cli.py`` (the package-metadata workaround)
against any OpenAI-compatible ``/v1/completions`` endpoint, so kvferry and vLLM are measured
by the same code. Every run is greedy (``--temperature 0``) with ``--ignore-eos``, so both
servers generate exactly the requested number of tokens.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.paths import REPO_ROOT

VLLM_CLI = REPO_ROOT / "benchmarks" / "harness" / "vllm_cli.py"
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)
# The fields of a result file kept per run (all latencies in ms, throughputs per second).
SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(
        f"{stat}_{m}_ms"
        for m in PERCENTILE_METRICS
        for stat in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))
    ),
)


@dataclass(frozen=True)
class Workload:
    """One dataset shape: ``random`` prompts of ``input_len`` tokens, or ``prefix``
    prompts (``prefix_repetition``): ``num_prefixes`` shared prefixes of ``prefix_len``
    tokens, each followed by its own ``input_len`` tokens. ``output_len`` tokens each."""

    name: str
    dataset: str  # "random" | "prefix"
    input_len: int
    output_len: int
    prefix_len: int = 0
    num_prefixes: int = 0

    @property
    def prompt_len(self) -> int:
        """Tokens of the longest prompt."""
        return self.prefix_len + self.input_len

    def dataset_args(self) -> list[str]:
        if self.dataset == "random":
            return [
                "--dataset-name=random",
                f"--random-input-len={self.input_len}",
                f"--random-output-len={self.output_len}",
                "--random-range-ratio=0",
            ]
        if self.dataset == "prefix":
            return [
                "--dataset-name=prefix_repetition",
                f"--prefix-repetition-prefix-len={self.prefix_len}",
                f"--prefix-repetition-suffix-len={self.input_len}",
                f"--prefix-repetition-num-prefixes={self.num_prefixes}",
                f"--prefix-repetition-output-len={self.output_len}",
            ]
        raise ValueError(f"unknown dataset {self.dataset!r}")


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def bench_argv(
    vllm_python: str,
    url: str,
    model_dir: Path,
    workload: Workload,
    rate: float,
    num_prompts: int,
    seed: int,
    result_file: Path | None,
) -> list[str]:
    """The ``vllm bench serve`` command line of one run. The model is served as ``m``;
    ``model_dir`` gives the client the tokenizer. ``result_file`` None: no result JSON."""
    argv = [
        vllm_python,
        str(VLLM_CLI),
        "bench",
        "serve",
        "--backend=openai",
        f"--base-url={url}",
        "--endpoint=/v1/completions",
        f"--model={model_dir}",
        "--served-model-name=m",
        f"--tokenizer={model_dir}",
        *workload.dataset_args(),
        f"--num-prompts={num_prompts}",
        f"--request-rate={rate_label(rate)}",
        f"--seed={seed}",
        "--temperature=0",
        "--ignore-eos",
        f"--percentile-metrics={','.join(PERCENTILE_METRICS)}",
        f"--metric-percentiles={','.join(str(p) for p in PERCENTILES)}",
        "--disable-tqdm",
    ]
    if result_file is not None:
        argv += [
            "--save-result",
            f"--result-dir={result_file.parent}",
            f"--result-filename={result_file.name}",
        ]
    return argv


def summarize(result: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of SUMMARY_KEYS from one ``vllm bench serve`` result (missing ones None).

    Raises ValueError when requests failed or none completed: latencies of a partial run
    would look better than the server is."""
    completed = int(result.get("completed") or 0)
    failed = int(result.get("failed") or 0)
    if completed == 0 or failed:
        errors = [e for e in result.get("errors") or [] if e][:3]
        raise ValueError(f"{completed} requests completed, {failed} failed: {errors}")
    return {k: result.get(k) for k in SUMMARY_KEYS}


def read_result(path: Path) -> dict[str, Any]:
    """summarize() of the result file at ``path``."""
    return summarize(json.loads(path.read_text()))


def median_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per field, the median over repeated runs of one configuration (None where no run
    has the field)."""
    out: dict[str, Any] = {}
    for key in SUMMARY_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out
