"""The fused-ops A/B benchmark runs end to end on a tiny model and records both sides."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import fused_ops_ab
from kvferry.native.fused_ops import load_fused_ops


@pytest.mark.skipif(load_fused_ops() is None, reason="needs a C compiler")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rounds_alternate_and_the_result_has_both_sides(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, dtype: str
) -> None:
    out = tmp_path / "ab.json"
    args = ["--model", str(tiny_model_factory()), "--dtype", dtype, "--prompts", "2"]
    fused_ops_ab.main([*args, "--max-tokens", "4", "--rounds", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    rates = doc["tokens_per_s"]
    assert len(rates["fused"]) == len(rates["torch"]) == 2
    assert all(r > 0 for r in rates["fused"] + rates["torch"])
    assert len(doc["paired_gain"]["per_round"]) == 2
    assert doc["meta"]["machine"]["cpu_count"] >= 1
