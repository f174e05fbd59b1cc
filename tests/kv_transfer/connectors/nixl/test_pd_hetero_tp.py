"""P/D across tensor-parallel sizes, without a transport: which prefill ranks a decode rank
reads, that the head-sliced pieces land every KV head where a TP=1 pool has it (bytes moved
with memmove between real tensors), multi-reader holds, and the params' TP check."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from kvferry.kv_layout import KVCacheLayout
from kvferry.kv_transfer.connectors.pd import handshake as hs
from kvferry.kv_transfer.connectors.pd.lease import LeaseTable
from kvferry.kv_transfer.connectors.pd.params import ParamsError, parse_remote
from kvferry.kv_transfer.connectors.pd.tp_slices import (
    head_slice,
    pieces,
    readers_per_source,
    remote_block_bytes,
    source_ranks,
)
from kvferry.kv_transfer.connectors.pd.transport import KVLayout

H, D, BS, NB, L = 8, 4, 4, 6, 2  # KV heads of the model, head dim, block size, blocks, layers


def test_source_ranks_and_readers() -> None:
    assert [source_ranks(r, 2, 1) for r in range(2)] == [[0], [0]]
    assert [source_ranks(r, 1, 2) for r in range(1)] == [[0, 1]]
    assert [source_ranks(r, 4, 2) for r in range(4)] == [[0], [0], [1], [1]]
    assert [source_ranks(r, 2, 4) for r in range(2)] == [[0, 1], [2, 3]]
    assert [source_ranks(r, 2, 2) for r in range(2)] == [[0], [1]]
    assert (readers_per_source(4, 2), readers_per_source(2, 4), readers_per_source(2, 2)) == (
        2,
        1,
        1,
    )
    assert remote_block_bytes(64, 2, 1) == 128 and remote_block_bytes(64, 1, 2) == 32


def _pools(
    tp: int, full: list[torch.Tensor] | None, layout: KVCacheLayout = KVCacheLayout.NHD
) -> list[dict[str, torch.Tensor]]:
    """Each rank's KV pool in ``layout``: its share of the heads of ``full`` (zeros when
    None)."""
    n = H // tp
    out = []
    for r in range(tp):
        caches = {}
        for layer in range(L):
            t = layout.allocate((2, NB, BS, n, D), torch.float32, torch.device("cpu"), _zeros)
            if full is not None:
                t.copy_(full[layer][:, :, :, r * n : (r + 1) * n, :])
            caches[f"l{layer}"] = t
        out.append(caches)
    return out


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


@pytest.mark.parametrize("layout", list(KVCacheLayout))
@pytest.mark.parametrize(
    ("a", "b"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 8), (8, 2)]
)
def test_pieces_put_every_head_in_place(a: int, b: int, layout: KVCacheLayout) -> None:
    torch.manual_seed(0)
    full = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    prefill, decode = _pools(a, full, layout), _pools(b, None, layout)
    remote_ids, local_ids = [4, 1, 2], [0, 5, 3]
    for r in range(b):
        local = KVLayout.of_caches(decode[r])
        assert local.heads_outer == (layout is KVCacheLayout.HND)  # also with one head
        for s in source_ranks(r, b, a):
            # As a handshake builds it: the peer's layout is ours (the compatibility hash).
            remote = KVLayout.of_caches(prefill[s])
            remote = dataclasses.replace(remote, heads_outer=False)
            assert remote.block_bytes == remote_block_bytes(local.block_bytes, b, a)
            sl = head_slice(r, b, s, a, local, remote)
            dst, src, n = pieces(local, remote, local_ids, remote_ids, sl)
            assert len(dst) == L * 2 * len(local_ids) * (1 if local.heads_outer else BS)
            for d_addr, s_addr in zip(dst, src, strict=True):
                ctypes.memmove(int(d_addr), int(s_addr), n)
    n = H // b
    for r in range(b):
        for layer in range(L):
            got = decode[r][f"l{layer}"]
            want = full[layer][:, :, :, r * n : (r + 1) * n, :]
            for lb, rb in zip(local_ids, remote_ids, strict=True):
                assert torch.equal(got[:, lb], want[:, rb])
            untouched = [i for i in range(NB) if i not in local_ids]
            assert not got[:, untouched].any()


def _claim(agent: str, readers: int, reader: str = "D") -> hs.ClaimRequest:
    return hs.ClaimRequest("P", "r0", [1, 2], 32, "d", reader, agent, readers=readers)


def test_a_hold_read_by_several_ranks_ends_after_the_last_read() -> None:
    t = LeaseTable("P", "agent-P", lease_s=10, max_hold_s=60)
    t.add("r0", [1, 2], 32, "d")
    assert isinstance(t.claim(_claim("D-r0", 2)), hs.Granted)
    refused = t.claim(_claim("D-r1", 1))  # a different reader count than the hold's
    assert isinstance(refused, hs.Refused) and "claimed for 2 readers" in refused.reason
    assert isinstance(t.claim(_claim("D-r1", 2)), hs.Granted)
    third = t.claim(_claim("D-r2", 2))
    assert isinstance(third, hs.Refused) and "readers claimed it already" in third.reason
    assert t.complete("r0", "D", "D-r0") and t.num_held() == 1 and not t.take_finished()
    assert not t.complete("r0", "D", "D-r9")  # an agent that never claimed ends nothing
    assert t.complete("r0", "D", "D-r1") and t.num_held() == 0
    assert t.take_finished() == {"r0": "read by engine D"}


def test_one_reader_hold_follows_its_latest_agent() -> None:
    t = LeaseTable("P", "agent-P", lease_s=10, max_hold_s=60)
    t.add("r0", [1, 2], 32, "d")
    assert isinstance(t.claim(_claim("old", 1)), hs.Granted)
    assert isinstance(t.claim(_claim("new", 1)), hs.Granted)  # the reader restarted
    assert not t.complete("r0", "D", "old")
    assert t.complete("r0", "D", "new") and t.num_held() == 0


PARAMS = {
    "remote_engine_id": "P",
    "remote_request_id": "r0",
    "remote_host": "127.0.0.1",
    "remote_port": 5000,
    "remote_block_ids": [7, 8],
    "remote_num_tokens": 20,
}


@pytest.mark.parametrize(("theirs", "ours"), [(1, 2), (2, 1), (4, 2), (2, 4), (2, 2)])
def test_params_accept_tp_sizes_that_divide(theirs: int, ours: int) -> None:
    remote = parse_remote({**PARAMS, "tp_size": theirs}, block_size=16, tp_size=ours)
    assert remote.tp_size == theirs


@pytest.mark.parametrize(("theirs", "ours"), [(3, 2), (2, 3), (4, 6)])
def test_params_refuse_tp_sizes_that_do_not_divide(theirs: int, ours: int) -> None:
    with pytest.raises(ParamsError, match="one of the two tensor-parallel sizes divides"):
        parse_remote({**PARAMS, "tp_size": theirs}, block_size=16, tp_size=ours)


def _config(model: object, tp: int) -> object:
    from types import SimpleNamespace

    arch = SimpleNamespace(architecture="LlamaForCausalLM", layers=1)
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(model), arch=arch),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )


def _kv_config(heads_per_rank: int, block_size: int = 16) -> object:
    from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec

    group = KVCacheGroupSpec(
        layer_names=("model.layers.0.self_attn",),
        block_size=block_size,
        num_kv_heads=heads_per_rank,
        head_dim=8,
        dtype=torch.float32,
    )
    return KVCacheConfig(num_blocks=8, groups=(group,))


def test_compat_hash_ignores_tp_size_but_not_geometry(tiny_model_factory) -> None:
    model = tiny_model_factory("llama", layers=1, hidden=64, heads=4, kv_heads=2, vocab=512)
    tp1 = hs.Compat.of(_config(model, 1), _kv_config(2))  # type: ignore[arg-type]
    tp2 = hs.Compat.of(_config(model, 2), _kv_config(1))  # type: ignore[arg-type]
    assert tp1.hash == tp2.hash and "tp=" not in tp1.desc and "xH2x" in tp1.desc
    assert (tp1.tp_size, tp2.tp_size) == (1, 2)
    # Other total KV heads, another block size: refused before any message is read.
    for other in (
        hs.Compat.of(_config(model, 2), _kv_config(2)),  # type: ignore[arg-type]
        hs.Compat.of(_config(model, 1), _kv_config(2, block_size=32)),  # type: ignore[arg-type]
    ):
        assert other.hash != tp1.hash
        with pytest.raises(hs.IncompatiblePeer, match="layout="):
            hs.Codec(tp1).decode_request(hs.Codec(other).encode(hs.HandshakeRequest("P", 0)), "p")


class _PieceTransport:
    """Records head-sliced READs; a READ from prefill rank ``fail_rank`` fails."""

    name = "agent-D"

    def __init__(self, fail_rank: int | None) -> None:
        self.fail_rank = fail_rank
        self.posted: list[tuple[str, int, int]] = []  # (peer agent, pieces, length)

    def add_peer(self, info: object) -> object:
        from kvferry.kv_transfer.connectors.nixl.agent import RemotePeer

        return RemotePeer(info.agent_name, KVLayout.of_peer(info), None)  # type: ignore[attr-defined]

    def read(self, *args: object) -> tuple[object, str]:
        raise AssertionError("across TP sizes every READ is head-sliced")

    def read_pieces(self, peer, local, remote, length, notif):  # type: ignore[no-untyped-def]
        assert len(local) == len(remote)
        self.posted.append((peer.name, len(local), length))
        return peer.name, "PROC"

    def state(self, handle: object) -> str:
        return "ERR" if handle == f"agent-P{self.fail_rank}" else "DONE"

    def release(self, handle: object) -> bool:
        return True

    def remove_peer(self, peer: object) -> None:
        pass


def _two_source_reader(transport: _PieceTransport) -> object:
    import collections
    import time
    from concurrent.futures import Future

    import zmq

    from kvferry.kv_transfer.connectors.nixl.options import NixlOptions
    from kvferry.kv_transfer.connectors.pd.metadata import RecvSpec, RemoteRef
    from kvferry.kv_transfer.connectors.pd.reader import Reader, _Leg, _Read

    # This engine: TP=1, one rank with 2 KV heads of 8 floats; the prefill engine: TP=2.
    local = KVLayout(32, 16 * 2 * 8 * 4, 16, "DRAM", 0, (1 << 20,))
    stats: dict[str, float] = collections.defaultdict(float)
    codec = hs.Codec(hs.Compat("x"))
    reader = Reader(
        transport, local, codec, zmq.Context(), "D", NixlOptions(handshake_timeout=0.1), stats
    )  # type: ignore[arg-type]
    legs = []
    for rank in (0, 1):
        info = hs.AgentInfo("P", f"agent-P{rank}", b"md", rank, 2, 16, 32, 512, "DRAM", 0, [8192])
        prep: Future[object] = Future()
        prep.set_result((info, time.monotonic() + 60))
        legs.append(_Leg(rank, prep))  # type: ignore[arg-type]
    ref = RemoteRef("P", "127.0.0.1", 1, "p", tp_size=2)
    reader._reads["r"] = _Read(RecvSpec("r", ref, [1, 2], [3, 4], 20, "d"), legs)
    return reader


@pytest.mark.parametrize("fail_rank", [None, 0, 1])
def test_a_read_from_several_prefill_ranks_fails_as_a_whole(fail_rank: int | None) -> None:
    transport = _PieceTransport(fail_rank)
    reader = _two_source_reader(transport)
    try:
        reader.poll()  # type: ignore[attr-defined]
        done, failed = reader.take()  # type: ignore[attr-defined]
        assert done == {"r"} and failed == (set() if fail_rank is None else {"r"})
        # Each source rank's READ: one piece per (layer, K|V, block, token) of its 1 head.
        assert {(name, n, size) for name, n, size in transport.posted} <= {
            ("agent-P0", 2 * 2 * 16, 8 * 4),
            ("agent-P1", 2 * 2 * 16, 8 * 4),
        }
        if fail_rank is None:
            assert len(transport.posted) == 2 and reader.stats["reads"] == 1  # type: ignore[attr-defined]
    finally:
        reader.shutdown()  # type: ignore[attr-defined]
