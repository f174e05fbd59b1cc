"""Tiny random-weight checkpoints in Hugging Face format, for tests and benchmarks offline.

A folder written by :func:`make_tiny_model` loads with ``transformers``
(``AutoModelForCausalLM`` / ``AutoTokenizer``, no network) and with kvferry, and is byte-for-byte
reproducible for a given set of arguments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvferry.config import ArchConfig, ConfigError
from kvferry.data import corpus_text

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# Fixed ids 0..4, in this order.
SPECIAL_TOKENS = ["<|endoftext|>", "<|begin_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
EOS_ID, BOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Weight scales, chosen by measuring greedy decodes of random models. With every sub-layer at
# std 0.02 attention is nearly uniform, the residual stream drifts with the running average of
# the context and greedy decoding repeats one token for dozens of steps (and a tied model, whose
# stream is dominated by the input embedding, predicts its own input forever). A small
# embedding, a large MLP output and sharper attention make each step's output a fresh function
# of the current token and its context: greedy decodes then rarely repeat a token twice.
# Matrices use std = gain / sqrt(fan_in), so activations keep these scales at any width (the
# gains give the measured stds at hidden=256, intermediate=1024).
_EMBED_STD = 0.02
_BIAS_STD = 0.02
_GAIN_QK = 1.6
_GAIN = 0.32  # v, gate, up, lm_head
_GAIN_O = 0.64
_GAIN_DOWN = 6.4


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 2048,
    intermediate: int | None = None,
    max_position_embeddings: int = 4096,
    head_dim: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    sliding_window: int | None = None,
    max_window_layers: int | None = None,
    layer_types: list[str] | None = None,
) -> Path:
    """Write a random ``arch`` ("llama" | "qwen2" | "qwen3") checkpoint into ``out_dir``.

    Files: ``config.json``, ``generation_config.json``, ``model.safetensors`` (weights drawn
    from a ``torch.Generator`` seeded with ``seed``, saved in ``dtype``; norm weights 1),
    ``tokenizer.json`` (byte-level BPE with ``vocab`` entries trained on the bundled corpus),
    ``tokenizer_config.json`` (with a ChatML ``chat_template``) and ``special_tokens_map.json``.
    Special tokens have ids 0..4: ``<|endoftext|>`` (eos), ``<|begin_of_text|>`` (bos),
    ``<|pad|>``, ``<|im_start|>``, ``<|im_end|>`` (a second eos, ending chat turns). The
    tokenizer adds no special tokens on its own. Returns ``out_dir`` as a ``Path``.

    ``sliding_window`` (qwen2/qwen3 only) turns on ``use_sliding_window``: the layers named
    "sliding_attention" in ``layer_types``, or without it layers ``max_window_layers`` and up
    (default: every other layer from layer 1 slides), attend to the last ``sliding_window``
    tokens only.

    Raises :class:`~kvferry.config.ConfigError` (a ``ValueError``), before writing anything,
    for a shape the engine cannot load: a non-positive size, ``heads`` not a multiple of
    ``kv_heads``, ``hidden`` not a multiple of ``heads`` without an explicit ``head_dim``, or
    an odd head dimension.
    """
    if arch not in ARCHITECTURES:
        raise ConfigError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    sizes = {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
             "vocab": vocab, "intermediate": intermediate, "head_dim": head_dim,
             "max_position_embeddings": max_position_embeddings}  # fmt: skip
    for name, value in sizes.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if heads % kv_heads:
        raise ConfigError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim is None and hidden % heads:
        raise ConfigError(
            f"hidden ({hidden}) must be a multiple of heads ({heads}), or give head_dim"
        )
    head_dim = head_dim or hidden // heads
    if head_dim % 2:
        raise ConfigError(
            f"head_dim ({head_dim}) must be even: rotary position embeddings rotate pairs"
        )
    if vocab < 256 + len(SPECIAL_TOKENS):
        raise ConfigError(f"vocab must be at least {256 + len(SPECIAL_TOKENS)} for byte-level BPE")
    intermediate = intermediate or 4 * hidden

    config = _hf_config(
        arch, hidden, layers, heads, kv_heads, vocab, intermediate, max_position_embeddings,
        head_dim, dtype, tie_word_embeddings, rope_theta, rope_scaling,
    )  # fmt: skip
    if sliding_window is not None or layer_types is not None:
        _set_sliding_window(config, arch, layers, sliding_window, max_window_layers, layer_types)
    # Whatever the engine would refuse to load is refused here, before anything is written.
    ArchConfig.from_dict(config, "the requested model")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": PAD_ID},
    )
    tensors = _random_weights(config, seed)
    save_file({k: v.to(_DTYPES[dtype]).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    _write_tokenizer(out, vocab, max_position_embeddings)
    return out


def _hf_config(
    arch: str,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    intermediate: int,
    max_pos: int,
    head_dim: int,
    dtype: str,
    tie: bool,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
) -> dict[str, Any]:
    architecture, model_type = ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, IM_END_ID],
        "pad_token_id": PAD_ID,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
        if arch == "qwen3":
            config["attention_bias"] = False
    return config


def _set_sliding_window(
    config: dict[str, Any],
    arch: str,
    layers: int,
    window: int | None,
    max_window_layers: int | None,
    layer_types: list[str] | None,
) -> None:
    if arch == "llama":
        raise ConfigError("sliding_window and layer_types need arch qwen2 or qwen3")
    config.update(use_sliding_window=window is not None, sliding_window=window)
    if max_window_layers is not None:
        config["max_window_layers"] = max_window_layers
    elif layer_types is None and window is not None:
        # Interleaved by default, the layout that needs hybrid KV cache groups.
        layer_types = ["sliding_attention" if i % 2 else "full_attention" for i in range(layers)]
    if layer_types is not None:
        config["layer_types"] = list(layer_types)


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """HF-named fp32 tensors, drawn in a fixed order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    hd, heads, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    model_type = config["model_type"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def matrix(rows: int, cols: int, gain: float) -> torch.Tensor:
        return normal(rows, cols, std=gain / cols**0.5)

    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=_EMBED_STD),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(hidden)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        for name, rows, gain in (
            ("q_proj", heads * hd, _GAIN_QK),
            ("k_proj", kv * hd, _GAIN_QK),
            ("v_proj", kv * hd, _GAIN),
        ):
            t[p + f"self_attn.{name}.weight"] = matrix(rows, hidden, gain)
            if model_type == "qwen2":
                t[p + f"self_attn.{name}.bias"] = normal(rows, std=_BIAS_STD)
        t[p + "self_attn.o_proj.weight"] = matrix(hidden, heads * hd, _GAIN_O)
        if model_type == "qwen3":
            t[p + "self_attn.q_norm.weight"] = torch.ones(hd)
            t[p + "self_attn.k_norm.weight"] = torch.ones(hd)
        t[p + "mlp.gate_proj.weight"] = matrix(inter, hidden, _GAIN)
        t[p + "mlp.up_proj.weight"] = matrix(inter, hidden, _GAIN)
        t[p + "mlp.down_proj.weight"] = matrix(hidden, inter, _GAIN_DOWN)
    t["model.norm.weight"] = torch.ones(hidden)
    if not config["tie_word_embeddings"]:
        t["lm_head.weight"] = matrix(config["vocab_size"], hidden, _GAIN)
    return t


def _write_tokenizer(out: Path, vocab: int, max_len: int) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().split("\n\n"), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    names = {"bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
             "pad_token": SPECIAL_TOKENS[PAD_ID]}  # fmt: skip
    _write_json(out / "special_tokens_map.json", names)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **names,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
