"""``vllm.forward_context``: kvferry's ``ForwardContext`` and ``get_forward_context``.

The context passed to ``start_load_kv`` is the one ``get_forward_context()`` returns during
the forward. ``no_compile_layers`` maps each attention layer's name to an object whose
``kv_cache`` is that layer's paged KV tensor; ``attn_metadata`` is the step's one
``AttentionMetadata``, shared by every layer (vLLM keeps a dict per layer), or None on a step
without tokens.
"""

from kvferry.model.forward_context import (
    ForwardContext,
    get_forward_context,
    has_forward_context,
)

__all__ = ["ForwardContext", "get_forward_context", "is_forward_context_available"]


def is_forward_context_available() -> bool:
    return has_forward_context()
