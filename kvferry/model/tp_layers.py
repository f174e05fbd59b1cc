"""Layers sharded over the tensor-parallel group (Megatron-style), and the shard arithmetic the
loader uses to read each rank's slice of a checkpoint.

* Column-parallel (``qkv_proj``, ``gate_up_proj``): a plain :class:`Linear` holding this rank's
  output rows; each fused part (q, k, v / gate, up) is split on its own, so the rank's rows are
  its q heads, then its k heads, then its v heads.
* Row-parallel (``o_proj``, ``down_proj``): :class:`RowParallelLinear` holds this rank's input
  columns; the partial products are summed over the ranks, and the bias (replicated) is added
  once, after the sum.
* Vocab-parallel (``embed_tokens``, ``lm_head``): each rank holds ``ceil(vocab / N)`` rows (the
  last rank's tail zero-padded); lookups outside a rank's rows read zeros and the sum over the
  ranks gives every token its row; logits are gathered back to the full vocabulary.

With a group of one every layer computes exactly what the unsharded layer does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.model.layers import Linear
from kvferry.model.parallel import all_reduce, tp_rank, tp_size


def vocab_shard(vocab_size: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """``(start, stop, rows)``: rank's token ids are ``start <= id < stop`` and it holds
    ``rows`` rows (the same on every rank, so gathered logits line up)."""
    rows = -(-vocab_size // world_size)
    start = min(vocab_size, rank * rows)
    return start, min(vocab_size, start + rows), rows


class RowParallelLinear(Linear):
    """``y = sum over ranks(x_rank @ W_rank^T) + b``: ``in_features`` is this rank's share."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return super().forward(x)
        if self.kernel is not None:
            y = self.kernel(x, self.weight, None)
        else:
            y = F.linear(x, self.weight)
        y = all_reduce(y.contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` over this rank's vocabulary rows (all of them in a group of one)."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        start, stop, rows = vocab_shard(vocab_size, tp_size(), tp_rank())
        # An explicit weight skips the random init (slow on the meta device).
        super().__init__(rows, hidden, _weight=torch.empty(rows, hidden))
        self.full_vocab_size = vocab_size
        self.vocab_start, self.vocab_stop = start, stop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_stop)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(x)
