"""KV connectors on tensor-parallel engines (TP=2, two worker processes): each rank stores and
loads its own KV heads, hits are token-identical to a TP=2 run without a connector, stores
count complete only once every rank finished, and what a connector persists serves a new TP=2
engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvferry import LLM
from tests.e2e.test_connectors_e2e import PROMPTS, _assert_clean, _example, _run
from tests.e2e.test_offload_e2e import OFFLOAD, SIMPLE, _kv, drain_and_check, multi_turn


def _tp2(model_dir: Path, kv: dict[str, Any] | None = None, **kw: Any) -> LLM:
    args: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_batched_tokens": 512,
        "num_kv_blocks": 34,  # 544 tokens: the offload workloads do not fit, hits come back
        "tensor_parallel_size": 2,
    }
    args.update(kw)
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model_dir), **args)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, list[list[int]]]:
    llm = _tp2(model_dir)
    try:
        return {"multi_turn": multi_turn(llm)[0], "prompts": _run(llm)[0]}
    finally:
        llm.shutdown()


def test_example_connector_tp2_per_rank_folders_and_restart(model_dir, reference, tmp_path):
    kv = _example(tmp_path / "kv")
    first = _tp2(model_dir, kv)
    try:
        tokens, outs = _run(first)
        assert tokens == reference["prompts"]
        assert all(o.metrics.num_external_cached_tokens == 0 for o in outs)
        _assert_clean(first)
    finally:
        first.shutdown()
    for rank in (0, 1):
        stored = list((tmp_path / "kv").glob(f"*-tp2/rank{rank}/*/meta.json"))
        assert len(stored) == len(PROMPTS), rank
    # A prefix one rank lacks is never offered: remove one from rank 1 only.
    lone = min((tmp_path / "kv").glob("*-tp2/rank1/*/meta.json"), key=lambda p: p.parent.name)
    lone.unlink()

    second = _tp2(model_dir, kv)
    try:
        tokens, outs = _run(second)
        assert tokens == reference["prompts"]
        assert sum(o.metrics.num_external_cached_tokens for o in outs) > 0
        _assert_clean(second)
    finally:
        second.shutdown()


def test_simple_cpu_offload_tp2_multi_turn(model_dir, reference) -> None:
    llm = _tp2(model_dir, _kv(SIMPLE, num_cpu_blocks=256))
    try:
        tokens, external = multi_turn(llm)
        assert tokens == reference["multi_turn"]
        assert external > 0
        stats = drain_and_check(llm)
        assert stats["load_bytes"] > 0 and stats["store_bytes"] > 0
    finally:
        llm.shutdown()


def test_offloading_disk_tier_tp2_restart_reuse(model_dir, reference, tmp_path) -> None:
    kv = _kv(OFFLOAD, num_cpu_chunks=4, disk_path=str(tmp_path), offload_prompt_only=False)
    llm = _tp2(model_dir, kv)
    try:
        tokens, _ = multi_turn(llm)
        assert tokens == reference["multi_turn"]
        stats = drain_and_check(llm)
        assert stats["hit_tokens_disk"] > 0
    finally:
        llm.shutdown()
    files = {r: sorted(p.name for p in tmp_path.glob(f"*/rank{r}/*")) for r in (0, 1)}
    assert files[0] and files[0] == files[1]  # each rank wrote its own file of every chunk

    again = _tp2(model_dir, kv)
    try:
        tokens, _ = multi_turn(again)
        assert tokens == reference["multi_turn"]
        stats = drain_and_check(again)
        assert stats["hit_tokens_disk"] >= 5 * 64
    finally:
        again.shutdown()
