"""P/D across tensor-parallel sizes: which prefill ranks a decode rank reads, and which bytes.

A rank's KV pool is ``(2, num_blocks, block_size, kv_heads / tp, head_dim)`` per layer, rank r
holding the KV heads ``[r * H / tp, (r + 1) * H / tp)`` of the model's H. With a prefill TP of
``a`` and a decode TP of ``b`` (one divides the other):

* ``a == b``: decode rank r reads prefill rank r's blocks whole (no change from equal TP).
* ``b > a``: decode rank r reads prefill rank ``r // (b / a)`` and keeps its share of that
  rank's heads; ``b / a`` decode ranks read each prefill rank (its hold expects that many).
* ``a > b``: decode rank r reads prefill ranks ``r * (a / b) ...`` (``a / b`` of them) and puts
  each one's heads next to the others'.

A head range of a block is one contiguous piece per token in an NHD pool (heads vary faster
than tokens), and one piece per block in an HND pool (each head's rows of a block are
together), so the bytes move as *pieces*: one (local address, remote address, length) per
(layer, K|V, block[, token]), read straight into place. We chose that over reading whole
remote blocks into a staging area and copying the heads out: it needs no extra registered
memory, no copy on the engine thread, and no staging capacity that a long prompt could
exceed (and wait or fail on); the descriptors exist only per transfer (never one per token of
the whole pool). The price is ``block_size`` times as many, smaller descriptors as an
equal-TP read (NHD); the equal-TP path keeps its whole-block descriptors.

The pieces follow the *prefill* pool's order, the order the bytes arrive in: the local block
is addressed as if it had the peer's layout (its head range per token, or per block), so once
every source rank's READ is complete it holds this rank's heads whole, in the peer's order.
With one layout on both sides that is the local order. With the other layout (NHD prefill
and HND decode or the reverse, admitted with ``enable_permute_local_kv``) the decode side
then permutes the blocks in place, as at equal TP (:mod:`.layout_match`). Reading straight
into the local order instead would need one piece per (token, head) row of ``head_dim``
elements (the two orders share no longer run): per block, ``h`` times the pieces of an NHD
prefill's READ and ``block_size * h`` times those of an HND one (``h`` the heads a piece
carries), each a few hundred bytes, to save one copy of the blocks in device memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvferry.kv_transfer.connectors.pd.transport import KVLayout


def source_ranks(rank: int, tp: int, remote_tp: int) -> list[int]:
    """The prefill ranks decode rank ``rank`` reads from."""
    if remote_tp >= tp:
        k = remote_tp // tp
        return [rank * k + j for j in range(k)]
    return [rank // (tp // remote_tp)]


def readers_per_source(tp: int, remote_tp: int) -> int:
    """How many decode ranks read each prefill rank."""
    return max(1, tp // remote_tp)


def remote_block_bytes(local_block_bytes: int, tp: int, remote_tp: int) -> int:
    """The block size in bytes a compatible prefill rank must have."""
    return local_block_bytes * tp // remote_tp


@dataclass(frozen=True)
class HeadSlice:
    """The bytes of one row (a token's, or an HND block's) that move: ``length`` bytes at
    ``local_off`` in our row and at ``remote_off`` in the prefill rank's row."""

    local_off: int
    remote_off: int
    length: int


def head_slice(
    rank: int, tp: int, source: int, remote_tp: int, local: KVLayout, remote: KVLayout
) -> HeadSlice:
    rows = _rows_per_block(remote)
    local_tok = local.block_bytes // rows
    remote_tok = remote.block_bytes // rows
    if tp > remote_tp:  # our heads are a share of the source rank's
        return HeadSlice(0, (rank % (tp // remote_tp)) * local_tok, local_tok)
    k = remote_tp // tp  # the source rank's heads are a share of ours
    return HeadSlice((source - rank * k) * remote_tok, 0, remote_tok)


def _rows_per_block(remote: KVLayout) -> int:
    """The pieces a block's head range comes in, in the prefill pool's order (which the
    local block takes until it is permuted): a token row each (NHD), or one (HND)."""
    return 1 if remote.heads_outer else remote.block_size


def _addrs(layout: KVLayout, block_ids: list[int], offset: int, rows: int) -> np.ndarray:
    """Start address of every (layer, K|V, block, row) of ``block_ids``, plus ``offset``:
    ``rows`` rows per block (its tokens, or the block as one row)."""
    tok = layout.block_bytes // rows
    bases = np.array(layout.base_addrs, dtype=np.uint64)  # (L,)
    kv = np.arange(2, dtype=np.uint64) * np.uint64(layout.num_blocks * layout.block_bytes)
    blocks = np.asarray(block_ids, dtype=np.uint64) * np.uint64(layout.block_bytes)
    toks = np.arange(rows, dtype=np.uint64) * np.uint64(tok)
    out = (
        bases[:, None, None, None]
        + kv[None, :, None, None]
        + blocks[None, None, :, None]
        + toks[None, None, None, :]
    )
    return (out + np.uint64(offset)).ravel()


def pieces(
    local: KVLayout,
    remote: KVLayout,
    local_ids: list[int],
    remote_ids: list[int],
    sl: HeadSlice,
) -> tuple[np.ndarray, np.ndarray, int]:
    """(local addresses, remote addresses, piece length) of a head-sliced READ, one piece per
    (layer, K|V, block, token) (an HND prefill pool: per (layer, K|V, block)), the same order
    on both sides. The bytes land in ``remote``'s order inside the local blocks."""
    if len(local_ids) != len(remote_ids) or not local_ids:
        raise ValueError("a READ needs as many local as remote blocks, at least one")
    if local.block_size != remote.block_size or local.num_layers != remote.num_layers:
        raise ValueError("the two pools differ in block size or layer count")
    rows = _rows_per_block(remote)
    return (
        _addrs(local, local_ids, sl.local_off, rows),
        _addrs(remote, remote_ids, sl.remote_off, rows),
        sl.length,
    )
