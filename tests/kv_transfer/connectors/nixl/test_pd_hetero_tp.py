"""P/D across tensor-parallel sizes, without a transport: which prefill ranks a decode rank
reads, that the head-sliced pieces land every KV head where a TP=1 pool has it (bytes moved
with memmove between real tensors), multi-reader holds, and the params' TP check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry.kv_layout import KVCacheLayout, physical
from kvferry.kv_transfer.connectors.pd import handshake as hs
from kvferry.kv_transfer.connectors.pd.layout_match import BlockPermuter
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


def _as_peer(caches: dict[str, torch.Tensor], layout: KVCacheLayout, tp: int, rank: int):
    """A prefill rank's KVLayout as the decode side builds it from the handshake."""
    own = KVLayout.of_caches(caches)
    info = hs.AgentInfo(
        "P", f"agent-P{rank}", b"md", rank, tp, own.block_size, own.num_blocks,
        own.block_bytes, "DRAM", 0, list(own.base_addrs), kv_cache_layout=layout.value,
    )  # fmt: skip
    return KVLayout.of_peer(info)


def _byte_regions(pools: list[dict[str, torch.Tensor]]) -> list[tuple[int, np.ndarray]]:
    """(base address, the tensor's bytes in memory order as a writable numpy view) of every
    layer tensor of ``pools``."""
    out = []
    for caches in pools:
        for t in caches.values():
            flat = physical(t).numpy().reshape(-1).view(np.uint8)
            assert flat.ctypes.data == t.data_ptr()  # a view of the pool, not a copy
            out.append((t.data_ptr(), flat))
    return out


def _at(regions: list[tuple[int, np.ndarray]], addr: int, n: int) -> np.ndarray:
    """The ``n`` bytes at ``addr``; fails unless they lie inside one registered tensor."""
    for base, flat in regions:
        if base <= addr and addr + n <= base + flat.size:
            return flat[addr - base : addr - base + n]
    raise AssertionError(f"{n} bytes at {addr:#x} are outside every pool tensor")


# (prefill TP, decode TP): one decode rank reading several prefill ranks and the reverse.
RATIOS = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 8), (8, 2)]
LAYOUT_PAIRS = [(p, d) for p in KVCacheLayout for d in KVCacheLayout]


@pytest.mark.parametrize(
    ("p_layout", "d_layout"), LAYOUT_PAIRS, ids=[f"{p.value}-to-{d.value}" for p, d in LAYOUT_PAIRS]
)
@pytest.mark.parametrize(("a", "b"), RATIOS)
def test_pieces_put_every_head_in_place(
    a: int, b: int, p_layout: KVCacheLayout, d_layout: KVCacheLayout
) -> None:
    """Prefill TP ``a`` in ``p_layout``, decode TP ``b`` in ``d_layout``: the pieces, copied
    byte by byte (numpy, with bounds checks), then the permutation the decode side runs when
    the layouts differ, leave every decode rank's blocks equal to its heads of the model's KV
    (and no other block touched)."""
    torch.manual_seed(0)
    full = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    prefill, decode = _pools(a, full, p_layout), _pools(b, None, d_layout)
    src_bytes, dst_bytes = _byte_regions(prefill), _byte_regions(decode)
    remote_ids, local_ids = [4, 1, 2], [0, 5, 3]
    for r in range(b):
        local = KVLayout.of_caches(decode[r])
        assert local.heads_outer == (d_layout is KVCacheLayout.HND)  # also with one head
        for s in source_ranks(r, b, a):
            remote = _as_peer(prefill[s], p_layout, a, s)
            assert remote.heads_outer == (p_layout is KVCacheLayout.HND)
            assert remote.block_bytes == remote_block_bytes(local.block_bytes, b, a)
            sl = head_slice(r, b, s, a, local, remote)
            dst, src, n = pieces(local, remote, local_ids, remote_ids, sl)
            # The pieces follow the prefill pool's order: a head range per token, or per block.
            rows = 1 if remote.heads_outer else BS
            assert len(dst) == len(src) == L * 2 * len(local_ids) * rows
            assert n == min(local.block_bytes, remote.block_bytes) // rows
            for d_addr, s_addr in zip(dst, src, strict=True):
                _at(dst_bytes, int(d_addr), n)[:] = _at(src_bytes, int(s_addr), n)
        if p_layout is not d_layout:  # what the reader does once every leg is in
            BlockPermuter(decode[r], d_layout).to_local(local_ids)
    n_heads = H // b
    for r in range(b):
        for layer in range(L):
            got = decode[r][f"l{layer}"]
            want = full[layer][:, :, :, r * n_heads : (r + 1) * n_heads, :]
            for lb, rb in zip(local_ids, remote_ids, strict=True):
                assert torch.equal(got[:, lb], want[:, rb])
            untouched = [i for i in range(NB) if i not in local_ids]
            assert not got[:, untouched].any()


def test_without_the_permute_a_mixed_layout_block_holds_the_peers_order() -> None:
    """The permute step is what makes a mixed-layout read right (the check above is not
    vacuous): before it, an HND prefill's slices sit in NHD decode blocks in HND order."""
    torch.manual_seed(1)
    full = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    prefill = _pools(1, full, KVCacheLayout.HND)
    decode = _pools(2, None, KVCacheLayout.NHD)
    local, remote = KVLayout.of_caches(decode[0]), _as_peer(prefill[0], KVCacheLayout.HND, 1, 0)
    dst, src, n = pieces(local, remote, [2], [2], head_slice(0, 2, 0, 1, local, remote))
    regions_d, regions_p = _byte_regions(decode), _byte_regions(prefill)
    for d_addr, s_addr in zip(dst, src, strict=True):
        _at(regions_d, int(d_addr), n)[:] = _at(regions_p, int(s_addr), n)
    got, want = decode[0]["l0"][:, 2], full[0][:, 2, :, : H // 2]
    assert not torch.equal(got, want)
    # The NHD block's bytes (its memory order is the logical one) are in (head, token) order.
    assert torch.equal(got.reshape(2, -1), want.transpose(1, 2).reshape(2, -1))
    BlockPermuter(decode[0], KVCacheLayout.NHD).to_local([2])
    assert torch.equal(decode[0]["l0"][:, 2], want)


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


class _RecordingPermuter:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def to_local(self, block_ids: list[int]) -> None:
        self.calls.append(list(block_ids))


def _two_source_reader(
    transport: _PieceTransport, peer_layout: str = "NHD", permuter: object = None
) -> object:
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
        transport,
        local,
        codec,
        zmq.Context(),
        "D",
        NixlOptions(handshake_timeout=0.1),
        stats,
        permuter=permuter,
    )  # type: ignore[arg-type]
    legs = []
    for rank in (0, 1):
        info = hs.AgentInfo(
            "P", f"agent-P{rank}", b"md", rank, 2, 16, 32, 512, "DRAM", 0, [8192],
            kv_cache_layout=peer_layout,
        )  # fmt: skip
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


@pytest.mark.parametrize("fail_rank", [None, 1])
def test_a_mixed_layout_read_from_several_ranks_is_permuted_once_all_legs_are_in(
    fail_rank: int | None,
) -> None:
    """An HND prefill at TP=2, this NHD engine at TP=1 with a permuter: each leg is one piece
    per (layer, K|V, block) of its head, and the blocks are permuted once, after both legs
    (never after a failed read)."""
    transport, permuter = _PieceTransport(fail_rank), _RecordingPermuter()
    reader = _two_source_reader(transport, "HND", permuter)
    try:
        reader.poll()  # type: ignore[attr-defined]
        done, failed = reader.take()  # type: ignore[attr-defined]
        assert done == {"r"} and failed == (set() if fail_rank is None else {"r"})
        assert {(name, n, size) for name, n, size in transport.posted} <= {
            ("agent-P0", 2 * 2, 512),
            ("agent-P1", 2 * 2, 512),
        }
        assert permuter.calls == ([[3, 4]] if fail_rank is None else [])
    finally:
        reader.shutdown()  # type: ignore[attr-defined]
