"""vLLM's worker-side call order on every step of a real run, read from the protocol trace
(``KVFERRY_TRACE_CONNECTOR``): handle_preemptions -> bind -> start_load_kv -> layers ->
finish_forward -> wait_for_save -> get_finished ... -> clear, with sync loads (a second
ExampleConnector engine hits what the first stored) and async loads (OffloadingConnector)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.kv_transfer.trace import read_runs, render_mermaid

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LAYER = ("wait_for_layer_load", "save_kv_layer")
# One step of the worker side, vLLM's order; the layer hooks only on steps with a forward.
STEP = re.compile(
    r"handle_preemptions bind_connector_metadata start_load_kv (L )*finish_forward "
    r"wait_for_save (get_transfer_results |get_finished (get_failed_recving )?)"
    r"get_block_ids_with_load_errors build_connector_worker_meta clear_connector_metadata "
)


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(5, 500, (48,), generator=g).tolist()
    return [system + torch.randint(5, 500, (7 + i,), generator=g).tolist() for i in range(n)]


def _run(model_dir: Path, kv: dict[str, Any], prompts: list[list[int]], **kw: Any) -> list[Any]:
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=256,
        kv_transfer_config=kv,
        **kw,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.kv_cache_manager.get_num_free_blocks() == (
        engine.kv_cache_config.num_blocks
    )
    assert not engine.scheduler.requests
    engine.shutdown()
    return outs


def _worker_steps(records: list[dict[str, Any]]) -> list[str]:
    steps: list[str] = []
    for rec in records:
        if rec["role"] != "worker" or rec["method"] in ("register_kv_caches", "shutdown"):
            continue
        if rec["method"] == "set_host_xfer_buffer_ops":
            continue
        if rec["method"] == "handle_preemptions":
            steps.append("")
        name = "L" if rec["method"] in LAYER else rec["method"]
        if steps and not (name == "L" and steps[-1].endswith("L ")):
            steps[-1] += name + " "
    return steps


def _check_trace(trace: Path) -> list[list[str]]:
    runs = read_runs(trace)
    assert runs
    all_steps = []
    for run in runs:
        steps = _worker_steps(run.records)
        assert steps, "no worker steps traced"
        for s in steps:
            assert STEP.fullmatch(s), s
        all_steps.append(steps)
        # The rendered diagram shows start_load_kv before the layers of every forward step.
        diagram = render_mermaid(trace, run=runs.index(run) + 1)
        for block in diagram.split("Note over S,A: step")[1:]:
            if "wait_for_layer_load / save_kv_layer" in block:
                assert block.index("start_load_kv") < block.index("wait_for_layer_load")
    return all_steps


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


def test_sync_loads_trace_vllm_order(model_dir, tmp_path, monkeypatch) -> None:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KVFERRY_TRACE_CONNECTOR", "1")
    monkeypatch.setenv("KVFERRY_TRACE_FILE", str(trace))
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")},
    }
    prompts = _prompts(3)
    _run(model_dir, kv, prompts)
    outs = _run(model_dir, kv, prompts)  # a second engine: external sync hits
    assert sum(o.metrics.num_external_cached_tokens for o in outs) > 0
    assert all(o.num_cached_tokens == o.metrics.num_cached_tokens for o in outs)
    runs = _check_trace(trace)
    assert len(runs) == 2
    methods = [r["method"] for run in read_runs(trace) for r in run.records]
    assert "on_new_request" in methods and "finish_forward" in methods


def test_async_loads_trace_vllm_order(model_dir, tmp_path, monkeypatch) -> None:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KVFERRY_TRACE_CONNECTOR", "1")
    monkeypatch.setenv("KVFERRY_TRACE_FILE", str(trace))
    kv = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_chunks": 64},
    }
    g = torch.Generator().manual_seed(8)
    churn = [torch.randint(5, 500, (120,), generator=g).tolist() for _ in range(4)]
    prompts = _prompts(4)
    llm_kw = {"num_kv_blocks": 20}
    # The first wave stores, the churn evicts it from the engine's pool, the repeat loads it.
    outs = _run(model_dir, kv, [prompts[0]] + churn + [prompts[0]], **llm_kw)
    assert outs[-1].metrics.num_external_cached_tokens > 0
    assert outs[-1].metrics.external_cache_hit_sources
    _check_trace(trace)
