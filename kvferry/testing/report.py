"""The conformance report: one result per scenario, as text, JSON or a Markdown table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PASSED = "passed"
FAILED = "failed"
NOT_EXERCISED = "not exercised"
NOT_APPLICABLE = "not applicable"
STATUSES = (PASSED, FAILED, NOT_EXERCISED, NOT_APPLICABLE)


@dataclass
class ScenarioResult:
    """A scenario's outcome. ``reasons``: why it failed, or why it could not be exercised;
    ``notes``: what was observed when it passed (hit sizes, which requests were preempted)."""

    scenario: str
    status: str
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status != FAILED


@dataclass
class ConformanceReport:
    """All scenarios of one connector configuration."""

    connector: str
    kv_transfer_config: dict[str, Any]
    profile: str
    results: list[ScenarioResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "connector": self.connector,
            "kv_transfer_config": self.kv_transfer_config,
            "profile": self.profile,
            "ok": self.ok,
            "counts": self.counts(),
            "results": [asdict(r) for r in self.results],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        c = self.counts()
        lines = [
            f"conformance: {self.connector} (profile {self.profile})",
            *(_text_line(r) for r in self.results),
            f"{c[PASSED]} passed, {c[FAILED]} failed, {c[NOT_EXERCISED]} not exercised, "
            f"{c[NOT_APPLICABLE]} not applicable",
        ]
        return "\n".join(lines) + "\n"

    def to_markdown(self, title: str | None = None) -> str:
        c = self.counts()
        lines = [
            f"### {title or self.connector}",
            "",
            f"`{json.dumps(self.kv_transfer_config)}`",
            "",
            f"{c[PASSED]} passed, {c[FAILED]} failed, {c[NOT_EXERCISED]} not exercised, "
            f"{c[NOT_APPLICABLE]} not applicable.",
            "",
            "| scenario | result | why / observed |",
            "|---|---|---|",
        ]
        for r in self.results:
            why = "; ".join(r.reasons or r.notes).replace("|", "\\|")
            lines.append(f"| {r.scenario} | {r.status} | {why} |")
        return "\n".join(lines) + "\n"


def _text_line(r: ScenarioResult) -> str:
    line = f"  {r.status.upper():15} {r.scenario}"
    detail = r.reasons or r.notes
    if detail:
        line += ": " + "; ".join(detail)
    return line
