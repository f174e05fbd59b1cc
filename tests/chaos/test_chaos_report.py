"""The harness's verdict and the report script, without any server (fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import report
from .harness import Attack, run_attack


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, broken: bool) -> dict:
    monkeypatch.setenv("KVFERRY_CHAOS_RESULTS", str(tmp_path / "results.jsonl"))

    def attack(a: Attack) -> None:
        a.details["rounds"] = sum(1 for _ in a.rounds(seconds=0.0, max_rounds=3))
        a.check(not broken, "the target broke")

    r = run_attack(name, f"Attack {name}", attack, good=None, watch=[])
    return r.record


def test_verdict_goes_to_the_results_file(tmp_path, monkeypatch) -> None:
    ok = _run(tmp_path, monkeypatch, "calm", broken=False)
    bad = _run(tmp_path, monkeypatch, "stormy", broken=True)
    assert ok["passed"] and not ok["violations"] and ok["details"]["rounds"] >= 1
    assert not bad["passed"] and bad["violations"] == ["the target broke"]
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(x)["attack"] for x in lines] == ["calm", "stormy"]


def test_report_table_and_write(tmp_path, monkeypatch) -> None:
    _run(tmp_path, monkeypatch, "calm", broken=True)
    _run(tmp_path, monkeypatch, "calm", broken=False)  # the latest record of an attack wins
    _run(tmp_path, monkeypatch, "stormy", broken=True)
    records = report.latest(tmp_path / "results.jsonl", None)
    text = report.table(records)
    rows = {
        line.split(" | ")[0].strip("| "): line for line in text.splitlines() if "Attack " in line
    }
    assert rows["Attack calm"].endswith("| pass |")
    assert "**FAIL**: the target broke" in rows["Attack stormy"]
    assert "1 of 2 attacks pass" in text
    doc = tmp_path / "doc.md"
    start, end = report.markers("before")
    doc.write_text(f"intro\n{start}\nold table\n{end}\nafter\n")
    report.write(doc, text, "before")
    new = doc.read_text()
    assert new.startswith("intro\n") and new.endswith(f"{end}\nafter\n")
    assert "old table" not in new and "Attack stormy" in new
    assert report.main([str(tmp_path / "missing.jsonl")]) == 2
