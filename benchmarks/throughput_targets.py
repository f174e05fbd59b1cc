"""Check a throughput run (benchmarks/throughput.py's JSON) against the throughput targets.

    .venv/bin/python benchmarks/throughput_targets.py [.bench/results/throughput.json]

Per row: kvferry's output tokens/s against vLLM CPU (target >= 1.2x) and transformers
(>= 1.2x on fixed-length rows, >= 2x on mixed rows), kvferry's generate time against the
row's compute floor (target: within 2x for the compute-bound bf16 row, mid-bf16-p64), and
startup against vLLM's (target <= 1/4). On the realistic-size model (qwen3-0.6b): bf16
tokens/s >= 1.3x fp32's on the same row shape, and the bf16 rows' generate time within
1.5x of their roofline floor (compute-bound prefill plus weight-bandwidth-bound decode
passes). Prints a markdown table and a verdict per target.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.paths import RESULTS_DIR

COMPUTE_BOUND_ROW = "mid-bf16-p64"
VLLM_TARGET = 1.2
REALISTIC_MODEL = "qwen3-0.6b"
BF16_OVER_FP32_TARGET = 1.3
ROOFLINE_TARGET = 1.5


def _ok(result: dict[str, Any] | None) -> bool:
    return result is not None and result.get("status") == "ok"


def _ratio(x: float) -> str:
    """Two decimals, or three where two would round a miss up to the target (0.998 -> 1.00)."""
    return f"{x:.3f}x" if x < 1.0 <= round(x, 2) else f"{x:.2f}x"


def _bf16_over_fp32(rows: list[dict[str, Any]]) -> dict[str, float]:
    """kvferry's bf16 / fp32 tokens/s per realistic-model bf16 row whose fp32 twin ran."""
    tps = {
        d["row"]["name"]: d["results"]["kvferry"]["tokens_per_s"]
        for d in rows
        if _ok(d["results"].get("kvferry"))
    }
    out = {}
    for name, t in tps.items():
        twin = name.replace("-bf16-", "-fp32-")
        if name.startswith(f"{REALISTIC_MODEL}-bf16-") and twin in tps:
            out[name] = t / tps[twin]
    return out


def check(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    table: list[list[str]] = []
    misses: dict[str, list[str]] = {
        "vllm": [], "hf": [], "floor": [], "startup": [], "bf16": [], "roofline": []
    }  # fmt: skip
    compared = {k: 0 for k in misses}
    bf16_ratio = _bf16_over_fp32(rows)
    for doc in rows:
        name, res = doc["row"]["name"], doc["results"]
        mine, vllm, hf = res.get("kvferry"), res.get("vllm"), res.get("hf")
        if not _ok(mine):
            continue
        mixed = doc["row"]["mixed_range"] is not None
        tps = mine["tokens_per_s"]
        v = tps / vllm["tokens_per_s"] if _ok(vllm) else None
        h = tps / hf["tokens_per_s"] if _ok(hf) else None
        floor = mine["gen_s"] / doc["floor_s"]
        start = mine["startup_s"] / vllm["startup_s"] if _ok(vllm) else None
        roof = mine["gen_s"] / doc["roofline_floor_s"] if "roofline_floor_s" in doc else None
        realistic_bf16 = name.startswith(f"{REALISTIC_MODEL}-bf16-")
        b16 = bf16_ratio.get(name)
        compared["bf16"] += b16 is not None
        compared["roofline"] += realistic_bf16 and roof is not None
        if b16 is not None and b16 < BF16_OVER_FP32_TARGET:
            misses["bf16"].append(f"{name} {_ratio(b16)}")
        if realistic_bf16 and roof is not None and roof > ROOFLINE_TARGET:
            misses["roofline"].append(f"{name} {roof:.2f}x")
        compared["vllm"] += v is not None
        compared["hf"] += h is not None
        compared["floor"] += name == COMPUTE_BOUND_ROW
        compared["startup"] += start is not None
        if v is not None and v < VLLM_TARGET:
            misses["vllm"].append(f"{name} {_ratio(v)}")
        if h is not None and h < (2.0 if mixed else 1.2):
            misses["hf"].append(f"{name} {_ratio(h)}")
        if name == COMPUTE_BOUND_ROW and floor > 2.0:
            misses["floor"].append(f"{name} {floor:.2f}x")
        if start is not None and start > 0.25:
            misses["startup"].append(f"{name} {start:.2f}")
        table.append(
            [
                name,
                f"{tps:,.1f}",
                "-" if v is None else _ratio(v),
                "-" if h is None else _ratio(h),
                f"{floor:.2f}x",
                "-" if roof is None else f"{roof:.2f}x",
                "-" if b16 is None else _ratio(b16),
                f"{mine['startup_s']:.1f} s",
                "-" if start is None else f"{start:.2f}",
            ]
        )
    md = markdown_table(
        [
            "row",
            "kvferry tok/s",
            f"vs vLLM (>= {VLLM_TARGET}x)",
            "vs HF (>= 1.2x, mixed >= 2x)",
            "gen time / compute floor",
            "gen time / roofline floor",
            "bf16 / fp32 tok/s",
            "kvferry startup",
            "startup / vLLM's (<= 0.25)",
        ],
        table,
    )
    verdicts = []
    for target, label in (
        ("vllm", f">= {VLLM_TARGET}x vLLM CPU on every row"),
        ("hf", ">= 1.2x transformers on fixed rows, >= 2x on mixed rows"),
        ("floor", f"{COMPUTE_BOUND_ROW} within 2x of its compute floor"),
        ("startup", "startup <= 1/4 of vLLM's"),
        ("bf16", f"{REALISTIC_MODEL} bf16 >= {BF16_OVER_FP32_TARGET}x fp32 tok/s"),
        (
            "roofline",
            f"{REALISTIC_MODEL} bf16 rows within {ROOFLINE_TARGET}x of the roofline floor",
        ),
    ):
        missed = misses[target]
        if not compared[target]:
            verdicts.append(f"{label}: not in this run")
            continue
        scope = (
            "" if compared[target] == len(table) else f" (on the {compared[target]} rows with both)"
        )
        verdicts.append(
            f"{label}: " + ("met" if not missed else "missed on " + ", ".join(missed)) + scope
        )
    return md, verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "results",
        nargs="?",
        type=Path,
        default=RESULTS_DIR / "throughput.json",
        help="throughput.py's results JSON (default: .bench/results/throughput.json)",
    )
    data = json.loads(ap.parse_args().results.read_text())
    md, verdicts = check(data["rows"])
    print(md)
    print()
    for line in verdicts:
        print(f"- {line}")


if __name__ == "__main__":
    main()
