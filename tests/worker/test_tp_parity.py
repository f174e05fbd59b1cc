"""Tensor parallelism (TP=2, two worker processes over gloo) against one worker (TP=1) on the
same tiny checkpoints: prefill logits, greedy and seeded decoding, batches, chunked prefill."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.model.attention_metadata import build_attention_metadata
from kvferry.model.forward_context import ForwardContext, layer_metadata, set_forward_context
from kvferry.model.long_tensor import long_tensor

# Each case exercises another sharding path: an odd vocabulary (the last vocab shard padded),
# tied embeddings (the logits read the embedding's shard), Qwen2's q/k/v biases, Qwen3's
# q/k norms with a head_dim that is not hidden / heads.
CASES: dict[str, dict[str, Any]] = {
    "llama-odd-vocab": {"arch": "llama", "vocab": 2051},
    "qwen2-tied": {"arch": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"arch": "qwen3", "head_dim": 48, "heads": 4, "kv_heads": 2},
    # Hybrid KV cache groups (every other layer slides over 24 tokens): each rank keeps both
    # groups' blocks for its heads; prompts below run past the window.
    "qwen3-sliding": {"arch": "qwen3", "layers": 4, "kv_heads": 2, "sliding_window": 24},
}
KW = {"dtype": "float32", "max_model_len": 256}


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _prefill_logits(worker: Any, ids: list[int]) -> torch.Tensor:
    """Run on a worker (in its process): logits of every position of one prefill of ``ids``,
    computed in a scratch KV pool so the engine's own pool (and its prefix cache) is untouched."""
    runner = worker.model_runner
    bs = runner.block_size
    n_blocks = -(-len(ids) // bs)
    pool = {
        name: torch.zeros((2, n_blocks, *t.shape[2:]), dtype=t.dtype)
        for name, t in runner.kv_caches.items()
    }
    meta = build_attention_metadata(
        query_lens=[len(ids)],
        seq_lens=[len(ids)],
        block_tables=[list(range(n_blocks))],
        block_size=bs,
        device=worker.device,
        group_decodes=runner.attn_workspace.decode_kernel is None,
    )
    ctx = ForwardContext(
        layer_metadata(meta, pool), pool, None, attn_workspace=runner.attn_workspace
    )
    with torch.inference_mode(), set_forward_context(ctx):
        hidden = runner.model(
            long_tensor(ids, worker.device), long_tensor(range(len(ids)), worker.device)
        )
        return runner.model.compute_logits(hidden).cpu()


def _tokens(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _assert_clean(llm: LLM) -> None:
    sched = llm.engine.scheduler
    sched.kv_cache_manager.check_integrity()
    manager = sched.kv_cache_manager
    assert manager.get_num_free_blocks() == manager.num_usable_blocks
    assert not sched.has_unfinished_requests()


@pytest.fixture(scope="module", params=list(CASES))
def engines(
    request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]
) -> Iterator[tuple[LLM, LLM]]:
    model = str(tiny_model_factory(**CASES[request.param]))
    tp1 = LLM(model=model, **KW)
    try:
        # A 32-token budget chunks every longer prompt's prefill over several steps.
        tp2 = LLM(model=model, tensor_parallel_size=2, max_num_batched_tokens=32, **KW)
    except BaseException:
        tp1.shutdown()
        raise
    try:
        yield tp1, tp2
    finally:
        tp2.shutdown()
        tp1.shutdown()


def test_tp2_prefill_logits_match_tp1(engines: tuple[LLM, LLM]) -> None:
    tp1, tp2 = engines
    ids = _prompts([40])[0]
    (ref,) = tp1.engine.executor.collective_rpc(_prefill_logits, (ids,))
    ranks = tp2.engine.executor.collective_rpc(_prefill_logits, (ids,))
    assert len(ranks) == 2
    assert torch.equal(ranks[0], ranks[1]), "the ranks' gathered logits differ"
    assert ranks[0].shape == ref.shape
    torch.testing.assert_close(ranks[0], ref, atol=1e-4, rtol=0)


def test_tp2_greedy_batch_with_chunked_prefill_matches_tp1(engines: tuple[LLM, LLM]) -> None:
    tp1, tp2 = engines
    kv = tp2.engine.kv_cache_config
    assert kv.groups[0].num_kv_heads == tp1.engine.kv_cache_config.groups[0].num_kv_heads // 2
    # Lengths 48 and 100 exceed the 32-token budget: their prefill is chunked.
    prompts = _prompts([5, 17, 33, 48, 100])
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = _tokens(tp1, prompts, sp)
    got = _tokens(tp2, prompts, sp)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert len(g) == 32
        assert g == e, f"prompt {i}: TP=2 {g} != TP=1 {e}"
    # Again one at a time, now hitting the prefix cache the batch left behind.
    assert _tokens(tp2, prompts[3:4], sp) == expected[3:4]
    _assert_clean(tp2)


def test_tp2_seeded_sampling_matches_tp1(engines: tuple[LLM, LLM]) -> None:
    tp1, tp2 = engines
    prompts = _prompts([12, 30], seed=3)
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True)
    assert _tokens(tp2, prompts, sp) == _tokens(tp1, prompts, sp)
    _assert_clean(tp2)
