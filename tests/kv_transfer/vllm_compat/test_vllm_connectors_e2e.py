"""Connectors written for vLLM (vLLM import paths, constructor styles and object attributes),
loaded by ``kv_connector_module_path`` with vLLM not installed: token-identical to a run
without a connector, with external hits on a second engine, nothing leaked."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.kv_transfer import vllm_imports

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
DISK = "tests.helpers.vllm_style.disk_connector"
ASYNC = "tests.helpers.vllm_style.async_connector"


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 500, (40,), generator=g).tolist()
    return [shared + torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 21)] + [
        torch.randint(3, 500, (37,), generator=g).tolist()
    ]


def _llm(model_dir: Path, kv: dict | None = None) -> LLM:
    args: dict = {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 128}
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model_dir), **args)


def _run(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def _assert_clean(llm: LLM) -> None:
    sched = llm.engine.scheduler
    sched.kv_cache_manager.check_integrity()
    assert sched.kv_cache_manager.get_num_free_blocks() == llm.engine.kv_cache_config.num_blocks
    assert not sched.has_unfinished_requests()


def _expected_hit(prompt: list[int]) -> int:
    return (len(prompt) - 1) // 16 * 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


def test_vllm_is_not_installed_here():
    assert not vllm_imports.real_vllm_installed()
    if "vllm" not in sys.modules:
        assert importlib.util.find_spec("vllm") is None or vllm_imports.install()


def test_disk_connector_persists_across_restart(model_dir, tmp_path):
    prompts = _prompts(5)
    reference, _ = _run(_llm(model_dir), prompts)
    kv = {
        "kv_connector": "VllmDiskConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": DISK,
        "kv_connector_extra_config": {"storage_path": str(tmp_path / "kv")},
    }
    first = _llm(model_dir, kv)
    connector = first.engine.scheduler.connector
    # Built with vLLM's views: a VllmConfig whose model dtype is a torch dtype.
    assert type(connector._vllm_config).__name__ == "VllmConfig"
    assert connector._dtype is torch.float32
    assert type(connector).__module__ == DISK
    assert sys.modules["vllm"].__name__ == "kvferry.vllm_compat"
    tokens, outs = _run(first, prompts)
    assert tokens == reference
    assert all(o.metrics.num_external_cached_tokens == 0 for o in outs)
    _assert_clean(first)
    first.engine.shutdown()
    assert len(list((tmp_path / "kv").glob("*/*.pt"))) > 0

    second = _llm(model_dir, kv)  # a fresh engine: empty local prefix cache
    tokens, outs = _run(second, prompts)
    assert tokens == reference
    for prompt, out in zip(prompts, outs, strict=True):
        m = out.metrics
        assert m.num_local_cached_tokens + m.num_external_cached_tokens == _expected_hit(prompt)
    assert outs[0].metrics.num_external_cached_tokens == _expected_hit(prompts[0])
    _assert_clean(second)
    second.engine.shutdown()


def test_async_connector_serves_a_second_engine(model_dir):
    from tests.helpers.vllm_style import async_connector as mod  # the shim is installed by now

    prompts = _prompts(9)
    reference, _ = _run(_llm(model_dir), prompts)
    kv = {
        "kv_connector": "VllmAsyncConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": ASYNC,
    }
    producer = _llm(model_dir, kv)
    tokens, outs = _run(producer, prompts)
    assert tokens == reference
    assert all(o.metrics.num_external_cached_tokens == 0 for o in outs)
    _assert_clean(producer)
    producer.engine.shutdown()

    mod.EVENTS.clear()
    consumer = _llm(model_dir, kv)
    engine_id = str(consumer.engine.config.kv_transfer_config.engine_id)
    tokens, outs = _run(consumer, prompts)
    assert tokens == reference
    for prompt, out in zip(prompts, outs, strict=True):
        m = out.metrics
        assert m.num_local_cached_tokens + m.num_external_cached_tokens == _expected_hit(prompt)
    assert sum(o.metrics.num_external_cached_tokens for o in outs) > 0
    mine = [(hook, rid) for eid, hook, rid in mod.EVENTS if eid == engine_id]
    started = [rid for hook, rid in mine if hook == "start_load"]
    assert started
    # Every asynchronous receive is reported by a later step's get_finished than the one of
    # the step that started it (the log is in call order).
    for rid in started:
        s, f = mine.index(("start_load", rid)), mine.index(("finished_recving", rid))
        assert mine[s:f].count(("get_finished", "")) >= 2
    _assert_clean(consumer)
    consumer.engine.shutdown()
