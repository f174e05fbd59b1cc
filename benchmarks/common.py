"""Shared helpers for kvferry's benchmarks.

Everything here runs in the project venv (``.venv``); the parts that the vLLM worker
also needs (prompt generation) depend on the standard library only. Heavy imports
(torch, psutil, matplotlib) happen inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / ".bench"
RESULTS_DIR = BENCH_DIR / "results"

# ---------------------------------------------------------------------------
# Machine compute rate
# ---------------------------------------------------------------------------


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

    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    try:
        return table[dtype]
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
    ``intermediate`` defaults to ``4 * hidden``) for each token count, run through
    ``torch.nn.functional.linear`` exactly as a model's linear layers are. The best
    rate over all shapes and ``rounds`` passes is returned: used as the divisor of a compute
    floor, a high rate gives a floor that no implementation can beat (and several passes
    make it robust to a passing burst of other load).
    """
    import torch

    tdtype = _torch_dtype(dtype)
    out_features = intermediate or 4 * hidden
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, hidden, generator=gen).to(tdtype)
    best = MatmulRate(dtype, 0.0, (0, hidden, out_features), torch.get_num_threads())
    with torch.inference_mode():
        inputs = {m: torch.randn(m, hidden, generator=gen).to(tdtype) for m in tokens}
        for x in inputs.values():
            for _ in range(2):  # warm-up: oneDNN / MKL primitive creation
                torch.nn.functional.linear(x, weight)
        for _ in range(rounds):
            for m, x in inputs.items():
                iters, elapsed = 0, 0.0
                start = time.perf_counter()
                while elapsed < min_time or iters < 3:
                    torch.nn.functional.linear(x, weight)
                    iters += 1
                    elapsed = time.perf_counter() - start
                rate = 2.0 * m * hidden * out_features * iters / elapsed / 1e9
                key = f"{m}x{hidden}x{out_features}"
                best.per_shape[key] = max(best.per_shape.get(key, 0.0), round(rate, 2))
                if rate > best.gflops:
                    best.gflops = rate
                    best.shape = (m, hidden, out_features)
    return best


# ---------------------------------------------------------------------------
# Model FLOPs
# ---------------------------------------------------------------------------


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


def linear_flops(config: Mapping[str, Any] | str | os.PathLike[str]) -> LinearFlops:
    """Linear-layer FLOPs per token for a Llama/Mistral/Qwen2-style HF ``config.json``.

    ``config`` is the parsed dict, a ``config.json`` path or a model directory. Attention
    score / softmax / value FLOPs are not linear layers and are not counted (they are
    small next to the projections for the context lengths benchmarked here).
    """
    if isinstance(config, Mapping):
        cfg: Mapping[str, Any] = config
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        cfg = json.loads(path.read_text())
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
    embed = vocab * hidden
    num_params = layers * (layer_linear + attn_bias) + norms + embed + (0 if tied else embed)
    return LinearFlops(
        per_token_body=2 * layers * layer_linear,
        lm_head=2 * hidden * vocab,
        num_params=num_params,
    )


# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------


def make_prompts(
    num: int,
    vocab_size: int,
    seed: int = 0,
    min_len: int = 64,
    max_len: int = 256,
    low_id: int = 5,
) -> list[list[int]]:
    """Deterministic random prompts as token ids.

    Lengths are drawn uniformly from ``[min_len, max_len]`` and ids uniformly from
    ``[low_id, vocab_size)``; ids below ``low_id`` are left out so that prompts hold no
    special token (kvferry's generator uses ids 0..4 for them).
    """
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


# ---------------------------------------------------------------------------
# Child processes: wall time and peak RSS
# ---------------------------------------------------------------------------


@dataclass
class ChildResult:
    returncode: int
    wall_s: float
    peak_rss_bytes: int  # max(kernel ru_maxrss of the child, sampled RSS of its process tree)
    maxrss_bytes: int  # kernel's ru_maxrss for the child (largest single process)
    sampled_tree_rss_bytes: int  # largest sampled sum of RSS over child + descendants
    stdout: str
    stderr: str
    timed_out: bool = False
    # Share of the machine's CPU time (all cores, wall_s) used by anything other than this
    # child's tree and this process, incl. hypervisor steal: noise from other jobs.
    other_cpu_frac: float = 0.0


def _busy_cpu_s() -> float:
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _self_cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _tree_rss(proc: Any) -> int:
    import psutil

    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def run_child(
    cmd: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    poll_interval: float = 0.05,
    cwd: str | os.PathLike[str] | None = None,
    echo_stderr: bool = False,
) -> ChildResult:
    """Run ``cmd`` to completion and measure its wall time and peak RSS.

    Peak RSS comes from two sources: the kernel's ``ru_maxrss`` of this child (via
    ``os.wait4``, exact but per process) and a psutil sampler that sums RSS over the
    child's whole process tree (catches helper processes, may miss short spikes).
    """
    import psutil

    busy0, self0 = _busy_cpu_s(), _self_cpu_s()
    start = time.perf_counter()
    popen = subprocess.Popen(
        list(cmd),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out_chunks: list[str] = []
    err_chunks: list[str] = []

    def _pump(stream: Any, sink: list[str], echo: bool) -> None:
        for line in stream:
            sink.append(line)
            if echo:
                sys.stderr.write(line)
                sys.stderr.flush()

    pumps = [
        threading.Thread(target=_pump, args=(popen.stdout, out_chunks, False), daemon=True),
        threading.Thread(target=_pump, args=(popen.stderr, err_chunks, echo_stderr), daemon=True),
    ]
    for t in pumps:
        t.start()
    ps = psutil.Process(popen.pid)
    sampled = 0
    timed_out = False
    status = 0
    usage: resource.struct_rusage | None = None
    while True:
        pid, status, usage = os.wait4(popen.pid, os.WNOHANG)
        if pid != 0:
            break
        sampled = max(sampled, _tree_rss(ps))
        if timeout is not None and time.perf_counter() - start > timeout:
            timed_out = True
            for child in ps.children(recursive=True):
                child.kill()
            popen.kill()
            _, status, usage = os.wait4(popen.pid, 0)
            break
        time.sleep(poll_interval)
    wall = time.perf_counter() - start
    assert usage is not None
    child_cpu = usage.ru_utime + usage.ru_stime  # incl. descendants the child waited for
    other = _busy_cpu_s() - busy0 - child_cpu - (_self_cpu_s() - self0)
    other_frac = max(0.0, other) / max(wall * (os.cpu_count() or 1), 1e-9)
    popen.returncode = os.waitstatus_to_exitcode(status)
    for t in pumps:
        t.join(timeout=5)
    maxrss = usage.ru_maxrss * 1024  # Linux reports KiB
    return ChildResult(
        returncode=popen.returncode,
        wall_s=wall,
        peak_rss_bytes=max(maxrss, sampled),
        maxrss_bytes=maxrss,
        sampled_tree_rss_bytes=sampled,
        stdout="".join(out_chunks),
        stderr="".join(err_chunks),
        timed_out=timed_out,
        other_cpu_frac=other_frac,
    )


def self_peak_rss_bytes() -> int:
    """Peak RSS of this process plus the peak of its largest waited-for child."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) * 1024


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """Facts about the machine and software that a result depends on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
        info["isa"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    except (OSError, IndexError):
        pass
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "kvferry"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        info["git_commit"] = commit + ("-dirty" if dirty else "")
    except OSError:
        pass
    return info


def write_results_json(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` plus a ``meta`` block (time, machine, versions) as JSON."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": sys.argv,
            "machine": machine_info(),
        },
        **payload,
    }
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(out)
    return out


# ---------------------------------------------------------------------------
# Plots and tables
# ---------------------------------------------------------------------------


def bar_plot(
    path: str | os.PathLike[str],
    categories: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    title: str,
    ylabel: str,
    ceilings: Sequence[float | None] | None = None,
    ceiling_label: str = "compute ceiling",
    log_y: bool = False,
) -> Path:
    """Grouped bar chart: one group per category, one bar per series.

    ``None`` values leave a gap (backend skipped or failed). ``ceilings`` draws one short
    horizontal line per category (e.g. a compute-bound tokens/s ceiling).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    n_series = max(len(series), 1)
    width = 0.8 / n_series
    fig, ax = plt.subplots(figsize=(max(7.0, 1.0 * len(categories) + 4), 4.5))
    xs = list(range(len(categories)))
    for i, (name, values) in enumerate(series.items()):
        pos = [x - 0.4 + width * (i + 0.5) for x in xs]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(pos, heights, width=width, label=name)
        for bar, v in zip(bars, values, strict=True):
            label = "n/a" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"
            ax.annotate(
                label,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=90 if len(categories) * n_series > 16 else 0,
            )
    if ceilings is not None:
        first = True
        for x, c in zip(xs, ceilings, strict=True):
            if c is None:
                continue
            ax.hlines(
                c,
                x - 0.45,
                x + 0.45,
                colors="k",
                linestyles="--",
                linewidth=1,
                label=ceiling_label if first else "_nolegend_",
            )
            first = False
    ax.set_xticks(xs)
    ax.set_xticklabels(categories, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_y:
        ax.set_yscale("log")
        tops = [v for vals in series.values() for v in vals if v] + [
            c for c in (ceilings or []) if c
        ]
        if tops:
            ax.set_ylim(top=max(tops) * 3)  # room for the value labels
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Render a GitHub-flavoured markdown table."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:,.0f} MiB"
