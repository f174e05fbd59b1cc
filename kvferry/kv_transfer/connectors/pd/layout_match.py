"""Prefill and decode instances whose KV pools have different memory orders (NHD / HND).

Blocks move as bytes, and in both layouts a block's keys and its values are each one
contiguous run at the same offset, so a whole-block READ lands where it belongs, only in the
peer's order inside the block. As in vLLM, the decode side learns the prefill side's layout
at the handshake and, when ``enable_permute_local_kv`` is set in its kv_transfer_config,
rewrites each received block into its own order before the request runs
(:class:`BlockPermuter`); otherwise the handshake fails with an error that says so, the read
fails and ``kv_load_failure_policy`` applies. vLLM permutes only an HND prefill into an NHD
decode; the permutation is its own inverse here, so kvferry also takes the reverse.

Between different tensor-parallel sizes a rank reads head slices of the peer's blocks
(:mod:`.tp_slices`), placed in the local blocks in the peer's order; once every source rank's
slices are in, those blocks are whole in the peer's order and are permuted the same way (the
flag is needed there too, as in vLLM).
"""

from __future__ import annotations

import torch

from kvferry.kv_layout import KVCacheLayout, physical
from kvferry.kv_transfer.connectors.pd.codec import ProtocolError


def check_peer_layout(local: KVCacheLayout, remote: str, *, permute_local_kv: bool) -> bool:
    """Whether blocks read from a peer whose pool is in layout ``remote`` must be permuted
    into ``local``; raises ProtocolError when such a peer cannot be read."""
    if remote == local.value:
        return False
    if not permute_local_kv:
        raise ProtocolError(
            f"the prefill instance's KV cache layout is {remote}, this instance's is "
            f'{local.value}; set "enable_permute_local_kv": true in this decode instance\'s '
            f"kv_transfer_config to permute received blocks into {local.value}, or run both "
            "instances with one layout (KVFERRY_KV_CACHE_LAYOUT)"
        )
    return True


class BlockPermuter:
    """Rewrites received blocks, which hold the other layout's order, into the pool's."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layout: KVCacheLayout) -> None:
        # Layers of a hybrid model's groups share tensors: each tensor is permuted once.
        tensors = list({t.data_ptr(): t for t in kv_caches.values()}.values())
        self._physical = [physical(t, layout) for t in tensors]  # (2, nb, X, Y, d), dense

    def to_local(self, block_ids: list[int]) -> None:
        if not block_ids or not self._physical:
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self._physical[0].device)
        for p in self._physical:
            got = p.index_select(1, ids)  # a dense copy: (2, n, X, Y, d) of bytes in (Y, X)
            two, n, x, y, d = got.shape
            p.index_copy_(1, ids, got.view(two, n, y, x, d).transpose(2, 3).contiguous())
