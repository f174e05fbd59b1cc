"""The small-step linear A/B runs end to end on a tiny model: the bf16 kernel built from a git
revision's sources against the working tree's, per-pass rates and an engine's paired steps."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import rows_linear_ab
from kvferry.native.bf16_linear import load_bf16_linear
from kvferry.worker.cpu_features import cpu_features


@pytest.fixture
def bf16_kernel_engine() -> None:
    if cpu_features().cpu_isa == "scalar" or load_bf16_linear("avx2") is None:
        pytest.skip("needs an AVX2 CPU and a C compiler")
    if cpu_features().native_bf16:
        pytest.skip("this CPU has bf16 instructions: the engine takes no widening bf16 kernel")


@pytest.mark.usefixtures("bf16_kernel_engine")
def test_both_parts_compare_the_revision_with_the_tree(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    out = tmp_path / "ab.json"
    args = ["--baseline", "HEAD", "--model", str(tiny_model_factory()), "--parts", "kernel,engine"]
    args += ["--rows", "1,4", "--engine-cases", "2x24", "--rounds", "2", "--allow-noise"]
    rows_linear_ab.main([*args, "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["linear_kernel"] == "bf16_linear" and doc["variant"] == "avx2"
    assert [r["rows"] for r in doc["kernel"]["rows"]] == [1, 4]
    assert doc["kernel"]["matrices"] == 4 * 4 + 1  # the tiny model's 4 layers and the logits
    for row in doc["kernel"]["rows"]:
        assert row["gbps"]["baseline"] > 0 and row["gbps"]["current"] > 0 and row["gain"] > 0
        # Outputs near 1 in bf16: the builds may sum in other orders, a rounding step apart.
        assert row["max_abs_diff"] <= 2**-5
    (engine,) = doc["engine"]
    assert (engine["requests"], engine["tokens"]) == (2, 24)
    # Not asserted positive: a step is the difference of two short runs, which a busy
    # machine can turn negative in a tiny model.
    assert len(engine["gains"]) == 2 and all(math.isfinite(g) for g in engine["gains"])
    assert doc["table"].count("| bf16_linear avx2 |") == 3
