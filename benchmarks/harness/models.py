"""The random-weight benchmark models (``tiny``, ``mid``, ``qwen3-0.6b``, ``tiny-hybrid``), built on first use
into ``.bench/models/<name>`` (``benchmarks/models.py`` builds them from the command line).

Random weights need no download and still give deterministic greedy outputs, so backends
can be compared token by token. kvferry's generator writes them when it is importable,
else transformers plus a word-level tokenizer covering the whole vocabulary; they are
stored in float32 and each backend casts them at load time.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from benchmarks.harness.paths import MODELS_DIR

SPEC_FILE = "kvferry_bench_spec.json"  # written next to config.json; invalidates the cache


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    seed: int = 0
    arch: str = "llama"  # "llama" | "qwen3" (per-head q/k RMSNorm)
    head_dim: int | None = None  # None: hidden // heads
    rope_theta: float = 10000.0
    # "generator": the generator's own tokenizer (kvferry's is a byte-level BPE trained on a
    # small corpus, a few thousand entries); "words": a word-level tokenizer with one entry
    # per model id, so every id the model can emit decodes and re-encodes to itself.
    tokenizer: str = "generator"
    # qwen2/qwen3: every other layer (from layer 1) attends to this many tokens only (a
    # hybrid model: full and sliding-window KV cache groups).
    sliding_window: int | None = None


# Fields added after models were first cached: left out of the cache stamp while they keep
# their default, so that adding them did not invalidate (and rebuild) the cached models.
_LATER_FIELDS = ("arch", "head_dim", "rope_theta", "tokenizer", "sliding_window")


SPECS: dict[str, ModelSpec] = {
    # ~3.1M params (dominated by the 2 x 2048 x 256 embeddings): overhead-bound.
    "tiny": ModelSpec(
        "tiny", hidden=256, layers=4, heads=4, kv_heads=2, vocab=2048, intermediate=688
    ),
    # 139.7M params: 12 x 8.9M decoder layers + one 32000 x 1024 embedding tied to the
    # lm_head (untied it would be 172M; intermediate 2048 instead of Llama's 2.75x =
    # 2816 keeps the total near 140M). The tied lm_head still costs a full matmul.
    "mid": ModelSpec(
        "mid",
        hidden=1024,
        layers=12,
        heads=16,
        kv_heads=4,
        vocab=32000,
        intermediate=2048,
        tie_word_embeddings=True,
    ),
    # Qwen3-0.6B's shape (596M params, 0.44B outside the 151936 x 1024 embedding, which is
    # tied to the lm_head): a realistic size, whose decode is bound by weight bytes.
    "qwen3-0.6b": ModelSpec(
        "qwen3-0.6b",
        hidden=1024,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        intermediate=3072,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        arch="qwen3",
        rope_theta=1_000_000.0,
        tokenizer="words",
    ),
    # ``tiny``'s size as Qwen3 with layers 1 and 3 sliding over 32 tokens: the hybrid KV
    # cache path (two groups, blocks leaving the window given back) at overhead-bound size.
    "tiny-hybrid": ModelSpec(
        "tiny-hybrid",
        hidden=256,
        layers=4,
        heads=4,
        kv_heads=2,
        vocab=2048,
        intermediate=688,
        arch="qwen3",
        sliding_window=32,
    ),
}


def spec_stamp(spec: ModelSpec, generator: str) -> dict[str, Any]:
    """What a cached model folder records about how it was built (see ``_LATER_FIELDS``)."""
    defaults = {f.name: f.default for f in fields(ModelSpec)}
    stamp = {k: v for k, v in asdict(spec).items() if k not in _LATER_FIELDS or v != defaults[k]}
    return {**stamp, "generator": generator}


def _generator_available() -> bool:
    try:
        from kvferry.model.tiny import make_tiny_model  # noqa: F401
    except ImportError:
        return False
    return True


def write_word_tokenizer(out_dir: Path, vocab: int, specials: list[str], unk: str) -> None:
    """``tokenizer.json``: a word-level tokenizer whose vocabulary is exactly ``vocab`` tokens.

    ids ``0..len(specials)-1`` are ``specials`` (registered as special tokens, so decoding
    can skip them); every other id ``i`` is the word ``t<i>``, so any id sequence decodes to
    words that encode back to the same ids. ``unk`` (one of ``specials``) stands for text
    outside the vocabulary.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    words = {tok: i for i, tok in enumerate(specials)}
    words.update({f"t{i}": i for i in range(len(specials), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out_dir / "tokenizer.json"))


def _write_tokenizer(out_dir: Path, vocab: int) -> None:
    """The transformers fallback's tokenizer files: ids 0/1/2 are <pad>/<s>/</s>. vLLM checks
    prompt token ids against the tokenizer's vocabulary, so it must cover the model's."""
    write_word_tokenizer(out_dir, vocab, ["<pad>", "<s>", "</s>"], unk="<pad>")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": "<pad>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<pad>",
                "model_max_length": 1_000_000,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}, indent=2)
    )


def _make_with_transformers(spec: ModelSpec, out_dir: Path) -> None:
    import torch
    import transformers

    prefix = {"llama": "Llama", "qwen3": "Qwen3"}[spec.arch]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    torch.manual_seed(spec.seed)
    config = config_cls(
        hidden_size=spec.hidden,
        head_dim=spec.head_dim or spec.hidden // spec.heads,
        rope_theta=spec.rope_theta,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.intermediate,
        vocab_size=spec.vocab,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **_sliding_config(spec),
    )
    model = model_cls(config).float().eval()
    model.save_pretrained(out_dir)
    _write_tokenizer(out_dir, spec.vocab)


def _sliding_config(spec: ModelSpec) -> dict[str, Any]:
    """transformers config fields of the layout kvferry's generator writes for a window."""
    if spec.sliding_window is None:
        return {}
    types = ["sliding_attention" if i % 2 else "full_attention" for i in range(spec.layers)]
    return {"use_sliding_window": True, "sliding_window": spec.sliding_window, "layer_types": types}


def _make_with_kvferry(spec: ModelSpec, out_dir: Path) -> None:
    from kvferry.model.tiny import SPECIAL_TOKENS, make_tiny_model

    make_tiny_model(
        out_dir,
        arch=spec.arch,
        hidden=spec.hidden,
        head_dim=spec.head_dim,
        rope_theta=spec.rope_theta,
        layers=spec.layers,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
        vocab=spec.vocab,
        intermediate=spec.intermediate,
        max_position_embeddings=spec.max_position_embeddings,
        dtype="float32",
        seed=spec.seed,
        tie_word_embeddings=spec.tie_word_embeddings,
        sliding_window=spec.sliding_window,
    )
    if spec.tokenizer == "words":
        # Same special tokens at the same ids as the generator's tokenizer, whose
        # tokenizer_config.json (names, chat template) stays valid.
        write_word_tokenizer(out_dir, spec.vocab, SPECIAL_TOKENS, unk=SPECIAL_TOKENS[2])


def build_model(spec: ModelSpec, out_dir: Path, generator: str) -> None:
    """Write ``spec``'s folder into the existing ``out_dir`` with ``generator``
    ("kvferry" or "transformers"); no cache stamp (see :func:`get_model`)."""
    if generator == "kvferry":
        _make_with_kvferry(spec, out_dir)
    elif generator == "transformers":
        _make_with_transformers(spec, out_dir)
    else:
        raise ValueError(f"unknown generator {generator!r}")


def get_model(name: str, force: bool = False, generator: str = "auto") -> Path:
    """Path of model ``name`` (a key of SPECS), creating it on first use.

    ``generator`` is "auto" (kvferry's when importable, else transformers), "kvferry" or
    "transformers". A cached model is rebuilt when its spec or generator changed.
    """
    spec = SPECS[name]
    if generator == "auto":
        generator = "kvferry" if _generator_available() else "transformers"
    out_dir = MODELS_DIR / name
    stamp = spec_stamp(spec, generator)
    stamp_path = out_dir / SPEC_FILE
    if not force and stamp_path.exists():
        try:
            if json.loads(stamp_path.read_text()) == stamp:
                return out_dir
        except json.JSONDecodeError:
            pass
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    build_model(spec, out_dir, generator)
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    return out_dir


def model_vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def bench_model(name: str, min_positions: int = 0) -> Path:
    """Path of benchmark model ``name`` able to take ``min_positions`` positions: the model
    itself, or a copy whose config has a longer ``max_position_embeddings`` and whose
    weights are symlinks (so the ~140M ``mid`` model can take 8k-token prompts)."""
    base = get_model(name)
    cfg = json.loads((base / "config.json").read_text())
    if cfg.get("max_position_embeddings", 0) >= min_positions:
        return base
    out = MODELS_DIR / f"{name}-pos{min_positions}"
    cfg["max_position_embeddings"] = min_positions
    if not (out / "config.json").exists() or json.loads((out / "config.json").read_text()) != cfg:
        out.mkdir(parents=True, exist_ok=True)
        for f in base.iterdir():
            link = out / f.name
            if f.name != "config.json" and not link.exists():
                link.symlink_to(f.resolve())
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
