"""The throughput benchmark's report on stdout: results table, compute and bandwidth floors,
notes."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.harness.markdown import fmt_bytes, markdown_table
from benchmarks.harness.throughput.backends import BACKEND_LABELS
from benchmarks.harness.throughput.rows import Row

OTHER_CPU_WARN = 0.05  # warn when other jobs used more than this share of all CPUs

HF_MIXED_NOTE = (
    "HF transformers generate() takes one max_new_tokens per batch. For rows with mixed "
    "output lengths the harness sorts requests by their length, runs batches of "
    "--hf-batch-size, generates each batch up to its longest request and cuts every request "
    "to its own length; only requested tokens are counted. This is the best a static batcher "
    "can do offline (it knows all lengths up front); the tokens generated past a request's "
    "length in its batch are the static-batching waste that continuous batching avoids."
)

RESULT_HEADERS = [
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
FLOOR_HEADERS = [
    "row",
    "prompts",
    "prompt tok",
    "output tok",
    "linear GFLOP",
    "GEMM GFLOP/s",
    "GEMM dtype",
    "floor s",
    "ceiling out tok/s",
    "weight GB/pass",
    "passes",
    "copy GB/s",
    "bw floor s",
    "bw ceiling out tok/s",
    "roofline floor s",
]
FIXED_NOTES = [
    "out tok/s = output tokens / wall time of one generate() over all requests (prefill "
    "included). Rows with a same-shape warm-up (--warmup full, or auto for short rows) "
    "time later runs of the row's batch shape (the median of --timed-reps runs); "
    "'1st-run gen s' is the first, "
    "untimed one (other token ids, same lengths), which also pays one-off kernel set-up. startup = process launch until the "
    "backend is loaded and has served a 1-request warm-up (model files and the backend's "
    "torch read into the page cache just before each launch). peak RSS = whole process tree "
    "(both engines' KV-cache pools are resident from start-up: vLLM zero-fills its pool, "
    "kvferry prefaults its own unless run with --no-kv-pool-prefault).",
    "floor = linear-layer FLOPs (decoder layers for prompt+output tokens, lm_head for "
    "output tokens) / best measured GEMM rate (for bf16 rows the better of bf16 and "
    "fp32 GEMMs: without native bf16 an engine can upcast); ceiling = output tokens / "
    "floor. Attention-score FLOPs and overheads are ignored, so real runs stay below it.",
    "bw floor = passes x weight GB/pass / copy GB/s: every forward pass reads every weight "
    "once, in the row's dtype (a tied embedding once, as the lm_head); passes = the fewest "
    "any engine needs (the longest request's output length, or more when the prompts and "
    "fed-back tokens exceed --max-num-batched-tokens per pass); copy GB/s = best memcpy of "
    "a buffer far larger than the last-level cache, bytes read + written. KV-cache reads "
    "are not counted (they are in the results JSON). Small batches are bound by this floor.",
    "roofline floor = the row played through a decode-first, chunked-prefill schedule "
    "(every running request decodes one token per pass, the rest of the token budget "
    "prefills waiting prompts), each pass at the slower of its FLOPs / GEMM rate and its "
    "weight bytes / copy GB/s, and never below either floor above; % of ceiling = out "
    "tok/s / (output tokens / roofline floor).",
    "greedy agreement: requests whose output ids equal the reference backend's exactly, "
    "and the mean matched prefix. Random weights give near-tied logits, so bf16 (and "
    "rarely fp32) runs can diverge without a bug.",
]


def fmt_agreement(a: dict[str, Any] | None) -> str:
    if a is None:
        return "-"
    return f"{a['exact']}/{a['total']} ({100 * a['mean_prefix_frac']:.0f}% prefix)"


def _result_rows(row_docs: list[dict[str, Any]]) -> list[list[Any]]:
    table = []
    for doc in row_docs:
        ceiling = doc.get("roofline_ceiling_tokens_per_s", doc["ceiling_tokens_per_s"])
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
    return table


def _floor_rows(row_docs: list[dict[str, Any]]) -> list[list[Any]]:
    return [
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
            d["bandwidth"]["weight_bytes_per_pass"] / 1e9,
            d["bandwidth"]["passes"],
            d["bandwidth"]["copy_gbps"],
            d["bw_floor_s"],
            d["bw_ceiling_tokens_per_s"],
            d["roofline_floor_s"],
        ]
        for d in row_docs
    ]


def _run_notes(row_docs: list[dict[str, Any]]) -> list[str]:
    """The backends' own notes, skipped and failed runs, and a warning for a busy machine."""
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
    notes = list(seen) + list(skipped.values())
    if busiest > OTHER_CPU_WARN:
        notes.append(
            f"WARNING: other processes used up to {100 * busiest:.0f}% of the machine's CPU "
            "during some runs (column 'other CPU'); those numbers are not reliable. Rerun "
            "when the machine is quiet."
        )
    return notes


def render_report(
    row_docs: list[dict[str, Any]], rows: list[Row], backends: list[str], args: argparse.Namespace
) -> str:
    """Markdown tables and notes for stdout."""
    kind = "quick" if args.quick else "full"
    out = [f"\n## Throughput ({kind} run, {args.threads} threads, warm-up: {args.warmup})\n"]
    out.append(markdown_table(RESULT_HEADERS, _result_rows(row_docs)))
    out.append("\n## Compute and memory-bandwidth floors per row\n")
    out.append(markdown_table(FLOOR_HEADERS, _floor_rows(row_docs)))
    notes = list(FIXED_NOTES)
    if args.rounds > 1:
        notes.append(
            f"each backend was launched {args.rounds} times per row, in alternating order; "
            "gen s is the median over the timed runs of all launches, startup the median "
            "startup, peak RSS the largest."
        )
    if any(r.mixed_range for r in rows) and "hf" in backends:
        notes.append(f"mixed rows: {HF_MIXED_NOTE}")
    notes += _run_notes(row_docs)
    out.append("\nNotes:")
    out += [f"- {n}" for n in notes]
    return "\n".join(out)
