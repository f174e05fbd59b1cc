"""Which checkpoint slices fill each parameter of one tensor-parallel rank.

A parameter is filled from one or more *pieces*: a Hugging Face tensor, the slice of it along
one dimension that this rank owns, and the dim-0 offset in the parameter where it goes. The
checkpoint's full shape is part of the piece so the loader can check it before reading, and
the loader reads only the slice (safetensors ``get_slice``). In a group of one every piece is
a whole tensor, exactly as the unsharded loader reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvferry.config import ArchConfig
from kvferry.model.tp_layers import vocab_shard

# Fused parameter -> the HF parameters stacked along dim 0, in order.
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Row-parallel weights: split along the input dimension (their biases are replicated).
_ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Piece:
    src: str  # HF tensor name
    full_shape: tuple[int, ...]  # its shape in the checkpoint
    dim: int  # the dimension sliced
    start: int
    stop: int
    dst_offset: int  # dim-0 offset in the parameter

    def read(self, tensor_slice: Any) -> torch.Tensor:
        """This piece's part of a safetensors slice (``safe_open(...).get_slice(src)``), read
        from the file without the rest of the tensor."""
        if self.dim == 0:
            return tensor_slice[self.start : self.stop]  # type: ignore[no-any-return]
        return tensor_slice[:, self.start : self.stop]  # type: ignore[no-any-return]


def plan_pieces(
    name: str, shape: tuple[int, ...], cfg: ArchConfig, rank: int, world_size: int
) -> list[Piece]:
    """The pieces of parameter ``name`` whose per-rank ``shape`` is given."""
    for fused, parts in FUSED.items():
        if f".{fused}." not in name:
            continue
        if fused == "qkv_proj":
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            sizes = [q, kv, kv]
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        pieces, offset = [], 0
        for part, full in zip(parts, sizes, strict=True):
            rows = full // world_size
            pieces.append(
                Piece(
                    name.replace(fused, part),
                    (full, *shape[1:]),
                    0,
                    rank * rows,
                    (rank + 1) * rows,
                    offset,
                )
            )
            offset += rows
        return pieces
    if name.endswith(_ROW_PARALLEL):
        cols = shape[1]
        return [Piece(name, (shape[0], cols * world_size), 1, rank * cols, (rank + 1) * cols, 0)]
    if name in _VOCAB_PARALLEL:
        start, stop, _ = vocab_shard(cfg.vocab_size, world_size, rank)
        return [Piece(name, (cfg.vocab_size, *shape[1:]), 0, start, stop, 0)]
    return [Piece(name, shape, 0, 0, shape[0] if shape else 0, 0)]
