"""ArchConfig: the model architecture read from a Hugging Face ``config.json``, and the
architectures kvferry runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.config.errors import ConfigError
from kvferry.config.layer_types import SLIDING_ATTENTION, parse_layer_types

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ArchConfig:
    """The parts of a Hugging Face ``config.json`` the engine needs, typed and checked."""

    family: str  # "llama" | "qwen2" | "qwen3"
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # One attention type per layer (see kvferry.config.layer_types) and the sliding window,
    # None when no layer slides.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer ``layer_idx``, or None for a full-attention layer."""
        if self.layer_types and self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @staticmethod
    def from_dict(raw: dict[str, Any], source: str = "config.json") -> ArchConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"kvferry supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]

        def req(key: str) -> Any:
            if key not in raw:
                raise ConfigError(f"{source}: missing required field {key!r}")
            return raw[key]

        def size(key: str, default: int | None = None) -> int:
            value = req(key) if default is None else (raw.get(key) or default)
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
            return value

        hidden = size("hidden_size")
        heads = size("num_attention_heads")
        kv_heads = size("num_key_value_heads", heads)
        if not raw.get("head_dim") and hidden < heads:
            raise ConfigError(
                f"{source}: hidden_size ({hidden}) is smaller than num_attention_heads ({heads})"
            )
        head_dim = size("head_dim", hidden // heads)
        if heads % kv_heads != 0:
            raise ConfigError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        if head_dim % 2:
            derived = "" if raw.get("head_dim") else f" (hidden_size {hidden} // {heads} heads)"
            raise ConfigError(
                f"{source}: head_dim {head_dim}{derived} is odd, but rotary position "
                f"embeddings need an even head_dim"
            )
        rope_theta = raw.get("rope_theta")
        rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
        if isinstance(rope_scaling, dict):
            rope_theta = rope_theta or rope_scaling.get("rope_theta")
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype not in ("default", "linear", "llama3"):
                raise ConfigError(f"{source}: unsupported rope_scaling type {rtype!r}")
            if rtype == "default":
                rope_scaling = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        default_bias = family == "qwen2"
        num_layers = size("num_hidden_layers")
        layer_types, window = parse_layer_types(raw, family, num_layers, source)
        return ArchConfig(
            family=family,
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=size("vocab_size"),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling if isinstance(rope_scaling, dict) else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", default_bias)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            layer_types=layer_types,
            sliding_window=window,
        )
