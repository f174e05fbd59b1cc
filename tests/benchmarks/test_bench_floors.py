"""The throughput benchmark's floors: weight bytes per pass, pass counts, the copy-bandwidth
probe, the roofline schedule, and the targets that read them."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.harness.bandwidth import (
    BandwidthFloor,
    kv_read_bytes,
    measure_copy_bandwidth,
    min_forward_passes,
    weight_bytes_per_pass,
)
from benchmarks.harness.compute import LinearFlops, linear_flops
from benchmarks.harness.roofline import Pass, roofline_floor_s, schedule_passes
from benchmarks.throughput_targets import check

QWEN3_06B = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def test_qwen3_06b_params_and_weight_bytes() -> None:
    # Per layer: q 1024x2048, k/v 1024x1024 each, o 2048x1024, MLP 3 x 1024x3072, two
    # hidden norms and the 128-wide q/k norms; plus the tied 151936 x 1024 embedding.
    layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
    expected = 28 * layer + 1024 + 151936 * 1024
    assert linear_flops(QWEN3_06B).num_params == expected
    assert weight_bytes_per_pass(QWEN3_06B, "float32") == 4 * expected
    assert weight_bytes_per_pass(QWEN3_06B, "bfloat16") == 2 * expected


def test_untied_input_embedding_is_not_read_per_pass() -> None:
    untied = {**QWEN3_06B, "tie_word_embeddings": False}
    # The lm_head is read every pass; the input embedding only by the batch's rows.
    assert weight_bytes_per_pass(untied, "bfloat16") == weight_bytes_per_pass(QWEN3_06B, "bfloat16")
    assert linear_flops(untied).num_params == linear_flops(QWEN3_06B).num_params + 151936 * 1024


def test_min_forward_passes() -> None:
    # The longest request's output length bounds the passes...
    assert min_forward_passes([100] * 8, [64] * 8, 2048) == 64
    # ... unless the fed tokens need more budget-sized passes: (64 * 200 + 64 * 2 - 64) / 256.
    assert min_forward_passes([200] * 64, [2] * 64, 256) == 51


def test_kv_read_bytes_counts_each_decode_step_context() -> None:
    # One request: prompt 10, 3 outputs -> decode steps attend over 11 and 12 tokens.
    assert kv_read_bytes([10], [3], kv_per_token=2) == (11 + 12) * 2
    assert kv_read_bytes([10, 4], [1, 2], kv_per_token=1) == 5


def test_bandwidth_floor_seconds() -> None:
    f = BandwidthFloor(weight_bytes_per_pass=10**9, passes=64, copy_gbps=20.0, kv_read_bytes=0)
    assert f.floor_s == pytest.approx(3.2)


def test_copy_bandwidth_probe_is_positive_and_reports_its_buffer() -> None:
    bw = measure_copy_bandwidth(buffer_bytes=8 << 20, min_time=0.01, rounds=1)
    assert bw.gbps > 0
    assert bw.buffer_bytes == 8 << 20


def test_schedule_decodes_first_and_chunks_prompts() -> None:
    passes = schedule_passes([3, 5], [2, 1], token_budget=4)
    # Pass 1: prompt 0 whole (samples its 1st token) + 1 token of prompt 1; pass 2: request
    # 0 decodes its last token + 3 more of prompt 1; pass 3: the rest of prompt 1.
    assert passes == [Pass(4, 1), Pass(4, 1), Pass(1, 1)]


@pytest.mark.parametrize("budget", [16, 256, 2048])
def test_schedule_feeds_and_samples_every_token_once(budget: int) -> None:
    prompts, outs = [64, 200, 17, 256], [64, 8, 1, 30]
    passes = schedule_passes(prompts, outs, budget)
    assert sum(p.sampled for p in passes) == sum(outs)
    assert sum(p.fed for p in passes) == sum(prompts) + sum(outs) - len(outs)
    assert all(p.fed <= budget for p in passes)
    assert len(passes) >= min_forward_passes(prompts, outs, budget)


def test_roofline_charges_each_pass_its_slower_limit() -> None:
    flops = LinearFlops(per_token_body=10**9, lm_head=10**8, num_params=0)
    # At 1 GFLOP/s, with 2 GB of weights per pass at 1 GB/s (2 s per pass): the first pass
    # is compute-bound (5.1 s), the second bound by its weight bytes (2 s > 1 s of FLOPs).
    passes = [Pass(fed=5, sampled=1), Pass(fed=1, sampled=0)]
    assert roofline_floor_s(passes, flops, 1.0, 2 * 10**9, 1.0) == pytest.approx(5.1 + 2.0)


def _doc(name: str, tps: float, roofline_s: float) -> dict[str, Any]:
    kv = {"status": "ok", "tokens_per_s": tps, "gen_s": 512 / tps, "startup_s": 1.0}
    return {
        "row": {"name": name, "mixed_range": None},
        "results": {"kvferry": kv},
        "floor_s": 1.0,
        "roofline_floor_s": roofline_s,
    }


def test_targets_check_bf16_speedup_and_roofline() -> None:
    rows = [
        _doc("qwen3-0.6b-fp32-p8", 100.0, 4.0),
        _doc("qwen3-0.6b-bf16-p8", 120.0, 4.0),  # 1.2x fp32 (< 1.3x); 4.27 s / 4 s (ok)
        _doc("qwen3-0.6b-fp32-p64", 100.0, 2.0),
        _doc("qwen3-0.6b-bf16-p64", 140.0, 2.0),  # 1.4x fp32 (ok); 3.66 s / 2 s (> 1.5x)
    ]
    _, verdicts = check(rows)
    text = "\n".join(verdicts)
    assert "bf16 >= 1.3x fp32 tok/s: missed on qwen3-0.6b-bf16-p8 1.20x" in text
    assert "roofline floor: missed on qwen3-0.6b-bf16-p64 1.83x" in text
