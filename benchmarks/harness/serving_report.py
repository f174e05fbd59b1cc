"""The serving benchmark's report: per model a table of kvferry vs vLLM CPU (medians over
rounds), the issue's targets met or not, and plots of latency and throughput vs rate."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.bench_serve import median_summary, rate_label
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.vllm_server import LABELS

# kvferry / vLLM CPU ratios the issue asks for (latencies: at most; throughput: at least).
TTFT_MAX = 0.8  # mean and p90 TTFT at fixed rates
TPOT_MAX = 0.9  # mean TPOT at fixed rates
ITL_PER_TPOT_MAX = 1.2  # kvferry's median ITL / its mean TPOT: one stream chunk per token
THROUGHPUT_MIN = 1.2  # output tokens/s at saturation (rate inf)
NOISY = 0.05  # others' CPU share above which a run is flagged
# A round whose two launches found GEMM rates further apart than this is flagged: its ratios
# say as much about the machine as about the engines.
UNEVEN = 0.10

COLUMNS = [
    ("TTFT mean ms", "mean_ttft_ms"),
    ("TTFT p90 ms", "p90_ttft_ms"),
    ("TPOT mean ms", "mean_tpot_ms"),
    ("ITL p50 ms", "median_itl_ms"),
    ("ITL p90 ms", "p90_itl_ms"),
    ("out tok/s", "output_throughput"),
]

Key = tuple[str, str, str, float]  # model, dtype, workload, rate


def aggregate(runs: Sequence[Mapping[str, Any]]) -> dict[Key, dict[str, dict[str, Any]]]:
    """``{(model, dtype, workload, rate): {backend: median summary over rounds}}`` in run order."""
    grouped: dict[Key, dict[str, list[Mapping[str, Any]]]] = {}
    for r in runs:
        key = (r["model"], r["dtype"], r["workload"], float(r["rate"]))
        grouped.setdefault(key, {}).setdefault(r["backend"], []).append(r["summary"])
    out: dict[Key, dict[str, dict[str, Any]]] = {}
    for key, by_backend in grouped.items():
        out[key] = {}
        for b, summaries in by_backend.items():
            out[key][b] = {**median_summary(summaries), "rounds": len(summaries)}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(rate: float, kv: Mapping[str, Any], vl: Mapping[str, Any]) -> dict[str, bool | None]:
    """Which of the issue's targets one (workload, rate) meets; None: not measurable."""

    def at_most(metric: str, limit: float) -> bool | None:
        r = _ratio(kv.get(metric), vl.get(metric))
        return None if r is None else r <= limit

    if math.isinf(rate):
        r = _ratio(kv.get("output_throughput"), vl.get("output_throughput"))
        return {"throughput": None if r is None else r >= THROUGHPUT_MIN}
    itl = _ratio(kv.get("median_itl_ms"), kv.get("mean_tpot_ms"))
    return {
        "ttft_mean": at_most("mean_ttft_ms", TTFT_MAX),
        "ttft_p90": at_most("p90_ttft_ms", TTFT_MAX),
        "tpot": at_most("mean_tpot_ms", TPOT_MAX),
        "itl_per_tpot": None if itl is None else itl <= ITL_PER_TPOT_MAX,
    }


def _verdict(t: Mapping[str, bool | None]) -> str:
    return ", ".join(f"{k} {'-' if v is None else 'ok' if v else 'NO'}" for k, v in t.items())


def model_table(agg: Mapping[Key, Mapping[str, Mapping[str, Any]]], model: str, dtype: str) -> str:
    """Rows per (workload, rate): each server's medians, then kvferry / vLLM ratios."""
    headers = ["workload", "req/s", "server", *(c for c, _ in COLUMNS), "targets"]
    rows: list[list[Any]] = []
    for (m, d, workload, rate), by_backend in agg.items():
        if (m, d) != (model, dtype):
            continue
        for b in ("kvferry", "vllm"):
            if b in by_backend:
                s = by_backend[b]
                rows.append(
                    [workload, rate_label(rate), LABELS[b], *(s.get(k) for _, k in COLUMNS), ""]
                )
        if {"kvferry", "vllm"} <= set(by_backend):
            kv, vl = by_backend["kvferry"], by_backend["vllm"]
            ratios = [_ratio(kv.get(k), vl.get(k)) for _, k in COLUMNS]
            cells = ["-" if r is None else f"{r:.2f}x" for r in ratios]
            rows.append(
                [
                    workload,
                    rate_label(rate),
                    "kvferry / vLLM",
                    *cells,
                    _verdict(targets(rate, kv, vl)),
                ]
            )
    return markdown_table(headers, rows)


def _apart(*rates: float) -> float:
    """How far the largest of positive ``rates`` lies above the smallest (0.1: 10%)."""
    return max(rates) / min(rates) - 1


def round_probes(launches: Sequence[Mapping[str, Any]], model: str, dtype: str) -> str:
    """The GEMM rate the probe found before each server's launch, round by round, for one
    model: ``By round, GEMM GFLOP/s kvferry / vLLM CPU: 2,192 / 2,188, 2,739 / 2,766.``, and
    the rounds whose two rates lie more than :data:`UNEVEN` apart named as uneven; empty where
    no round has a probe from both servers."""
    rates: dict[int, dict[str, float]] = {}
    for x in launches:
        probe = x.get("speed_probe")
        if (x["model"], x["dtype"]) == (model, dtype) and probe and probe["gemm_gflops"] > 0:
            rates.setdefault(int(x["round"]), {})[x["backend"]] = float(probe["gemm_gflops"])
    pairs = {r: v for r, v in sorted(rates.items()) if {"kvferry", "vllm"} <= set(v)}
    if not pairs:
        return ""
    shown = ", ".join(f"{v['kvferry']:,.0f} / {v['vllm']:,.0f}" for v in pairs.values())
    text = f"By round, GEMM GFLOP/s {LABELS['kvferry']} / {LABELS['vllm']}: {shown}."
    gaps = {r: _apart(*v.values()) for r, v in pairs.items()}
    uneven = [f"{r} ({gap:.0%} apart)" for r, gap in gaps.items() if gap > UNEVEN]
    if uneven:
        text += (
            " **Uneven rounds** (the machine moved between the two launches, so their ratios "
            f"say as much about the machine as about the engines): {', '.join(uneven)}."
        )
    return text


def drifted_launches(launches: Sequence[Mapping[str, Any]], model: str, dtype: str) -> str:
    """The launches of one model whose GEMM rate moved by more than :data:`UNEVEN` between
    the probe before the server started and the one after it stopped: ``**Drifted
    launches** (...): kvferry round 1 (358 -> 301 GFLOP/s).``; empty where none did (or no
    launch has both probes). Such a launch's numbers hold an unknown share of either rate."""
    drifted = []
    for x in launches:
        before, after = x.get("speed_probe"), x.get("speed_probe_after")
        if (x["model"], x["dtype"]) != (model, dtype) or not before or not after:
            continue
        b, a = float(before["gemm_gflops"]), float(after["gemm_gflops"])
        if min(a, b) > 0 and _apart(a, b) > UNEVEN:
            drifted.append(f"{LABELS[x['backend']]} round {x['round']} ({b:,.0f} -> {a:,.0f})")
    if not drifted:
        return ""
    return (
        "**Drifted launches** (the machine's GEMM rate moved by more than "
        f"{UNEVEN:.0%} between the probes before and after the launch, GFLOP/s): "
        f"{', '.join(drifted)}."
    )


def target_summary(agg: Mapping[Key, Mapping[str, Mapping[str, Any]]]) -> str:
    """One line per model: how many (workload, rate) points meet each target."""
    counts: dict[tuple[str, str], dict[str, list[int]]] = {}
    for (m, d, _w, rate), by_backend in agg.items():
        if not {"kvferry", "vllm"} <= set(by_backend):
            continue
        for name, ok in targets(rate, by_backend["kvferry"], by_backend["vllm"]).items():
            if ok is not None:
                c = counts.setdefault((m, d), {}).setdefault(name, [0, 0])
                c[0] += int(ok)
                c[1] += 1
    lines = []
    for (m, d), by_name in counts.items():
        parts = [f"{name} {met}/{n}" for name, (met, n) in by_name.items()]
        lines.append(f"* `{m}` {d}: " + ", ".join(parts) + " points met")
    return "\n".join(lines)


def plot_model(
    path: Path, agg: Mapping[Key, Mapping[str, Mapping[str, Any]]], model: str, dtype: str
) -> Path | None:
    """One row of panels per workload: TTFT (mean, p90), TPOT (mean), ITL (p50, p90,
    p99) and output tokens/s against the request rate, one colour per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = {k: v for k, v in agg.items() if k[:2] == (model, dtype)}
    workloads = list(dict.fromkeys(k[2] for k in points))
    if not workloads:
        return None
    panels = [
        ("TTFT (ms)", [("mean_ttft_ms", "-"), ("p90_ttft_ms", "--")]),
        ("TPOT (ms)", [("mean_tpot_ms", "-")]),
        ("ITL (ms)", [("median_itl_ms", "-"), ("p90_itl_ms", "--"), ("p99_itl_ms", ":")]),
        ("output tok/s", [("output_throughput", "-")]),
    ]
    colours = {"kvferry": "tab:blue", "vllm": "tab:orange"}
    fig, axes = plt.subplots(
        len(workloads), len(panels), figsize=(16, 3.2 * len(workloads)), squeeze=False
    )
    for row, workload in enumerate(workloads):
        rates = sorted(k[3] for k in points if k[2] == workload)
        xs = list(range(len(rates)))
        for col, (ylabel, series) in enumerate(panels):
            ax = axes[row][col]
            for b, colour in colours.items():
                for metric, style in series:
                    ys = [points[(model, dtype, workload, r)].get(b, {}).get(metric) for r in rates]
                    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
                    if pts:
                        label = f"{LABELS[b]} {metric.split('_')[0]}"
                        ax.plot(
                            *zip(*pts, strict=True), style, marker="o", color=colour, label=label
                        )
            ax.set_xticks(xs)
            ax.set_xticklabels([rate_label(r) for r in rates])
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{workload}: {ylabel}", fontsize=9)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.legend(fontsize=7)
    fig.suptitle(f"Online serving, `{model}` {dtype}: kvferry vs vLLM CPU (vllm bench serve)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
