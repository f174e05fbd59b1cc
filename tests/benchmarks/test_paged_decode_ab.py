"""The decode-attention A/B runs end to end on a tiny model: a kernel built from a git
revision's sources against the working tree's, per-call rates and an engine's paired steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import paged_decode_ab

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler on this machine"
)


# The last revision whose kernel takes no variant argument.
BEFORE_VARIANTS = "1f502f9"


def _has_revision(rev: str) -> bool:
    root = Path(__file__).resolve().parents[2]
    probe = subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{rev}^{{commit}}"])
    return probe.returncode == 0


@pytest.mark.parametrize(
    "baseline",
    [
        "HEAD",
        pytest.param(
            BEFORE_VARIANTS,
            marks=pytest.mark.skipif(
                not _has_revision(BEFORE_VARIANTS), reason="a shallow clone without it"
            ),
        ),
    ],
)
def test_both_parts_compare_the_revision_with_the_tree(
    baseline: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    out = tmp_path / "ab.json"
    args = [
        "--baseline",
        baseline,
        "--model",
        str(tiny_model_factory()),
        "--parts",
        "kernel,engine",
    ]
    args += ["--dtypes", "float32", "--cases", "1x20,3x40", "--engine-cases", "2x24"]
    args += ["--pool-mib", "1", "--rounds", "2", "--allow-noise", "--out", str(out)]
    paged_decode_ab.main(args)
    doc = json.loads(out.read_text())
    assert [(r["requests"], r["tokens"]) for r in doc["kernel"]] == [(1, 20), (3, 40)]
    for row in doc["kernel"]:
        assert row["gbps"]["baseline"] > 0 and row["gbps"]["current"] > 0
        assert row["max_abs_diff"] < 1e-5  # the same attention, whichever build
    (engine,) = doc["engine"]
    assert len(engine["gains"]) == 2 and all(g > 0 for g in engine["gains"])
    assert doc["table"].count("| float32 |") == 3
