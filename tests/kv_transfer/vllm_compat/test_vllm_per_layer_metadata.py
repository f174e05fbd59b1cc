"""``get_forward_context().attn_metadata`` is vLLM's per-layer dict: a connector written for
vLLM that indexes it by layer name in ``save_kv_layer`` and ``start_load_kv`` (like vLLM's
ExampleConnector) stores a prompt from one engine and loads it into a fresh one, on a plain
and on a hybrid (sliding-window) model, token-identical to a run without a connector, each
layer reading its own KV cache group's metadata; nothing leaked."""

from __future__ import annotations

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.kv_transfer import vllm_imports
from tests.helpers.scheduler import assert_no_leaks

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MODULE = "tests.helpers.vllm_style.layerwise_connector"
# Room for every prompt in one step: the connector stores prompts computed in one step.
ARGS = {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 256}
KV = {
    "kv_connector": "VllmLayerwiseConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": MODULE,
}


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 500, (40,), generator=g).tolist()
    return [shared + torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 29)] + [
        torch.randint(3, 500, (n,), generator=g).tolist() for n in (37, 75)
    ]


def _tokens(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Each prompt's greedy tokens and (local, external) prefix hit."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [
        (o.metrics.num_local_cached_tokens, o.metrics.num_external_cached_tokens) for o in outs
    ]


@pytest.mark.parametrize(
    "arch, kwargs, groups",
    [("llama", {}, 1), ("qwen3", {"layers": 4, "sliding_window": 20}, 2)],
    ids=["plain", "hybrid"],
)
def test_per_layer_metadata_store_then_load(tiny_model_factory, arch, kwargs, groups):
    assert vllm_imports.install()
    from tests.helpers.vllm_style import layerwise_connector as mod

    model_dir = tiny_model_factory(arch, **kwargs)
    prompts = _prompts(3)
    reference, _ = _tokens(LLM(model=str(model_dir), **ARGS), prompts)
    mod.STORE.clear()
    mod.CHECKS.clear()

    producer = LLM(model=str(model_dir), kv_transfer_config=KV, **ARGS)
    assert len(producer.engine.kv_cache_config.groups) == groups
    layer_names = set(producer.engine.kv_cache_config.layer_names)
    tokens, hits = _tokens(producer, prompts)
    assert tokens == reference and all(external == 0 for _, external in hits)
    assert_no_leaks(producer.engine.scheduler)
    producer.engine.shutdown()
    assert {name for _, name in mod.STORE} == layer_names

    consumer = LLM(model=str(model_dir), kv_transfer_config=KV, **ARGS)  # empty prefix cache
    tokens, hits = _tokens(consumer, prompts)
    assert tokens == reference
    # Every prompt's full blocks (never the last token) are hit, locally or from the store.
    assert [sum(h) for h in hits] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert hits[0] == (0, 32) and hits[2] == (0, 32) and hits[3] == (0, 64)
    assert_no_leaks(consumer.engine.scheduler)
    consumer.engine.shutdown()

    saves = [c for c in mod.CHECKS if c["hook"] == "save"]
    loads = [c for c in mod.CHECKS if c["hook"] == "load"]
    assert {c["layer"] for c in saves} == layer_names == {c["layer"] for c in loads}
    # The dict's entry is the object save_kv_layer got, and each layer's is its own group's.
    assert all(c["same_object"] and c["in_slot_mapping"] for c in saves)
    assert all(c["is_metadata"] and c["in_block_table"] for c in loads)
