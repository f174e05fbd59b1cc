"""The forward context: per-step state every attention layer reads during one forward pass.

Exactly one context is active at a time; ``set_forward_context`` installs it for the duration
of a ``with`` block and always clears it afterwards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvferry.model.attention_workspace import AttentionWorkspace

if TYPE_CHECKING:
    from kvferry.model.attention_metadata import AttentionMetadata
    from kvferry.model.hidden_states_capture import HiddenStatesCapture


class LayerKVHooks(Protocol):
    """What an attention layer calls on the worker-side KV connector (a ``KVConnectorBase``);
    named here so that the model does not depend on the connector package."""

    def has_connector_metadata(self) -> bool: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None: ...


@dataclass
class ForwardContext:
    # None on a step without tokens (the connector's no-forward path).
    attn_metadata: AttentionMetadata | None
    # layer name -> that layer's paged KV cache, shape (2, num_blocks, block_size, kv_heads, head_dim)
    kv_caches: dict[str, torch.Tensor]
    # The worker-side KV connector, or None. Attention layers call its per-layer hooks only
    # when it has metadata bound for this step.
    kv_connector: LayerKVHooks | None = None
    # Scratch memory and the device's attention kernels; the model runner passes the one it
    # owns, so buffers are reused from step to step.
    attn_workspace: AttentionWorkspace = field(default_factory=AttentionWorkspace)
    extra: dict[str, Any] = field(default_factory=dict)
    # Set before the forward by whoever wants intermediate hidden states (a connector's
    # start_load_kv); the decoder loop records into it.
    hidden_states_capture: HiddenStatesCapture | None = None
    # Hybrid KV cache groups: layer name -> the metadata built from its group's block tables.
    # Layers not listed (every layer, with one group) use ``attn_metadata``.
    layer_attn_metadata: dict[str, AttentionMetadata] = field(default_factory=dict)

    def metadata_for(self, layer_name: str) -> AttentionMetadata | None:
        """The attention metadata layer ``layer_name`` reads this step."""
        return self.layer_attn_metadata.get(layer_name, self.attn_metadata)

    @functools.cached_property
    def no_compile_layers(self) -> dict[str, AttentionLayerKV]:
        """vLLM's name for the model's attention layers: layer name -> its ``kv_cache``."""
        return {name: AttentionLayerKV(name, kv) for name, kv in self.kv_caches.items()}


@dataclass(frozen=True)
class AttentionLayerKV:
    """One attention layer as connectors written for vLLM reach it."""

    layer_name: str
    kv_cache: torch.Tensor


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("kvferry_forward_context", default=None)


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    if _CURRENT.get() is not None:
        raise RuntimeError("a forward context is already active; forwards cannot nest")
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("no forward context is active; run the model inside set_forward_context")
    return ctx


def has_forward_context() -> bool:
    return _CURRENT.get() is not None


def active_hidden_states_capture() -> HiddenStatesCapture | None:
    """The active forward context's hidden-states capture, or None (also outside a forward)."""
    ctx = _CURRENT.get()
    return None if ctx is None else ctx.hidden_states_capture
