"""Offline generation throughput: kvferry vs HF transformers vs vLLM (CPU).

Each (row, backend) runs in its own subprocess (benchmarks/worker.py), so startup time and
peak RSS are per backend and memory is returned between runs. Every run uses the same
token-id prompts, greedy decoding and fixed output lengths (ignore_eos), so the backends do
identical work and their outputs can be compared token by token.

    .venv/bin/python benchmarks/throughput.py                 # all rows, all backends
    .venv/bin/python benchmarks/throughput.py --quick         # small smoke run (tiny rows)
    .venv/bin/python benchmarks/throughput.py --rows 'tiny-fp32-*' --backends hf,vllm
    .venv/bin/python benchmarks/throughput.py --list          # show the rows

Metrics per run: output tokens/s = output tokens / wall time of the timed generate call
(prefill included, startup and warm-up excluded); startup = process start until the
backend is loaded and warmed up, with the model files and the backend's torch in the page
cache (the harness reads them just before each launch); peak RSS of the backend's whole
process tree. Per row, the compute floor = linear-layer FLOPs of all prompt and output
tokens / this machine's best measured GEMM rate for the dtype, and the tokens/s ceiling it
implies.

vLLM runs from .bench/vllm-venv (benchmarks/setup_vllm_cpu.sh) and is skipped when that venv
is missing. kvferry is skipped while ``from kvferry import LLM`` fails.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    REPO_ROOT,
    RESULTS_DIR,
    LinearFlops,
    MatmulRate,
    bar_plot,
    fmt_bytes,
    linear_flops,
    make_output_lengths,
    make_prompts,
    markdown_table,
    measure_matmul_rate,
    run_child,
    write_results_json,
)
from benchmarks.models import SPECS, get_model

BACKENDS = ("kvferry", "hf", "vllm", "vllm-compile")
DEFAULT_BACKENDS = ("kvferry", "hf", "vllm")
BACKEND_LABELS = {
    "kvferry": "kvferry",
    "hf": "HF transformers",
    "vllm": "vLLM (CPU, eager)",
    "vllm-compile": "vLLM (CPU, compiled)",
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
WORKER = Path(__file__).resolve().parent / "worker.py"
DEFAULT_VLLM_PY = REPO_ROOT / ".bench" / "vllm-venv" / "bin" / "python"
WARMUP_AUTO_FLOOR_S = 10.0  # --warmup auto: same-shape warm-up only below this floor
OTHER_CPU_WARN = 0.05  # warn when other jobs used more than this share of all CPUs
VLLM_BLOCK = 128
# Optional (apt-get install libtcmalloc-minimal4); preloaded with libiomp5 from vLLM's venv.
TCMALLOC = Path(
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
)  # vLLM's CPU KV block size; used to size the KV pool with headroom

HF_MIXED_NOTE = (
    "HF transformers generate() takes one max_new_tokens per batch. For rows with mixed "
    "output lengths the harness sorts requests by their length, runs batches of "
    "--hf-batch-size, generates each batch up to its longest request and cuts every request "
    "to its own length; only requested tokens are counted. This is the best a static batcher "
    "can do offline (it knows all lengths up front); the tokens generated past a request's "
    "length in its batch are the static-batching waste that continuous batching avoids."
)


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


def build_rows(quick: bool) -> list[Row]:
    rows = []
    for model in SPECS:
        for short, dtype in DTYPES.items():
            if quick:
                pr: tuple[int, int] = (16, 64)
                rows += [
                    Row(f"{model}-{short}-p8", model, dtype, 4, 16, prompt_range=pr),
                    Row(f"{model}-{short}-p64", model, dtype, 16, 16, prompt_range=pr),
                    Row(f"{model}-{short}-mixed", model, dtype, 16, None, (4, 32), pr),
                ]
            else:
                rows += [
                    Row(f"{model}-{short}-p8", model, dtype, 8, 64),
                    Row(f"{model}-{short}-p64", model, dtype, 64, 64),
                    Row(f"{model}-{short}-mixed", model, dtype, 64, None, (8, 256)),
                ]
    return rows


def select_rows(rows: list[Row], patterns: str | None, quick: bool) -> list[Row]:
    if not patterns:
        return [r for r in rows if r.model == "tiny"] if quick else rows
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return [r for r in rows if any(fnmatch.fnmatch(r.name, p) or p == r.name for p in pats)]


# ---------------------------------------------------------------------------
# Running one backend
# ---------------------------------------------------------------------------


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


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    elt = 4 if dtype == "float32" else 2
    return int(cfg["num_hidden_layers"]) * 2 * kv_heads * head_dim * elt


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


def preload_libs(args: argparse.Namespace) -> list[str]:
    """tcmalloc and Intel OpenMP, as vLLM's CPU docs recommend (those that exist here)."""
    venv = Path(args.vllm_python).absolute().parent.parent  # not resolve(): bin/python is a link
    libs = [TCMALLOC, venv / "lib" / "libiomp5.so"]
    return [str(p) for p in libs if p.exists()]


def backend_env(backend: str, args: argparse.Namespace, kv_gib: int) -> dict[str, str]:
    env = dict(os.environ)
    threads = str(args.threads)
    env.update(
        OMP_NUM_THREADS=threads,
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    preload = preload_libs(args) if args.preload in (backend_group(backend), "all") else []
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    if backend_group(backend) == "vllm":
        env.pop("PYTHONPATH", None)
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
            # Give the OpenMP pool every core: 'auto' keeps one core for the frontend,
            # which on 2 cores halves compute.
            VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_ENABLE_V1_MULTIPROCESSING="1" if args.vllm_mp else "0",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        )
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


def run_backend(
    backend: str,
    row: Row,
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    vocab: int,
    warmup: str,
    args: argparse.Namespace,
) -> RunResult:
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
    kv_gib = kv_pool_gib(model_dir, row.dtype, prompts, max_tokens)
    warm_file_cache(python, model_dir)
    job: dict[str, Any] = {
        "backend": backend,
        "model": str(model_dir),
        "dtype": row.dtype,
        "vocab_size": vocab,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "max_num_seqs": row.num_prompts,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "kv_cache_bytes": kv_gib * 2**30,
        "hf_batch_size": args.hf_batch_size if row.mixed_range else 0,
        "hf_mixed_strategy": "sorted",
        "vllm_enforce_eager": backend != "vllm-compile",
        "warmup": warmup,
        "timed_reps": args.timed_reps if warmup == "full" else 1,
    }
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


# ---------------------------------------------------------------------------
# Agreement of greedy outputs
# ---------------------------------------------------------------------------


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Exact-match count and mean common-prefix fraction of ``other`` against ``ref``."""
    exact, prefix_frac = 0, 0.0
    for a, b in zip(ref, other, strict=True):
        exact += a == b
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        prefix_frac += n / max(len(a), 1)
    return {
        "exact": exact,
        "total": len(ref),
        "mean_prefix_frac": prefix_frac / max(len(ref), 1),
    }


def fmt_agreement(a: dict[str, Any] | None) -> str:
    if a is None:
        return "-"
    return f"{a['exact']}/{a['total']} ({100 * a['mean_prefix_frac']:.0f}% prefix)"


def render_report(
    row_docs: list[dict[str, Any]], rows: list[Row], backends: list[str], args: argparse.Namespace
) -> str:
    """Markdown tables and notes for stdout."""
    out: list[str] = []
    kind = "quick" if args.quick else "full"
    out.append(f"\n## Throughput ({kind} run, {args.threads} threads, warm-up: {args.warmup})\n")
    table = []
    for doc in row_docs:
        ceiling = doc["ceiling_tokens_per_s"]
        for b, r in doc["results"].items():
            tps = r["tokens_per_s"]
            ok = r["status"] == "ok"
            agree = (
                "ref" if b == doc["agreement_reference"] else fmt_agreement(doc["agreement"].get(b))
            )
            table.append(
                [
                    doc["row"]["name"],
                    BACKEND_LABELS[b],
                    tps if ok else r["status"],
                    r["gen_s"],
                    r["cold_gen_s"],
                    r["startup_s"],
                    fmt_bytes(r["peak_rss_bytes"]),
                    f"{100 * tps / ceiling:.0f}%" if ok else "-",
                    agree if ok else "-",
                    f"{100 * r['other_cpu_frac']:.0f}%" if r["other_cpu_frac"] is not None else "-",
                ]
            )
    headers = [
        "row",
        "backend",
        "out tok/s",
        "gen s",
        "1st-run gen s",
        "startup s",
        "peak RSS",
        "% of ceiling",
        "greedy agreement",
        "other CPU",
    ]
    out.append(markdown_table(headers, table))
    out.append("\n## Compute floor per row (linear layers only)\n")
    headers = [
        "row",
        "prompts",
        "prompt tok",
        "output tok",
        "linear GFLOP",
        "GEMM GFLOP/s",
        "GEMM dtype",
        "floor s",
        "ceiling out tok/s",
    ]
    out.append(
        markdown_table(
            headers,
            [
                [
                    d["row"]["name"],
                    d["row"]["num_prompts"],
                    d["prompt_tokens"],
                    d["output_tokens"],
                    d["linear_gflops_total"],
                    d["matmul"]["gflops"],
                    d["matmul"]["dtype"],
                    d["floor_s"],
                    d["ceiling_tokens_per_s"],
                ]
                for d in row_docs
            ],
        )
    )
    notes = [
        "out tok/s = output tokens / wall time of one generate() over all requests (prefill "
        "included). Rows with a same-shape warm-up (--warmup full, or auto for short rows) "
        "time later runs of the row's batch shape (the median of --timed-reps runs); "
        "'1st-run gen s' is the first, "
        "untimed one (other token ids, same lengths), which also pays one-off kernel set-up. startup = process launch until the "
        "backend is loaded and has served a 1-request warm-up (model files and the backend's "
        "torch read into the page cache just before each launch). peak RSS = whole process tree "
        "(vLLM's KV-cache pool is resident from start-up; kvferry's pool pages are zeroed by "
        "the OS as its blocks are first used).",
        "floor = linear-layer FLOPs (decoder layers for prompt+output tokens, lm_head for "
        "output tokens) / best measured GEMM rate (for bf16 rows the better of bf16 and "
        "fp32 GEMMs: without native bf16 an engine can upcast); ceiling = output tokens / "
        "floor. Attention-score FLOPs, memory bandwidth and overheads are ignored, so real "
        "runs stay below it; small batches are bandwidth-bound and far below.",
        "greedy agreement: requests whose output ids equal the reference backend's exactly, "
        "and the mean matched prefix. Random weights give near-tied logits, so bf16 (and "
        "rarely fp32) runs can diverge without a bug.",
    ]
    if args.rounds > 1:
        notes.append(
            f"each backend was launched {args.rounds} times per row, in alternating order; "
            "gen s is the median over the timed runs of all launches, startup the median "
            "startup, peak RSS the largest."
        )
    if any(r.mixed_range for r in rows) and "hf" in backends:
        notes.append(f"mixed rows: {HF_MIXED_NOTE}")
    seen: dict[str, None] = {}
    skipped: dict[str, str] = {}
    busiest = 0.0
    for doc in row_docs:
        for b, r in doc["results"].items():
            for n in r["notes"]:
                seen[f"{b}: {n}"] = None
            if r["status"] in ("skipped", "unavailable"):
                skipped.setdefault(b, f"{b} {r['status']}: {r['message']}")
            elif r["status"] in ("error", "timeout"):
                head = r["message"].split("--- stderr tail ---")[0].strip().splitlines()
                skipped[f"{doc['row']['name']}/{b}"] = (
                    f"{doc['row']['name']} {b} {r['status'].upper()}: "
                    f"{head[-1] if head else '?'} (details in the results JSON)"
                )
            busiest = max(busiest, r.get("other_cpu_frac") or 0.0)
    notes += list(seen) + list(skipped.values())
    if busiest > OTHER_CPU_WARN:
        notes.append(
            f"WARNING: other processes used up to {100 * busiest:.0f}% of the machine's CPU "
            "during some runs (column 'other CPU'); those numbers are not reliable. Rerun "
            "when the machine is quiet."
        )
    out.append("\nNotes:")
    out += [f"- {n}" for n in notes]
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", help="comma-separated row names or globs, e.g. 'tiny-*,mid-fp32-p8'")
    ap.add_argument(
        "--backends",
        default=",".join(DEFAULT_BACKENDS),
        help=f"comma-separated subset of {','.join(BACKENDS)} (default: "
        f"{','.join(DEFAULT_BACKENDS)}). vllm runs with enforce_eager=True (like kvferry, no "
        "graph compiler); vllm-compile uses vLLM's default torch.compile/inductor mode, which "
        "adds about a minute of startup per run here",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small smoke run: fewer/shorter prompts and outputs, tiny rows unless "
        "--rows; writes throughput_quick.json / .png under .bench/results",
    )
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="OpenMP/torch threads for every backend (default: all cores)",
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget per engine step for kvferry and vLLM",
    )
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--hf-batch-size",
        type=int,
        default=16,
        help="HF batch size for mixed-length rows (uniform rows use one batch)",
    )
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PY", str(DEFAULT_VLLM_PY)))
    ap.add_argument(
        "--vllm-mp",
        action="store_true",
        help="run vLLM's engine core in its own process (vLLM's default); the "
        "default here is in-process, which is faster on 2 cores",
    )
    ap.add_argument(
        "--warmup",
        choices=["auto", "full", "short"],
        default="auto",
        help="full: before the timed run, run the same batch shape once with other token "
        "ids, so the timed run is steady state; short: only the 1-request warm-up, so the "
        "timed run also pays one-off kernel set-up; auto (default): full for rows whose "
        f"compute floor is under {WARMUP_AUTO_FLOOR_S:.0f}s, where one-off costs would "
        "distort the result, short for longer rows, where they are amortized and a second "
        "run would double the time",
    )
    ap.add_argument(
        "--timed-reps",
        type=int,
        default=3,
        help="timed generate() runs per backend on rows with a full warm-up (the short rows, "
        "a few seconds each, where a moment of interference on the host moves one run by "
        "30%%); the median is reported, the first run uses the row's own prompts and the "
        "others same-shape prompts with other token ids (default: 3)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="launch every backend this many times per row, in alternating order, and report "
        "the median over all their timed runs: this machine's speed drifts by 20-30%% over "
        "minutes, which one launch per backend turns into a ratio error (default: 1)",
    )
    ap.add_argument(
        "--preload",
        choices=["vllm", "all", "none"],
        default="all",
        help="LD_PRELOAD tcmalloc (if installed) + Intel OpenMP from vLLM's venv, as vLLM's CPU "
        "docs recommend: for every backend (default: same runtime for all), vllm only, or "
        "none. With torch's own libgomp a run collapses (up to 30x slower) as soon as "
        "another process takes CPU time; with libiomp5 it degrades gracefully; on a quiet "
        "machine both are the same",
    )
    ap.add_argument("--timeout", type=float, default=3600.0, help="per-run limit in seconds")
    ap.add_argument("--out", help="results JSON (default: .bench/results/throughput[_quick].json)")
    ap.add_argument(
        "--plot",
        help="PNG path (default: docs/img/throughput.png; quick: "
        ".bench/results/throughput_quick.png)",
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true", help="echo the workers' stderr")
    args = ap.parse_args(argv)
    if args.timed_reps < 1:
        ap.error("--timed-reps must be at least 1")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    all_rows = build_rows(args.quick)
    if args.list:
        for r in all_rows:
            mt = f"{r.mixed_range[0]}..{r.mixed_range[1]}" if r.mixed_range else r.output_len
            print(
                f"{r.name:18s} model={r.model} dtype={r.dtype} prompts={r.num_prompts} "
                f"prompt_len={r.prompt_range[0]}..{r.prompt_range[1]} max_tokens={mt}"
            )
        return 0
    rows = select_rows(all_rows, args.rows, args.quick)
    if not rows:
        log(f"no row matches {args.rows!r}; see --list")
        return 2
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        log(f"unknown backends: {sorted(unknown)}")
        return 2

    model_dirs: dict[str, Path] = {}
    flops: dict[str, LinearFlops] = {}
    for name in dict.fromkeys(r.model for r in rows):
        log(f"[model] {name}: preparing ...")
        model_dirs[name] = get_model(name)
        flops[name] = linear_flops(model_dirs[name])
        log(
            f"[model] {name}: {model_dirs[name]} params={flops[name].num_params / 1e6:.1f}M "
            f"linear FLOPs/token={flops[name].per_token / 1e6:.1f}M"
        )

    # GEMM rate per (model, dtype). For half-precision rows the floor uses the better of the
    # dtype's own GEMMs and fp32 GEMMs: on CPUs without native bf16 (AVX2 here) emulated bf16
    # GEMMs are several times slower than fp32, and an engine may upcast (kvferry does).
    measured: dict[tuple[str, str], MatmulRate] = {}
    rates: dict[tuple[str, str], MatmulRate] = {}
    for model, dtype in dict.fromkeys((r.model, r.dtype) for r in rows):
        candidates = [dtype] if dtype == "float32" else [dtype, "float32"]
        for d in candidates:
            if (model, d) not in measured:
                measured[(model, d)] = measure_matmul_rate(d, SPECS[model].hidden)
                m = measured[(model, d)]
                log(f"[matmul] {model} {d}: {m.gflops:.1f} GFLOP/s (per shape {m.per_shape})")
        rates[(model, dtype)] = max(
            (measured[(model, d)] for d in candidates), key=lambda m: m.gflops
        )

    row_docs: list[dict[str, Any]] = []
    tokens_doc: dict[str, dict[str, Any]] = {}
    for row in rows:
        model_dir = model_dirs[row.model]
        vocab = SPECS[row.model].vocab
        prompts = make_prompts(
            row.num_prompts,
            vocab,
            seed=row.seed,
            min_len=row.prompt_range[0],
            max_len=row.prompt_range[1],
        )
        max_tokens = row.max_tokens()
        prompt_tokens, output_tokens = sum(len(p) for p in prompts), sum(max_tokens)
        fl = flops[row.model]
        rate = rates[(row.model, row.dtype)]
        total_flops = fl.total(prompt_tokens, output_tokens)
        floor_s = total_flops / (rate.gflops * 1e9)
        warmup = args.warmup
        if warmup == "auto":
            warmup = "full" if floor_s < WARMUP_AUTO_FLOOR_S else "short"
        runs: dict[str, list[RunResult]] = {b: [] for b in backends}
        for rnd in range(args.rounds):
            # Alternate the order so that neither backend always runs first after a change.
            for backend in backends if rnd % 2 == 0 else backends[::-1]:
                if runs[backend] and runs[backend][-1].status != "ok":
                    continue
                tag = f"{row.name} {backend}" + (f" round {rnd + 1}" if args.rounds > 1 else "")
                log(f"[run] {tag} ...")
                res = run_backend(backend, row, model_dir, prompts, max_tokens, vocab, warmup, args)
                runs[backend].append(res)
                if res.status == "ok":
                    log(
                        f"[run] {tag}: {res.tokens_per_s:.1f} tok/s, "
                        f"gen {res.gen_s:.2f}s, startup {res.startup_s:.1f}s, "
                        f"peak RSS {fmt_bytes(res.peak_rss_bytes)}"
                    )
                else:
                    log(f"[run] {tag}: {res.status.upper()}: {res.message}")
        results = {b: merge_rounds(rs) for b, rs in runs.items()}
        ok = {b: res for b, res in results.items() if res.status == "ok" and res.token_ids}
        ref_backend = "hf" if "hf" in ok else next(iter(ok), None)
        agree: dict[str, dict[str, Any]] = {}
        if ref_backend is not None:
            ref_ids = ok[ref_backend].token_ids
            assert ref_ids is not None
            for b, res in ok.items():
                if b != ref_backend and res.token_ids is not None:
                    agree[b] = agreement(ref_ids, res.token_ids)
        tokens_doc[row.name] = {b: res.token_ids for b, res in ok.items()}
        row_docs.append(
            {
                "row": asdict(row),
                "prompt_tokens": prompt_tokens,
                "output_tokens": output_tokens,
                "linear_gflops_total": total_flops / 1e9,
                "matmul": asdict(rate),
                "floor_s": floor_s,
                "ceiling_tokens_per_s": output_tokens / floor_s,
                "warmup": warmup,
                "agreement_reference": ref_backend,
                "agreement": agree,
                "results": {
                    b: {k: v for k, v in asdict(res).items() if k != "token_ids"}
                    for b, res in results.items()
                },
            }
        )

    print(render_report(row_docs, rows, backends, args))
    suffix = "_quick" if args.quick else ""
    out = Path(args.out) if args.out else RESULTS_DIR / f"throughput{suffix}.json"
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("list",)},
        "hf_mixed_strategy": HF_MIXED_NOTE,
        "rows": row_docs,
    }
    write_results_json(out, payload)
    (out.parent / f"{out.stem}_tokens.json").write_text(json.dumps(tokens_doc))
    log(f"\n[done] results: {out}")
    if not args.no_plot:
        plot = (
            Path(args.plot)
            if args.plot
            else (
                RESULTS_DIR / "throughput_quick.png"
                if args.quick
                else REPO_ROOT / "docs" / "img" / "throughput.png"
            )
        )
        series = {
            BACKEND_LABELS[b]: [d["results"][b]["tokens_per_s"] for d in row_docs] for b in backends
        }
        bar_plot(
            plot,
            [d["row"]["name"] for d in row_docs],
            series,
            title=f"Output tokens/s ({args.threads} CPU threads{', quick' if args.quick else ''})",
            ylabel="output tokens / s (log)",
            ceilings=[d["ceiling_tokens_per_s"] for d in row_docs],
            ceiling_label="linear-layer compute ceiling",
            log_y=True,
        )
        log(f"[done] plot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
