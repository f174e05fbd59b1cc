"""Report of ``benchmarks/shared_store.py``: the headline table (result vs target), the
details per part, the plot, and the ``shared_store`` block of ``docs/benchmarks.md``."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness.markdown import markdown_table, update_doc
from benchmarks.harness.paths import IMG_DIR

TTFT_TARGET = 10.0
BW_TARGET = 0.70


def load_previous(path: Path) -> dict[str, Any]:
    """The parts of an earlier result file (so a run of some parts keeps the others)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: doc[k] for k in ("ttft", "bandwidth", "workload") if isinstance(doc.get(k), dict)}


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def _spread(values: list[float]) -> str:
    return f"{_ms(min(values))}-{_ms(max(values))}"


def _verdict(ok: bool, quick: bool) -> str:
    if quick:
        return "smoke run (the target applies to the full run)"
    return "met" if ok else "NOT met"


def headline(res: dict[str, Any], quick: bool) -> str:
    rows: list[list[Any]] = []
    if "ttft" in res:
        t = res["ttft"]
        ratio = t["median_s"]["recompute"] / t["median_s"]["store"]
        rows.append([
            f"TTFT of a {t['prompt_tokens']}-token prompt on a 2nd instance: "
            "store hit vs recompute",
            f"recompute / store = {ratio:.1f}x ({_ms(t['median_s']['recompute'])} vs "
            f"{_ms(t['median_s']['store'])} ms)",
            f">= {TTFT_TARGET:.0f}x: {_verdict(ratio >= TTFT_TARGET, quick)}",
        ])  # fmt: skip
    if "bandwidth" in res:
        b = res["bandwidth"]
        rows.append([
            f"store load bandwidth ({b['bytes'] / 2**20:.0f} MiB): connector vs raw "
            "`batch_get_into`",
            f"{b['ratio']:.0%} ({b['connector_gbps']:.2f} vs {b['raw_gbps']:.2f} GB/s)",
            f">= {BW_TARGET:.0%}: {_verdict(b['ratio'] >= BW_TARGET, quick)}",
        ])  # fmt: skip
    if "workload" in res:
        s = res["workload"]["summary"]
        rows.append([
            "2 instances, shared-prefix workload: store on vs off",
            f"mean TTFT {_ms(s['on']['ttft_mean_s'])} vs {_ms(s['off']['ttft_mean_s'])} ms; "
            f"total {s['on']['total_s_mean']:.2f} vs {s['off']['total_s_mean']:.2f} s",
            "reported (no target)",
        ])  # fmt: skip
    return markdown_table(["what", "result", "target"], rows)


def details(res: dict[str, Any]) -> str:
    parts = []
    if "ttft" in res:
        t = res["ttft"]
        rows = [
            [m, _ms(t["median_s"][m]), _spread(t["ttft_s"][m]), len(t["ttft_s"][m]),
             f"{min(t['hit_tokens'][m]):.0f}-{max(t['hit_tokens'][m]):.0f}"]
            for m in ("recompute", "store")
        ]  # fmt: skip
        parts.append(
            f"**TTFT** ({t['date']}): instance B, streamed request, `max_tokens=1`; store hits "
            f"expected {t['expected_hit_tokens']} tokens (whole chunks before the last token)."
            f"\n\n{markdown_table(['mode', 'median ms', 'min-max ms', 'reps', 'hit tokens'], rows)}"
        )
    if "bandwidth" in res:
        b = res["bandwidth"]
        get_share = statistics.median(b["connector_get_s"]) / statistics.median(b["connector_s"])
        rows = [
            ["connector load (get + checks + copy into the pool)", f"{b['connector_gbps']:.2f}",
             ", ".join(_ms(s) for s in b["connector_s"])],
            ["connector's `batch_get_into` alone (its stats)", f"{b['connector_get_gbps']:.2f}",
             ", ".join(_ms(s) for s in b["connector_get_s"])],
            ["raw `batch_get_into`", f"{b['raw_gbps']:.2f}", ", ".join(_ms(s) for s in b["raw_s"])],
        ]  # fmt: skip
        parts.append(
            f"**Bandwidth** ({b['date']}): {b['chunks']} values of {b['value_bytes']:,} bytes "
            f"({b['tokens']} tokens), data verified: {b['verified']}; the store's get is "
            f"{get_share:.0%} of the connector's load time.\n\n"
            f"{markdown_table(['path', 'median GB/s', 'loads (ms)'], rows)}"
        )
    if "workload" in res:
        w = res["workload"]
        s, c = w["summary"], w["settings"]
        rows = [
            [m, _ms(s[m]["ttft_mean_s"]), f"{s[m]['total_s_mean']:.2f}",
             f"{s[m]['hit_tokens_mean']:.0f}"]
            for m in ("off", "on")
        ]  # fmt: skip
        parts.append(
            f"**Workload** ({w['date']}): {c['systems']} system prompts of {c['system_len']} "
            f"tokens, {c['requests']} requests with {c['suffix_len']}-token suffixes, "
            f"{c['max_tokens']} output tokens, {c['rate']:g} req/s, round robin over 2 "
            f"instances ({w['threads_per_instance']} compute thread(s) each), "
            f"{c['rounds']} round(s) "
            f"per mode.\n\n"
            f"{markdown_table(['store', 'mean TTFT ms', 'total s', 'store hit tokens'], rows)}"
        )
    return "\n\n".join(parts)


def plot(res: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("ttft", "bandwidth", "workload") if p in res]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.0), squeeze=False)
    for ax, part in zip(axes[0], panels, strict=True):
        if part == "ttft":
            t = res["ttft"]
            names = ["recompute", "store"]
            meds = [t["median_s"][m] * 1e3 for m in names]
            err = [[meds[i] - min(t["ttft_s"][m]) * 1e3 for i, m in enumerate(names)],
                   [max(t["ttft_s"][m]) * 1e3 - meds[i] for i, m in enumerate(names)]]  # fmt: skip
            ax.bar(["recompute", "store hit"], meds, yerr=err, color=["tab:gray", "tab:blue"])
            ax.set_ylabel("TTFT (ms, median, min-max)")
            ax.set_title(f"{t['prompt_tokens']}-token prompt, 2nd instance")
        elif part == "bandwidth":
            b = res["bandwidth"]
            vals = [b["connector_gbps"], b["connector_get_gbps"], b["raw_gbps"]]
            ax.bar(["connector\nload", "connector\nget only", "raw get"], vals,
                   color=["tab:blue", "tab:cyan", "tab:gray"])  # fmt: skip
            ax.set_ylabel("GB/s (median)")
            ax.set_title(f"store load, {b['bytes'] / 2**20:.0f} MiB")
        else:
            s = res["workload"]["summary"]
            x = [0, 1]
            means = [s["off"]["ttft_mean_s"] * 1e3, s["on"]["ttft_mean_s"] * 1e3]
            ax.bar([i - 0.2 for i in x], means, 0.4, label="mean TTFT (ms)", color="tab:orange")
            ax2 = ax.twinx()
            ax2.bar([i + 0.2 for i in x], [s["off"]["total_s_mean"], s["on"]["total_s_mean"]],
                    0.4, label="total (s)", color="tab:green")  # fmt: skip
            ax.set_xticks(x)
            ax.set_xticklabels(["store off", "store on"])
            ax.set_ylabel("mean TTFT (ms)", color="tab:orange")
            ax2.set_ylabel("total time (s)", color="tab:green")
            ax.set_title("2 instances, shared prefixes")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _machine(res: dict[str, Any]) -> str:
    header = next(res[p] for p in ("ttft", "bandwidth", "workload") if p in res)
    m = header["machine"]
    cpu = m.get("kvferry_cpu") or {}
    return (
        f"Machine: {m.get('cpu_model', m.get('processor', '?'))}, {m.get('cpu_count')} CPUs, "
        f"ISA flags {', '.join(m.get('isa', [])) or '-'}"
        f"{', kvferry CPU path ' + str(cpu.get('isa', cpu)) if cpu else ''}; torch "
        f"{m.get('torch', '?')}, {m.get('torch_threads', '?')} threads; commit "
        f"{m.get('git_commit', '?')}."
    )


def write_report(res: dict[str, Any], args: argparse.Namespace, write_docs: bool) -> str:
    """The report as markdown (also written into the docs block unless ``write_docs`` is off)."""
    quick = bool(args.quick)
    command = "benchmarks/shared_store.py" + (" --quick" if quick else "")
    text = (
        f"### KV shared across instances: Mooncake Store{' (smoke run)' if quick else ''}\n\n"
        f"{headline(res, quick)}\n\n`.venv/bin/python {command}`: model `{res['model']}` "
        f"{res['dtype']}, one `mooncake_master` (TCP, 127.0.0.1) with a standalone storage "
        f"client, `kvferry serve` instances in their own processes; blocks of 16 tokens, "
        f"{args.blocks_per_chunk} blocks per store value.\n\n{details(res)}\n\n"
        f"{_machine(res)}\n"
    )
    if write_docs:
        img = IMG_DIR / ("shared_store_quick.png" if quick else "shared_store.png")
        plot(res, img)
        text += f"\n![shared store](img/{img.name})\n"
        update_doc("shared_store" + ("_quick" if quick else ""), text)
    return text
