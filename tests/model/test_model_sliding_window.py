"""Sliding-window layers (Qwen2/Qwen3 ``layer_types``) against Hugging Face transformers:
config parsing, prefill logits, chunked prefill and decode over hybrid block tables (the
sliding layers' tables with their out-of-window blocks replaced), greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry.config import ArchConfig, ConfigError
from kvferry.model.attention_metadata import build_attention_metadata
from kvferry.model.forward_context import ForwardContext, layer_metadata, set_forward_context
from kvferry.model.llama import CausalLM
from tests.model.test_model_vs_hf import PagedRunner, hf_logits, load, prompt

transformers = pytest.importorskip("transformers")

BLOCK = 16
WINDOW = 20  # more than a block, not a multiple of one


def _raw(**extra: Any) -> dict[str, Any]:
    raw = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 300}  # fmt: skip
    raw.update(extra)
    return raw


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 2},
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
        {"use_sliding_window": True, "sliding_window": 8},  # default max_window_layers 28
        {"use_sliding_window": True, "sliding_window": 5,
         "layer_types": ["sliding_attention", "full_attention"] * 3},
        {"use_sliding_window": False, "sliding_window": 5, "layer_types": ["full_attention"] * 6},
    ],
)  # fmt: skip
@pytest.mark.parametrize("family", ["Qwen2", "Qwen3"])
def test_layer_types_derived_as_transformers_does(family: str, extra: dict[str, Any]) -> None:
    raw = _raw(**extra, architectures=[f"{family}ForCausalLM"])
    arch = ArchConfig.from_dict(raw)
    hf_cls = getattr(transformers, f"{family}Config")
    fields = {k: v for k, v in raw.items() if k != "architectures"}
    hf = hf_cls(**fields)
    assert list(arch.layer_types) == hf.layer_types
    sliding = "sliding_attention" in hf.layer_types
    assert arch.sliding_window == (hf.sliding_window if sliding else None)
    for i in range(6):
        expect = hf.sliding_window if hf.layer_types[i] == "sliding_attention" else None
        assert arch.layer_sliding_window(i) == expect


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"use_sliding_window": False, "layer_types": ["sliding_attention"] * 6},
         "no sliding window"),
        ({"use_sliding_window": True, "sliding_window": 4, "layer_types": ["full_attention"]},
         "6"),
        ({"use_sliding_window": True, "sliding_window": 4,
          "layer_types": ["chunked_attention"] * 6}, "chunked_attention"),
        ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window"),
        ({"use_sliding_window": True, "sliding_window": 4, "layer_types": "full"}, "list"),
    ],
)  # fmt: skip
def test_bad_layer_types_are_config_errors(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ArchConfig.from_dict(_raw(**extra))


def test_llama_has_no_sliding_layers() -> None:
    raw = _raw(architectures=["LlamaForCausalLM"], use_sliding_window=True, sliding_window=4)
    arch = ArchConfig.from_dict(raw)
    assert arch.sliding_window is None and set(arch.layer_types) == {"full_attention"}


CASES = {
    "qwen3": {"arch": "qwen3", "sliding_window": WINDOW},
    "qwen2-top-layers": {"arch": "qwen2", "sliding_window": WINDOW, "max_window_layers": 2},
}


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Callable[[str], Path]:
    return lambda case: tiny_model_factory(**CASES[case])


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "torch-ops"])
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_longer_than_window_matches_hf(
    case: str, native: bool, model_dir: Callable[[str], Path]
) -> None:
    folder = model_dir(case)
    ids = prompt(70, seed=2)
    runner = PagedRunner(load(folder, native=native), native=native)
    runner.add("a", ids)
    got = runner.step([("a", len(ids))])["a"]
    ref = hf_logits(folder, ids, torch.float32)
    assert (got - ref).abs().max().item() <= 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_the_window_changes_the_logits(model_dir: Callable[[str], Path]) -> None:
    """Guards the parity tests: past the window, the same weights without it differ."""
    folder = model_dir("qwen3")
    ids = prompt(70, seed=2)
    model = load(folder)
    for layer in model.model.layers:
        layer.self_attn.attn.sliding_window = None
    runner = PagedRunner(model)
    runner.add("a", ids)
    got = runner.step([("a", len(ids))])["a"]
    ref = hf_logits(folder, ids, torch.float32)
    assert (got[:WINDOW] - ref[:WINDOW]).abs().max().item() <= 1e-3
    assert (got[WINDOW:] - ref[WINDOW:]).abs().max().item() > 1e-2


class HybridRunner:
    """One request over two block tables, as hybrid KV cache groups give it: the full layers'
    table, and the sliding layers' table in which every block wholly outside the window of
    the tokens still to be computed is replaced by a null block full of garbage (so reading
    one changes the logits)."""

    def __init__(self, model: CausalLM, native: bool, num_blocks: int = 40) -> None:
        self.inner = PagedRunner(model, num_blocks=num_blocks, native=native)
        self.model = model
        self.window = model.config.sliding_window
        self.null = self.inner.free.pop()
        self.sliding = [
            name
            for i, name in enumerate(model.layer_names)
            if model.config.layer_sliding_window(i) is not None
        ]
        gen = torch.Generator().manual_seed(0)
        for name in self.sliding:
            cache = self.inner.kv_caches[name]
            cache[:, self.null] = 1e3 * torch.randn(cache[:, self.null].shape, generator=gen)
        self.blocks: list[int] = []
        self.computed = 0

    def step(self, ids: list[int], n: int) -> torch.Tensor:
        inner, start, end = self.inner, self.computed, self.computed + n
        while len(self.blocks) * BLOCK < end:
            self.blocks.append(inner.free.pop())
        first_key = max(0, start - self.window + 1)
        sliding_table = [
            self.null if i < first_key // BLOCK else b for i, b in enumerate(self.blocks)
        ]
        full = build_attention_metadata([n], [end], [self.blocks], BLOCK, inner.device)
        slide = build_attention_metadata([n], [end], [sliding_table], BLOCK, inner.device)
        per_layer = layer_metadata(full, inner.kv_caches, [(self.sliding, slide)])
        ctx = ForwardContext(per_layer, inner.kv_caches, attn_workspace=inner.workspace)
        with torch.inference_mode(), set_forward_context(ctx):
            hidden = self.model(torch.tensor(ids[start:end]), torch.arange(start, end))
            logits = self.model.compute_logits(hidden)
        self.computed = end
        return logits


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "torch-ops"])
def test_chunked_prefill_and_decode_over_hybrid_tables_match_hf(
    native: bool, model_dir: Callable[[str], Path]
) -> None:
    folder = model_dir("qwen3")
    ids = prompt(90, seed=3)
    ref = hf_logits(folder, ids, torch.float32)
    runner = HybridRunner(load(folder, native=native), native)
    # Chunks shorter and longer than the window, across block edges, then decodes.
    chunks = [7, 30, 9, 21, 18, 1, 1, 1, 1, 1]
    assert sum(chunks) == len(ids)
    got = torch.cat([runner.step(ids, n) for n in chunks])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "torch-ops"])
def test_greedy_tokens_match_hf_generate(native: bool, model_dir: Callable[[str], Path]) -> None:
    folder = model_dir("qwen2-top-layers")
    ids = prompt(30, seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    expected = out[0, len(ids) :].tolist()
    runner = HybridRunner(load(folder, native=native), native)
    seq = list(ids)
    logits = runner.step(seq, len(seq))
    got = []
    for _ in range(24):
        token = int(logits[-1].argmax())
        got.append(token)
        seq.append(token)
        logits = runner.step(seq, 1)
    assert got == expected
