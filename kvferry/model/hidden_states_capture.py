"""HiddenStatesCapture: the residual stream entering chosen decoder layers, for one forward.

Whoever wants a model's intermediate hidden states (e.g. the ExampleHiddenStatesConnector,
which writes them to files as training data for speculative-decoding drafters) puts a
capture on the step's :class:`~kvferry.model.forward_context.ForwardContext` before the
forward; the model's decoder loop records into it and the owner reads it after the forward.

Layer ids index the residual stream as vLLM's ``eagle_aux_hidden_state_layer_ids`` do: id
``i`` is what enters decoder layer ``i`` (the sum of the previous layer's output and its
residual; id 0 is the token embeddings), which is ``output_hidden_states[i]`` of a
``transformers`` model; id ``num_hidden_layers`` is the last layer's output before the final
norm (``transformers`` reports that one after the norm).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class HiddenStatesCapture:
    """Collects ``[num_tokens, hidden_size]`` tensors, one per wanted layer id, in the flat
    token order of the step's batch. The model calls :meth:`record` at every layer boundary;
    ids not wanted cost one set lookup."""

    def __init__(self, layer_ids: Iterable[int]) -> None:
        self.layer_ids = frozenset(layer_ids)
        self.states: dict[int, torch.Tensor] = {}

    def wants(self, layer_id: int) -> bool:
        return layer_id in self.layer_ids

    def record(self, layer_id: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """``x`` and ``residual`` as the decoder loop carries them (their sum is the stream;
        ``residual`` is None before the first layer)."""
        if layer_id in self.layer_ids:
            # A copy either way: the decoder's fused norms update their inputs in place.
            self.states[layer_id] = x.clone() if residual is None else x + residual

    def missing(self) -> list[int]:
        """Wanted ids the forward did not record (a model without the hook records none)."""
        return sorted(self.layer_ids - self.states.keys())
