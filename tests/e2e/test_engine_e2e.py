"""End-to-end engine tests on tiny random-weight models: kvferry vs transformers, and
kvferry against itself under prefix caching, chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch

from kvferry import LLM, SamplingParams

GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model_dir, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def _kvf_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_clean(llm: LLM) -> None:
    sched = llm.engine.scheduler
    mgr = sched.kv_cache_manager
    mgr.check_integrity()
    assert mgr.get_num_free_blocks() == llm.engine.kv_cache_config.num_blocks
    assert not sched.has_unfinished_requests()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    prompts = _prompts(512, [5, 17, 33, 48])
    expected = _hf_greedy(model_dir, prompts, 64)
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=512)
    got = _kvf_tokens(llm, prompts, GREEDY_64)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, (
            f"prompt {i} diverges at token {next(j for j, (a, b) in enumerate(zip(g, e, strict=False)) if a != b)}"
        )
    _assert_clean(llm)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def shared_prefix_prompts() -> list[list[int]]:
    base = _prompts(512, [70], seed=1)[0]
    tails = _prompts(512, [3, 9, 20, 1], seed=2)
    return [base + t for t in tails] + [base[:32], base + tails[1]]


@pytest.fixture(scope="module")
def reference_outputs(llama_dir, shared_prefix_prompts) -> list[list[int]]:
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, enable_prefix_caching=False)
    return _kvf_tokens(llm, shared_prefix_prompts, GREEDY_64)


def test_prefix_caching_is_token_identical(llama_dir, shared_prefix_prompts, reference_outputs):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, log_stats=True)
    first = _kvf_tokens(llm, shared_prefix_prompts[:1], GREEDY_64)
    got = _kvf_tokens(llm, shared_prefix_prompts, GREEDY_64)
    assert first[0] == reference_outputs[0]
    assert got == reference_outputs
    stats = llm.engine.scheduler.kv_cache_manager
    assert stats.prefix_cache_stats.hits > 0
    _assert_clean(llm)


def test_prefix_hit_is_reported_in_metrics(llama_dir, shared_prefix_prompts):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256)
    _kvf_tokens(llm, shared_prefix_prompts[:1], GREEDY_64)
    out = llm.generate({"prompt_token_ids": shared_prefix_prompts[1]}, GREEDY_64, use_tqdm=False)
    assert out[0].metrics is not None
    assert out[0].metrics.num_local_cached_tokens >= 64
    _assert_clean(llm)


def test_chunked_prefill_is_token_identical(llama_dir, shared_prefix_prompts, reference_outputs):
    llm = LLM(
        model=str(llama_dir),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    assert _kvf_tokens(llm, shared_prefix_prompts, GREEDY_64) == reference_outputs
    _assert_clean(llm)


def test_preemption_is_token_identical(llama_dir, shared_prefix_prompts, reference_outputs):
    # 16 blocks of 16 tokens: one request of max_model_len fits, six at ~140 tokens do not.
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=16)
    got = _kvf_tokens(llm, shared_prefix_prompts, GREEDY_64)
    assert got == reference_outputs
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_clean(llm)


def test_seeded_sampling_is_reproducible(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256)
    params = SamplingParams(
        temperature=0.8, top_k=50, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True, logprobs=2
    )
    prompts = _prompts(512, [10, 20], seed=3)
    a = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    b = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
    assert a[1].outputs[0].token_ids == b[0].outputs[0].token_ids
    lp = a[0].outputs[0].logprobs
    assert lp is not None and len(lp) == 24
    assert all(tok in entry for tok, entry in zip(a[0].outputs[0].token_ids, lp, strict=True))
    _assert_clean(llm)


def test_text_prompts_and_stop_strings(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256)
    free = llm.generate(
        "The ferry", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert free.text and free.finish_reason == "length"
    stop = free.text[len(free.text) // 2 :][:3]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    out = llm.generate(
        "The ferry",
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and free.text.startswith(out.text)
    _assert_clean(llm)


def test_abort_frees_everything(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=256)
    eng = llm.engine
    ids = [eng.add_request({"prompt_token_ids": p}, GREEDY_64) for p in _prompts(512, [40, 50])]
    eng.step()
    eng.step()
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    _assert_clean(llm)
