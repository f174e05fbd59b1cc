"""Turn the chaos suite's results (JSON lines, one per attack run) into the table of
``docs/reliability.md``.

Usage: ``python tests/chaos/report.py [RESULTS] [--write DOC] [--section NAME]
[--profile short|long]``

The latest record of each attack is used (of the given profile, when one is given). Without
``--write`` the table is printed; with it, the table replaces what is between the
``<!-- chaos-NAME:start -->`` and ``<!-- chaos-NAME:end -->`` lines of DOC (NAME: ``table``
unless ``--section`` says otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def markers(section: str) -> tuple[str, str]:
    return f"<!-- chaos-{section}:start -->", f"<!-- chaos-{section}:end -->"


# Table order: the items, then the process kills.
ORDER = [
    "bad_sampling",
    "forged_kv_params",
    "other_weights",
    "forged_release",
    "forged_side_channel",
    "outsider_heartbeats",
    "idle_cpu",
    "huge_prompt",
    "huge_chat",
    "many_prompts",
    "oversize_body",
    "slow_clients",
    "disk_fifo",
    "disk_tampered_chunk",
    "fault_injection",
    "kill_prefill",
    "kill_decode",
    "kill_proxy",
]


def default_results() -> Path:
    given = os.environ.get("KVFERRY_CHAOS_RESULTS")
    return Path(given) if given else REPO / ".pytest_cache" / "chaos" / "results.jsonl"


def latest(path: Path, profile: str | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if profile is None or rec.get("profile") == profile:
            out[rec["attack"]] = rec  # later lines win
    return out


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _latency(r: dict[str, Any]) -> str:
    d, b = r["during"], r["baseline"]
    cpu = r.get("details", {}).get("cpu_of_one_core")
    if cpu:  # the idle-CPU measurement has no good client; its number goes here
        return "idle CPU: " + ", ".join(f"{k} {v:.1%}" for k, v in cpu.items()) + " of a core"
    if not r["good"]["requests"]:
        return "— (no good client)"
    if not d["n"]:
        return "no good request answered during the attack"
    cell = f"{_s(d['p50_s'])} / {_s(d['max_s'])} s vs {_s(b['p50_s'])} / {_s(b['max_s'])} s"
    return cell if r.get("latency_checked", True) else cell + " (not a target)"


def _leaked(r: dict[str, Any]) -> str:
    leaked = r["leaked_blocks"]
    if not leaked:
        return "—"
    if any(n < 0 for n in leaked.values()):
        return "unknown"
    return str(sum(leaked.values()))


def _wrong(r: dict[str, Any]) -> str:
    g = r["good"]
    if not g["requests"]:
        return "—"
    cell = f"{g['wrong']} of {g['requests']}"
    if g.get("clean_failures"):
        cell += f" ({g['clean_failures']} failed cleanly while a process was down)"
    return cell


def _status(r: dict[str, Any]) -> str:
    if r["passed"]:
        return "pass"
    shown = "; ".join(r["violations"][:3])
    more = f" (+{len(r['violations']) - 3} more)" if len(r["violations"]) > 3 else ""
    return f"**FAIL**: {shown}{more}".replace("|", "\\|")


def table(records: dict[str, dict[str, Any]]) -> str:
    names = [n for n in ORDER if n in records] + sorted(set(records) - set(ORDER))
    rows = [
        "| Attack | Good-request latency p50 / max during the attack vs baseline | "
        "Leaked blocks | Wrong outputs | Engine deaths | Status |",
        "|---|---|---|---|---|---|",
    ]
    for n in names:
        r = records[n]
        rows.append(
            f"| {r['title']} | {_latency(r)} | {_leaked(r)} | {_wrong(r)} | "
            f"{r['engine_deaths']} | {_status(r)} |"
        )
    first = min(records.values(), key=lambda r: r["time"])
    last = max(records.values(), key=lambda r: r["time"])
    profiles = sorted({r["profile"] for r in records.values()})
    commits = sorted({r["commit"] for r in records.values()})
    passed = sum(r["passed"] for r in records.values())
    loads = [r["load_avg_1m"] for r in records.values() if "load_avg_1m" in r]
    load = f", load average {min(loads):.1f} to {max(loads):.1f}" if loads else ""
    head = (
        f"Latest run: profile {', '.join(profiles)}, commit {', '.join(commits)}, "
        f"{first['time']} to {last['time']}, {last.get('cpus', '?')} CPUs{load}; "
        f"{passed} of {len(records)} attacks pass."
    )
    return head + "\n\n" + "\n".join(rows) + "\n"


def write(doc: Path, text: str, section: str = "table") -> None:
    start, end = markers(section)
    old = doc.read_text()
    if start not in old or end not in old:
        raise SystemExit(f"{doc} has no {start} ... {end} section")
    before, rest = old.split(start, 1)
    _, after = rest.split(end, 1)
    doc.write_text(f"{before}{start}\n{text}{end}{after}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="?", type=Path, default=default_results())
    p.add_argument("--write", type=Path, default=None, help="update this document's table")
    p.add_argument("--section", default="table", help="which marked section to replace")
    p.add_argument("--profile", choices=["short", "long"], default=None)
    args = p.parse_args(argv)
    if not args.results.is_file():
        print(f"error: no chaos results at {args.results}; run the suite first", file=sys.stderr)
        return 2
    records = latest(args.results, args.profile)
    if not records:
        print(f"error: no results of profile {args.profile} in {args.results}", file=sys.stderr)
        return 2
    text = table(records)
    if args.write is None:
        print(text, end="")
    else:
        write(args.write, text, args.section)
        print(f"updated the table in {args.write} ({len(records)} attacks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
