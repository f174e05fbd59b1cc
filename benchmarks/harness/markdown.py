"""Markdown output: tables for stdout, and the generated blocks of ``docs/benchmarks.md``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.paths import BENCH_DOC


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; ``None`` prints as ``-``, floats with 1-2 decimals."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:,.0f} MiB"


def update_doc(block: str, markdown: str, doc: Path = BENCH_DOC) -> Path:
    """Replace the text between ``<!-- block:begin -->`` and ``<!-- block:end -->`` in
    ``doc`` (appending the block if it is not there yet)."""
    begin, end = f"<!-- {block}:begin -->", f"<!-- {block}:end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    new = f"{begin}\n{markdown.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + new + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return doc
