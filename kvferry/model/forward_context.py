"""The forward context: per-step state every attention layer reads during one forward pass.

Exactly one context is active at a time; ``set_forward_context`` installs it for the duration
of a ``with`` block and always clears it afterwards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
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
    # vLLM's shape: attention layer name -> the metadata that layer reads this step, one object
    # per KV cache group shared by the group's layers (see ``layer_metadata``); None on a step
    # without tokens (the connector's no-forward path).
    attn_metadata: dict[str, AttentionMetadata] | None
    # layer name -> that layer's paged KV cache, shape (2, num_blocks, block_size, kv_heads, head_dim)
    # with the strides of the pool's layout (kvferry.kv_layout)
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

    def metadata_for(self, layer_name: str) -> AttentionMetadata | None:
        """The attention metadata layer ``layer_name`` reads this step; None on a step without
        tokens. Raises ``KeyError`` naming the layer when the step has none for it."""
        if self.attn_metadata is None:
            return None
        meta = self.attn_metadata.get(layer_name)
        if meta is None:
            raise KeyError(f"the forward context has no attention metadata for {layer_name!r}")
        return meta

    @functools.cached_property
    def no_compile_layers(self) -> dict[str, AttentionLayerKV]:
        """vLLM's name for the model's attention layers: layer name -> its ``kv_cache``."""
        return {name: AttentionLayerKV(name, kv) for name, kv in self.kv_caches.items()}

    @functools.cached_property
    def slot_mapping(self) -> dict[str, torch.Tensor]:
        """vLLM's per-layer slot mappings: layer name -> where its new tokens' K/V go."""
        if self.attn_metadata is None:
            return {}
        return {name: meta.slot_mapping for name, meta in self.attn_metadata.items()}


def layer_metadata(
    default: AttentionMetadata,
    layer_names: Iterable[str],
    groups: Iterable[tuple[Iterable[str], AttentionMetadata]] = (),
) -> dict[str, AttentionMetadata]:
    """``ForwardContext.attn_metadata`` for one step: every layer of ``layer_names`` reads
    ``default`` unless one of ``groups`` (its layers, their KV cache group's metadata) lists
    it. References only: a few microseconds per step for a deep model."""
    per_layer = dict.fromkeys(layer_names, default)
    for names, meta in groups:
        per_layer.update(dict.fromkeys(names, meta))
    return per_layer


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
