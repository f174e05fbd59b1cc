"""Prefill and decode pools of different layouts: what the handshake admits, and the
permutation that turns a whole-block byte copy from the other layout into the local one."""

from __future__ import annotations

import pytest
import torch

from kvferry.kv_layout import KVCacheLayout, physical
from kvferry.kv_transfer.connectors.pd.codec import ProtocolError
from kvferry.kv_transfer.connectors.pd.layout_match import BlockPermuter, check_peer_layout

NHD, HND = KVCacheLayout.NHD, KVCacheLayout.HND
SHAPE = (2, 6, 4, 3, 5)  # (K|V, blocks, block_size, heads, head_dim)


def _pool(layout: KVCacheLayout) -> torch.Tensor:
    return layout.allocate(
        SHAPE,
        torch.float32,
        torch.device("cpu"),
        lambda s, dt, dev: torch.zeros(s, dtype=dt, device=dev),
    )


@pytest.mark.parametrize(("remote", "local"), [(HND, NHD), (NHD, HND)])
def test_received_blocks_become_the_local_order(remote, local):
    values = torch.randn(SHAPE)
    far, near = _pool(remote), _pool(local)
    far.copy_(values)
    near.copy_(-values)  # what the local blocks held before
    read = [4, 1]
    # A whole-block READ copies bytes: block b's K run and V run land at the same offsets.
    physical(near, local)[:, read] = physical(far, remote)[:, read].reshape(
        physical(near, local)[:, read].shape
    )
    assert not torch.equal(near[:, read], values[:, read])  # the peer's order inside blocks
    other = {"a": near, "b": near}  # layers sharing a tensor are permuted once
    BlockPermuter(other, local).to_local(read)
    assert torch.equal(near[:, read], values[:, read])
    rest = [b for b in range(SHAPE[1]) if b not in read]
    assert torch.equal(near[:, rest], -values[:, rest])  # other blocks untouched
    BlockPermuter(other, local).to_local([])  # nothing to do


def test_handshake_admits_layouts():
    assert check_peer_layout(NHD, "NHD", permute_local_kv=False, same_tp=False) is False
    assert check_peer_layout(HND, "NHD", permute_local_kv=True, same_tp=True) is True
    assert check_peer_layout(NHD, "HND", permute_local_kv=True, same_tp=True) is True
    with pytest.raises(ProtocolError, match='layout is HND, this instance.s is NHD; set "enable_'):
        check_peer_layout(NHD, "HND", permute_local_kv=False, same_tp=True)
    with pytest.raises(ProtocolError, match="tensor-parallel sizes differ"):
        check_peer_layout(HND, "NHD", permute_local_kv=True, same_tp=False)
