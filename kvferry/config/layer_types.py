"""Which attention each decoder layer uses: full causal attention, or a sliding window.

Read from a Hugging Face ``config.json`` exactly as ``transformers``' Qwen2/Qwen3 configs
derive it:

* ``sliding_window`` counts only when ``use_sliding_window`` is true (otherwise it is None);
* an explicit ``layer_types`` list ("full_attention" / "sliding_attention", one per layer)
  wins; without one, layers ``max_window_layers`` and up slide when a window is set;
* a sliding layer's query at position ``p`` sees the keys at positions ``p - window + 1 ..
  p``: ``window`` keys, its own included (transformers' ``kv_idx > q_idx - window``).

Llama has no sliding layers. A config whose ``layer_types`` asks for sliding layers without
a window is refused: transformers fails on it at its first forward.
"""

from __future__ import annotations

from typing import Any

from kvferry.config.errors import ConfigError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
ATTENTION_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
# Names older checkpoints use for the same thing (as transformers remaps them).
_LEGACY = {"attention": FULL_ATTENTION}


def parse_layer_types(
    raw: dict[str, Any], family: str, num_layers: int, source: str
) -> tuple[tuple[str, ...], int | None]:
    """``(layer_types, sliding_window)``: one attention type per layer, and the window (None
    when no layer slides). Raises :class:`ConfigError` for a config transformers refuses."""
    if family == "llama":
        return (FULL_ATTENTION,) * num_layers, None
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if window is not None:
        if isinstance(window, float) and window.is_integer():
            window = int(window)
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ConfigError(
                f"{source}: sliding_window must be a positive integer, got {window!r}"
            )
    listed = raw.get("layer_types")
    if listed is None:
        first = raw.get("max_window_layers", 28)  # transformers' default for Qwen2/Qwen3
        if isinstance(first, bool) or not isinstance(first, int):
            raise ConfigError(f"{source}: max_window_layers must be an integer, got {first!r}")
        types = tuple(
            SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION
            for i in range(num_layers)
        )
    else:
        if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
            raise ConfigError(f"{source}: layer_types must be a list of strings")
        types = tuple(str(_LEGACY.get(t, t)) for t in listed)
        bad = sorted({t for t in types if t not in ATTENTION_TYPES})
        if bad:
            raise ConfigError(
                f"{source}: unsupported layer_types {bad}; kvferry runs {list(ATTENTION_TYPES)}"
            )
        if len(types) != num_layers:
            raise ConfigError(
                f"{source}: layer_types has {len(types)} entries but num_hidden_layers is "
                f"{num_layers}"
            )
    if SLIDING_ATTENTION not in types:
        return types, None
    if window is None:
        raise ConfigError(
            f"{source}: layer_types has sliding_attention layers but no sliding window "
            f"(set use_sliding_window: true and sliding_window)"
        )
    return types, window
