"""The README's example connector under chunked prefill: each prompt block is planned for
storage exactly once (decode steps do not rescan the prompt), a second run loads every full
block but the last token's, outputs stay token-identical, and its per-request state is freed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture
def example_on_path():
    sys.path.insert(0, str(ROOT))
    yield
    sys.path.remove(str(ROOT))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (150, 97, 33)]


def _llm(model_dir: Path, kv: dict | None) -> LLM:
    # 64-token steps: the 150-token prompt is prefilled over three steps, alongside decodes
    args = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 64}
    return LLM(model=str(model_dir), enable_prefix_caching=False, kv_transfer_config=kv, **args)


def _host_prefix(max_blocks: int) -> dict[str, Any]:
    return {
        "kv_connector": "HostPrefixConnector",
        "kv_connector_module_path": "examples.host_prefix_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"max_blocks": max_blocks},
    }


def _run(llm: LLM):
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def test_chunked_prefill_stores_each_block_once_and_hits_all(model_dir, example_on_path):
    reference, _ = _run(_llm(model_dir, None))
    llm = _llm(model_dir, _host_prefix(max_blocks=64))
    sched: Any = llm.engine.scheduler.connector
    stores: list[bytes] = []
    build = sched.build_connector_meta

    def recording(so):
        meta = build(so)
        stores.extend(h for h, _ in meta.stores)
        return meta

    sched.build_connector_meta = recording
    tokens, _ = _run(llm)
    assert tokens == reference
    full_blocks = sum(len(p) // BLOCK for p in _prompts())
    assert len(stores) == len(set(stores)) == full_blocks
    tokens, outs = _run(llm)
    assert tokens == reference
    hits = [o.metrics.num_external_cached_tokens for o in outs]
    assert hits == [(len(p) - 1) // BLOCK * BLOCK for p in _prompts()]
    assert len(stores) == full_blocks  # nothing new to store on the second run
    assert not sched.scanned and not sched.requests and not sched.block_ids
    mgr = llm.engine.scheduler.kv_cache_manager
    mgr.check_integrity()
    assert mgr.get_num_free_blocks() == llm.engine.kv_cache_config.num_blocks


def test_small_pool_evicts_reuses_slots_and_stays_identical(model_dir, example_on_path):
    """A pool smaller than one step's stores: the oldest blocks are evicted and their slots
    reused, the worker's slots mirror the scheduler's stored hashes, and what is still held
    hits on the next run, token-identical."""
    reference, _ = _run(_llm(model_dir, None))
    llm = _llm(model_dir, _host_prefix(max_blocks=3))
    sched: Any = llm.engine.scheduler.connector
    worker: Any = llm.engine.executor.worker.kv_connector
    for _ in range(3):
        tokens, _ = _run(llm)
        assert tokens == reference
        assert set(worker.slot) == set(sched.stored)
        assert len(worker.slot) + len(worker.free_slots) == 3
        assert sorted([*worker.slot.values(), *worker.free_slots]) == [0, 1, 2]
    # the last prompt's two full blocks were stored last: alone, it hits both
    last = _prompts()[-1]
    (out,) = llm.generate([{"prompt_token_ids": last}], GREEDY, use_tqdm=False)
    assert out.metrics.num_external_cached_tokens == 2 * BLOCK
    assert list(out.outputs[0].token_ids) == reference[-1]
    assert next(iter(worker.pool.values())).shape[0] == 3
    mgr = llm.engine.scheduler.kv_cache_manager
    mgr.check_integrity()
    assert mgr.get_num_free_blocks() == llm.engine.kv_cache_config.num_blocks
