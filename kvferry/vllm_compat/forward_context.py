"""``vllm.forward_context``: kvferry's ``ForwardContext`` and ``get_forward_context``.

The context passed to ``start_load_kv`` is the one ``get_forward_context()`` returns during
the forward. As in vLLM, ``attn_metadata`` maps every attention layer's name to the
``AttentionMetadata`` it reads this step (one object per KV cache group), or is None on a step
without tokens; ``slot_mapping`` maps each layer's name to its metadata's slot mapping, and
``no_compile_layers`` each attention layer's name to an object whose ``kv_cache`` is that
layer's paged KV tensor.
"""

from kvferry.model.forward_context import (
    ForwardContext,
    get_forward_context,
    has_forward_context,
)

__all__ = ["ForwardContext", "get_forward_context", "is_forward_context_available"]


def is_forward_context_available() -> bool:
    return has_forward_context()
