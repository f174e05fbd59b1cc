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
    assert check_peer_layout(NHD, "NHD", permute_local_kv=False) is False
    assert check_peer_layout(HND, "HND", permute_local_kv=True) is False
    assert check_peer_layout(HND, "NHD", permute_local_kv=True) is True
    assert check_peer_layout(NHD, "HND", permute_local_kv=True) is True
    with pytest.raises(ProtocolError, match='layout is HND, this instance.s is NHD; set "enable_'):
        check_peer_layout(NHD, "HND", permute_local_kv=False)


def _agent_info(layout: str, tp: int, block_bytes: int) -> object:
    from kvferry.kv_transfer.connectors.pd.messages import AgentInfo

    return AgentInfo(
        "P", "agent-P0", b"md", 0, tp, 16, 32, block_bytes, "DRAM", 0, [4096, 8192],
        kv_cache_layout=layout,
    )  # fmt: skip


@pytest.mark.parametrize(("theirs", "ours"), [(1, 2), (2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("permute", [False, True])
def test_a_peer_of_the_other_layout_and_tp_size_needs_the_flag(theirs, ours, permute):
    """The handshake check a decode rank runs (PeerClient._check_info), across TP sizes: the
    other layout is admitted with enable_permute_local_kv and refused, naming the flag,
    without it; a peer of the decode's layout is admitted either way."""
    from types import SimpleNamespace

    from kvferry.kv_transfer.connectors.pd.peers import PeerClient
    from kvferry.kv_transfer.connectors.pd.transport import KVLayout

    local = KVLayout(32, 1024, 16, "DRAM", 0, (1 << 20, 1 << 21), heads_outer=False)
    client = SimpleNamespace(local=local, tp_size=ours, kv_layout=NHD, permute_local_kv=permute)
    theirs_bytes = 1024 * ours // theirs
    same = _agent_info("NHD", theirs, theirs_bytes)
    assert PeerClient._check_info(client, same, "P", 0, theirs) is same  # type: ignore[arg-type]
    other = _agent_info("HND", theirs, theirs_bytes)
    if permute:
        assert PeerClient._check_info(client, other, "P", 0, theirs) is other  # type: ignore[arg-type]
        assert KVLayout.of_peer(other).heads_outer  # type: ignore[arg-type]
    else:
        with pytest.raises(ProtocolError, match='layout is HND, this instance.s is NHD; set "'):
            PeerClient._check_info(client, other, "P", 0, theirs)  # type: ignore[arg-type]
