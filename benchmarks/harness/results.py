"""Result files: JSON under ``.bench/results``."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import machine_info
from benchmarks.harness.paths import RESULTS_DIR


def result_path(stem: str, quick: bool = False) -> Path:
    """``.bench/results/STEM.json``, or ``STEM_quick.json`` for a smoke run."""
    return RESULTS_DIR / f"{stem}{'_quick' if quick else ''}.json"


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


def run_header() -> dict[str, Any]:
    """``machine`` and ``date`` fields that open a result document, taken when called."""
    return {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M")}


def write_json(path: Path, doc: Mapping[str, Any]) -> Path:
    """Write ``doc`` as indented JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    return path
