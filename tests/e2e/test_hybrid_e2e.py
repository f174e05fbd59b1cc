"""A hybrid model (Qwen3 with interleaved sliding-window layers) through the whole engine:
two KV cache groups, greedy tokens identical to transformers' with chunked prefill, prefix
hits and preemption on a tight pool; nothing leaks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.config import ConfigError

transformers = pytest.importorskip("transformers")

WINDOW = 20
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen3", layers=4, sliding_window=WINDOW)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 2000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    shared = _prompts(0, [60])[0]
    # Longer than the window, some sharing a 60-token prefix, one shorter than the window.
    return [shared + p for p in _prompts(1, [9, 30])] + _prompts(2, [75, 41, 12])


@pytest.fixture(scope="module")
def expected(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = hf.generate(
                torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )  # fmt: skip
        out.append(ids[0, len(p) :].tolist())
    return out


def _llm(model_dir: Path, **kw: Any) -> LLM:
    args: dict[str, Any] = {"dtype": "float32", "max_model_len": 256,
                            "max_num_batched_tokens": 32, "num_kv_blocks": 40}  # fmt: skip
    args.update(kw)
    return LLM(model=str(model_dir), **args)


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[Any]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def _check_idle(llm: LLM) -> None:
    sched = llm.engine.scheduler
    sched.check_integrity()
    kvm = sched.kv_cache_manager
    assert kvm.get_num_free_blocks() == kvm.num_usable_blocks
    assert not sched.requests


def test_engine_builds_two_groups(model_dir: Path) -> None:
    llm = _llm(model_dir)
    try:
        config = llm.engine.kv_cache_config
        assert [g.sliding_window for g in config.groups] == [None, WINDOW]
        assert [len(g.layer_names) for g in config.groups] == [2, 2]
        # Layers i of both groups share a tensor: a block costs two layers, not four.
        assert len(config.kv_cache_tensors) == 2
    finally:
        llm.engine.shutdown()


def test_greedy_matches_hf_with_chunks_and_prefix_hits(
    model_dir: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    llm = _llm(model_dir, num_kv_blocks=120)
    try:
        first, _ = _generate(llm, prompts)
        assert first == expected
        again, outs = _generate(llm, prompts)
        assert again == expected
        assert sum(o.num_cached_tokens for o in outs) >= 4 * 16
        _check_idle(llm)
    finally:
        llm.engine.shutdown()


def test_greedy_matches_hf_under_preemption(
    model_dir: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    llm = _llm(model_dir, num_kv_blocks=34, max_num_batched_tokens=64)
    try:
        got, _ = _generate(llm, prompts)
        assert got == expected
        assert llm.engine.scheduler.num_preemptions > 0
        _check_idle(llm)
    finally:
        llm.engine.shutdown()


def _example(path: Path) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}  # fmt: skip


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_example_connector_hits_are_token_identical(
    model_dir: Path,
    prompts: list[list[int]],
    expected: list[list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    layout: str,
) -> None:
    """A fresh engine loads the stored prefixes (a sliding layer's file holds only its
    window's blocks) and generates exactly what a run without a connector does, in either
    KV layout (the groups' layers share HND tensors too)."""
    monkeypatch.setenv("KVFERRY_KV_CACHE_LAYOUT", layout)
    kv = _example(tmp_path / "kv")
    first = _llm(model_dir, kv_transfer_config=kv, num_kv_blocks=120)
    try:
        assert first.engine.kv_cache_config.layout.value == layout
        got, outs = _generate(first, prompts)
        assert got == expected
        assert all(o.metrics.num_external_cached_tokens == 0 for o in outs)
        _check_idle(first)
    finally:
        first.engine.shutdown()
    second = _llm(model_dir, kv_transfer_config=kv, num_kv_blocks=120)
    try:
        got, outs = _generate(second, prompts)
        assert got == expected
        for prompt, out in zip(prompts, outs, strict=True):
            m = out.metrics
            assert m.num_local_cached_tokens + m.num_external_cached_tokens == (
                (len(prompt) - 1) // 16 * 16
            )
        assert sum(o.metrics.num_external_cached_tokens for o in outs) > 0
        _check_idle(second)
    finally:
        second.engine.shutdown()


@pytest.mark.parametrize(
    "kv",
    [
        {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"},
        {"kv_connector": "MultiConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"connectors": [
             {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
             {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}]}},
    ],
    ids=["mooncake", "multi-with-mooncake"],
)  # fmt: skip
def test_connector_without_hma_is_refused(model_dir: Path, kv: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="does not implement SupportsHMA.*2 KV cache groups"):
        _llm(model_dir, kv_transfer_config=kv)
