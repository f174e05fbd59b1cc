"""Tiny checkpoints: reproducible, loadable offline by transformers and kvferry, usable."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from kvferry.config import ModelConfig
from kvferry.data import corpus_text
from kvferry.model.attention_metadata import build_attention_metadata
from kvferry.model.forward_context import ForwardContext, layer_metadata, set_forward_context
from kvferry.model.loader import load_model
from kvferry.model.tiny import BOS_ID, EOS_ID, IM_END_ID, PAD_ID, make_tiny_model


def test_corpus_is_substantial_plain_text() -> None:
    text = corpus_text()
    assert 50_000 <= len(text.encode()) <= 100_000
    assert len(text.split("\n\n")) >= 100  # paragraphs
    assert "\r" not in text and "\t" not in text


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = make_tiny_model(
        tmp_path / "a", arch="qwen2", hidden=64, layers=1, heads=2, kv_heads=1, vocab=512
    )
    b = make_tiny_model(
        tmp_path / "b", arch="qwen2", hidden=64, layers=1, heads=2, kv_heads=1, vocab=512
    )
    c = make_tiny_model(
        tmp_path / "c", arch="qwen2", hidden=64, layers=1, heads=2, kv_heads=1, vocab=512, seed=1
    )
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_fields(arch: str, tiny_model_factory: Callable[..., Path]) -> None:
    folder = tiny_model_factory(arch)
    mc = ModelConfig(str(folder))
    assert mc.arch.family == arch
    assert mc.arch.eos_token_ids == (EOS_ID, IM_END_ID) and mc.arch.bos_token_id == BOS_ID
    assert mc.torch_dtype == torch.float32
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [EOS_ID, IM_END_ID] and gen["pad_token_id"] == PAD_ID


def test_tokenizer_loads_offline_in_transformers(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tiny_model_factory("llama")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "The ferry across the estuary runs every half hour. Ünïcode too!"
    assert hf(text).input_ids == raw.encode(text).ids
    assert hf.decode(raw.encode(text).ids) == text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert raw.get_vocab_size() == 2048
    chat = hf.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = raw.encode(chat).ids
    assert ids[0] == 3 and IM_END_ID in ids


def greedy(folder: Path, ids: list[int], steps: int) -> list[int]:
    model = load_model(ModelConfig(str(folder), dtype="float32"), torch.device("cpu"))
    cfg = model.config
    caches = {
        n: torch.zeros(2, 8, 16, cfg.num_key_value_heads, cfg.head_dim) for n in model.layer_names
    }
    table = list(range(8))
    tokens, out = list(ids), []
    new = list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            seq = len(tokens)
            meta = build_attention_metadata([len(new)], [seq], [table], 16, torch.device("cpu"))
            with set_forward_context(ForwardContext(layer_metadata(meta, caches), caches)):
                hidden = model(torch.tensor(new), torch.arange(seq - len(new), seq))
            nxt = int(model.compute_logits(hidden[-1:]).argmax())
            tokens.append(nxt)
            out.append(nxt)
            new = [nxt]
    return out


@pytest.mark.parametrize(
    "arch,tie", [("llama", False), ("qwen3", True)], ids=["llama", "qwen3-tied"]
)
def test_greedy_decoding_is_not_degenerate(
    arch: str, tie: bool, tiny_model_factory: Callable[..., Path]
) -> None:
    folder = tiny_model_factory(arch, tie_word_embeddings=tie)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    out = greedy(folder, raw.encode("The lighthouse keeper wrote in her ledger").ids, 48)
    assert len(set(out)) >= 24
    assert max(len(list(g)) for _, g in itertools.groupby(out)) <= 4
