"""The benchmark models and rows: the realistic-size spec, its tokenizer covering the whole
vocabulary, cache stamps that keep older models valid, and its throughput rows."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from benchmarks.harness.models import SPECS, build_model, spec_stamp
from benchmarks.harness.throughput.rows import build_rows
from kvferry.config import ArchConfig
from kvferry.tokenizer import Tokenizer


def test_qwen3_06b_spec_has_qwen3_06b_shape() -> None:
    s = SPECS["qwen3-0.6b"]
    shape = (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab)
    assert shape == (1024, 28, 16, 8, 128, 3072, 151936)
    assert s.arch == "qwen3" and s.tie_word_embeddings and s.tokenizer == "words"


def test_stamp_leaves_out_later_fields_at_their_defaults() -> None:
    # tiny / mid were cached before arch, head_dim, rope_theta and tokenizer existed: their
    # stamps must not change, or every cached folder would be rebuilt.
    for name in ("tiny", "mid"):
        stamp = spec_stamp(SPECS[name], "kvferry")
        assert not {"arch", "head_dim", "rope_theta", "tokenizer", "sliding_window"} & set(stamp)
    q = spec_stamp(SPECS["qwen3-0.6b"], "kvferry")
    assert q["arch"] == "qwen3" and q["head_dim"] == 128 and q["tokenizer"] == "words"


def test_small_qwen3_spec_builds_with_a_covering_tokenizer(tmp_path: Path) -> None:
    spec = replace(
        SPECS["qwen3-0.6b"],
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=32,  # != hidden / heads, as in Qwen3-0.6B
        intermediate=96,
        vocab=600,
        max_position_embeddings=512,
    )
    build_model(spec, tmp_path, "kvferry")
    cfg = json.loads((tmp_path / "config.json").read_text())
    arch = ArchConfig.from_dict(cfg, "test")
    assert arch.family == "qwen3" and arch.head_dim == 32 and cfg["rope_theta"] == 1e6
    tok = Tokenizer(tmp_path)
    assert tok.vocab_size == 600
    ids = [5, 599, 123, 0]
    # Every id decodes and re-encodes to itself; the generator's eos ids stay special.
    assert tok.encode(tok.decode(ids, skip_special_tokens=False)) == ids
    assert tok.decode(ids) == "t5 t599 t123"
    assert tok.eos_token_ids == (0, 4)


def test_realistic_rows_are_fixed_length_fp32_and_bf16() -> None:
    for quick in (False, True):
        names = {r.name for r in build_rows(quick) if r.model == "qwen3-0.6b"}
        assert names == {f"qwen3-0.6b-{d}-{p}" for d in ("fp32", "bf16") for p in ("p8", "p64")}
    full = {r.name: r for r in build_rows(False)}
    assert full["qwen3-0.6b-bf16-p64"].num_prompts == 64
    assert full["qwen3-0.6b-bf16-p64"].dtype == "bfloat16"
    assert "mid-fp32-mixed" in full  # the other models keep their mixed rows


def test_hybrid_spec_builds_a_sliding_window_model_and_has_one_row(tmp_path: Path) -> None:
    spec = SPECS["tiny-hybrid"]
    assert spec_stamp(spec, "kvferry")["sliding_window"] == 32
    for generator in ("kvferry", "transformers"):
        out = tmp_path / generator
        out.mkdir()
        build_model(replace(spec, vocab=600, hidden=64, intermediate=96), out, generator)
        arch = ArchConfig.from_dict(json.loads((out / "config.json").read_text()), generator)
        assert arch.sliding_window == 32
        assert [arch.layer_sliding_window(i) for i in range(4)] == [None, 32, None, 32]
    for quick in (False, True):
        assert [r.name for r in build_rows(quick) if r.model == "tiny-hybrid"] == [
            "tiny-hybrid-fp32-p64"
        ]
