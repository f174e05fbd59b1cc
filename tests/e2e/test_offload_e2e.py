"""Offload connectors end to end with a tiny model: greedy outputs are token-identical with
and without offloading, on workloads whose prefixes the engine's own KV pool cannot keep, so
the hits must come from the offload tiers; and nothing leaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.config import ConfigError
from kvferry.kv_layout import KVCacheLayout

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SIMPLE = "SimpleCPUOffloadConnector"
OFFLOAD = "OffloadingConnector"


def _llm(model_dir: Path, kv: dict | None = None, **kw: Any) -> LLM:
    args: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_batched_tokens": 512,
        "num_kv_blocks": 34,  # 544 tokens: never the whole workload
    }
    args.update(kw)
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model_dir), **args)


def _kv(name: str, **extra: Any) -> dict:
    return {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(5, 2000, (n,), generator=g).tolist()


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[Any]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def multi_turn(llm: LLM, convs: int = 5, turns: int = 3) -> tuple[list[list[int]], int]:
    """Each turn of every conversation extends its whole history; returns all outputs and
    the external (offload) hit tokens."""
    g = torch.Generator().manual_seed(5)
    history = [_tokens(g, 70) for _ in range(convs)]
    outputs, external = [], 0
    for _ in range(turns):
        prompts = [h + _tokens(g, 15) for h in history]
        tokens, outs = _generate(llm, prompts)
        outputs += tokens
        external += sum(o.metrics.num_external_cached_tokens for o in outs)
        history = [p + t for p, t in zip(prompts, tokens, strict=True)]
    return outputs, external


def shared_prefixes(llm: LLM, waves: int = 3) -> tuple[list[list[int]], int]:
    """Two long system prompts, many short questions each, in waves that churn the pool."""
    g = torch.Generator().manual_seed(6)
    systems = [_tokens(g, 150) for _ in range(2)]
    outputs, external = [], 0
    for _ in range(waves):
        prompts = [s + _tokens(g, 10) for s in systems for _ in range(3)]
        prompts += [_tokens(g, 120) for _ in range(2)]  # unrelated traffic
        tokens, outs = _generate(llm, prompts)
        outputs += tokens
        external += sum(o.metrics.num_external_cached_tokens for o in outs)
    return outputs, external


def drain_and_check(llm: LLM) -> dict[str, Any]:
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    sched = engine.scheduler
    sched.check_integrity()
    assert sched.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_config.num_blocks
    assert not sched.requests
    sched.connector.check_offload_integrity(idle=True)  # type: ignore[union-attr]
    stats = dict(engine.kv_connector_totals.as_dict())
    engine.shutdown()
    return stats


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, list[list[int]]]:
    llm = _llm(model_dir)
    return {"multi_turn": multi_turn(llm)[0], "shared": shared_prefixes(llm)[0]}


CONFIGS = {
    "simple-eager": _kv(SIMPLE, num_cpu_blocks=256),
    "simple-lazy": _kv(SIMPLE, num_cpu_blocks=256, lazy_offload=True),
    "offload-lru-c2": _kv(
        OFFLOAD, num_cpu_chunks=128, blocks_per_chunk=2, offload_prompt_only=False
    ),
    "offload-arc": _kv(OFFLOAD, num_cpu_chunks=256, eviction_policy="arc"),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_multi_turn_conversations(model_dir, reference, config) -> None:
    llm = _llm(model_dir, CONFIGS[config])
    tokens, external = multi_turn(llm)
    assert tokens == reference["multi_turn"]
    assert external > 0
    stats = drain_and_check(llm)
    assert stats["hit_tokens_host"] >= external  # more: preempted requests load again
    assert stats["load_bytes"] > 0 and stats["store_bytes"] > 0


@pytest.mark.parametrize("config", ["simple-eager", "offload-lru-c2"])
def test_many_requests_sharing_long_prefixes(model_dir, reference, config) -> None:
    llm = _llm(model_dir, CONFIGS[config])
    tokens, external = shared_prefixes(llm)
    assert tokens == reference["shared"]
    assert external >= 2 * 144  # each system prompt came back from the host at least once
    drain_and_check(llm)


def test_disk_tier_serves_when_host_memory_is_too_small(model_dir, reference, tmp_path) -> None:
    kv = _kv(OFFLOAD, num_cpu_chunks=4, disk_path=str(tmp_path), offload_prompt_only=False)
    llm = _llm(model_dir, kv)
    tokens, external = multi_turn(llm)
    assert tokens == reference["multi_turn"]
    stats = drain_and_check(llm)
    assert stats["hit_tokens_disk"] > stats.get("hit_tokens_host", 0)
    assert stats["disk_store_jobs"] > 0  # the host had no room: written straight to disk
    # A new engine on the same folder (nothing in its pool or host tier) reuses the files.
    again = _llm(model_dir, kv)
    tokens, external = multi_turn(again)
    assert tokens == reference["multi_turn"]
    stats = drain_and_check(again)
    assert stats["hit_tokens_disk"] >= 5 * 64
    assert stats.get("verify_jobs", 0) + stats.get("promote_jobs", 0) > 0


def test_lazy_offload_inside_multi_connector(model_dir, reference) -> None:
    """MultiConnector hands the engine's KV cache manager to its children, so lazy offload
    (which walks the free queue) works when wrapped."""
    child = {
        "kv_connector": SIMPLE,
        "kv_connector_extra_config": CONFIGS["simple-lazy"]["kv_connector_extra_config"],
    }
    kv = _kv("MultiConnector", connectors=[child])
    llm = _llm(model_dir, kv)
    tokens, external = multi_turn(llm)
    assert tokens == reference["multi_turn"]
    assert external > 0
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.check_integrity()
    inner = engine.scheduler.connector.children[0]  # type: ignore[union-attr]
    inner.check_offload_integrity(idle=True)
    engine.shutdown()


def test_bad_configs_fail_clearly(model_dir) -> None:
    with pytest.raises(ConfigError, match="needs prefix caching"):
        _llm(model_dir, _kv(SIMPLE, num_cpu_blocks=8), enable_prefix_caching=False)
    with pytest.raises(ConfigError, match=r"unknown kv_connector_extra_config .*valid options"):
        _llm(model_dir, _kv(OFFLOAD, num_cpu_chunks=8, cpu_gb=3))


def test_host_and_disk_tiers_under_the_hnd_layout(model_dir, reference, tmp_path, monkeypatch):
    """Blocks move as bytes in memory order; the disk folder names the layout, so an NHD
    engine never reads an HND engine's files."""
    monkeypatch.setenv("KVFERRY_KV_CACHE_LAYOUT", "HND")
    kv = _kv(OFFLOAD, num_cpu_chunks=4, disk_path=str(tmp_path), offload_prompt_only=False)
    llm = _llm(model_dir, kv)
    assert llm.engine.kv_cache_config.layout is KVCacheLayout.HND
    tokens, external = multi_turn(llm)
    assert tokens == reference["multi_turn"] and external > 0
    drain_and_check(llm)
    again = _llm(model_dir, kv)
    tokens, _ = multi_turn(again)
    assert tokens == reference["multi_turn"]
    assert drain_and_check(again)["hit_tokens_disk"] >= 5 * 64
    folders = [p.name for p in tmp_path.iterdir()]
    assert folders and all("-hnd-" in name for name in folders)
