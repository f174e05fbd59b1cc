"""Offload connectors on a hybrid model (full + sliding-window KV cache groups): greedy
outputs token-identical to a run without a connector, on workloads whose prefixes the
engine's own pool cannot keep, hits really from the offload tier, nothing leaks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _llm(model_dir: Path, kv: dict | None = None) -> LLM:
    args: dict[str, Any] = {"dtype": "float32", "max_model_len": 512,
                            "max_num_batched_tokens": 512, "num_kv_blocks": 70}  # fmt: skip
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model_dir), **args)


def _kv(name: str, **extra: Any) -> dict:
    return {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _workload(llm: LLM) -> tuple[list[list[int]], int]:
    """Conversations whose every turn extends the whole history, then a wave of shared
    system prompts; returns all outputs and the external hit tokens."""
    g = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(5, 2000, (n,), generator=g).tolist()

    history = [tokens(70) for _ in range(8)]
    outputs, external = [], 0
    for _ in range(3):
        prompts = [h + tokens(15) for h in history]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        outputs += got
        external += sum(o.metrics.num_external_cached_tokens for o in outs)
        history = [p + t for p, t in zip(prompts, got, strict=True)]
    return outputs, external


def _drain(llm: LLM, connector: bool) -> None:
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    sched = engine.scheduler
    sched.check_integrity()
    kvm = sched.kv_cache_manager
    assert kvm.get_num_free_blocks() == kvm.num_usable_blocks
    assert not sched.requests
    if connector:
        sched.connector.check_offload_integrity(idle=True)  # type: ignore[union-attr]
    engine.shutdown()


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen3", layers=4, sliding_window=20)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    llm = _llm(model_dir)
    outputs, _ = _workload(llm)
    _drain(llm, connector=False)
    return outputs


@pytest.mark.parametrize(
    "kv",
    [
        _kv("SimpleCPUOffloadConnector", num_cpu_blocks=512),
        _kv("SimpleCPUOffloadConnector", num_cpu_blocks=512, lazy_offload=True),
        _kv("OffloadingConnector", num_cpu_chunks=256, offload_prompt_only=False),
        _kv("OffloadingConnector", num_cpu_chunks=128, blocks_per_chunk=2,
            offload_prompt_only=False),
    ],
    ids=["simple", "simple-lazy", "offload", "offload-c2"],
)  # fmt: skip
def test_offload_on_hybrid_model_is_token_identical(
    model_dir: Path, reference: list[list[int]], kv: dict
) -> None:
    llm = _llm(model_dir, kv)
    outputs, external = _workload(llm)
    assert outputs == reference
    assert external > 0
    _drain(llm, connector=True)


def test_offload_disk_tier_on_hybrid_model(
    model_dir: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    """A fresh engine on the same disk folder: hits of both groups come from the files."""
    kv = _kv("OffloadingConnector", num_cpu_chunks=64, disk_path=str(tmp_path / "disk"),
             offload_prompt_only=False)  # fmt: skip
    first = _llm(model_dir, kv)
    outputs, _ = _workload(first)
    assert outputs == reference
    _drain(first, connector=True)
    second = _llm(model_dir, kv)
    outputs, external = _workload(second)
    assert outputs == reference
    assert external > 0
    _drain(second, connector=True)
