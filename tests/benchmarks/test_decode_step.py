"""The decode-step benchmark runs end to end on a tiny model: alternating launches of each
dtype, step times per batch size, floors, and the table that compares them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from benchmarks import decode_step


def test_each_dtype_gets_step_times_floors_and_a_ratio(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    out = tmp_path / "decode.json"
    args = ["--model", str(tiny_model_factory()), "--batches", "1,2", "--steps", "2"]
    args += ["--reps", "1", "--prompt-len", "8", "--launches", "2", "--allow-noise"]
    decode_step.main([*args, "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["settings"]["dtypes"] == ["bfloat16", "float32"]
    for dtype in ("bfloat16", "float32"):
        launches = doc["launches"][dtype]
        assert len(launches) == 2
        assert all(set(la["step_s"]) == {"1", "2"} for la in launches)
        assert all(s > 0 for la in launches for s in la["step_s"].values())
        assert launches[0]["cpu_paths"]["linear"]
        floors = doc["floors"]["per_dtype"][dtype]["2"]
        assert floors["memory_s"] > 0 and floors["compute_s"] > 0
    # bf16 reads half the bytes of fp32
    bf, fp = (doc["floors"]["per_dtype"][d]["1"]["memory_s"] for d in ("bfloat16", "float32"))
    assert abs(fp / bf - 2.0) < 0.01
    lines = doc["table"].splitlines()
    assert len(lines) == 2 + 4 and lines[2].startswith("| 1 | bf16")
    # the baseline's own rows carry no ratio; the others' do
    assert lines[2].split("|")[-2].strip().endswith("x") and not lines[3].split("|")[-2].strip()
