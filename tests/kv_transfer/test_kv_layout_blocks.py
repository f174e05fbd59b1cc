"""Block-level KV moves under the HND layout: each block of a half is one run of bytes in
either layout, so block copies (engine <-> host buffers), chunk payloads and disk files move
bytes in memory order; sides in different layouts copy element by element; a store's or a
disk tier's namespace names a non-default layout so NHD and HND bytes never mix."""

from __future__ import annotations

import pytest
import torch

from kvferry.kv_layout import KVCacheLayout, empty_like_layout, layout_of, physical
from kvferry.kv_transfer.connectors.mooncake_store.slot_copy import SlotCopier
from kvferry.kv_transfer.copy_ops import BlockCopier, copy_blocks
from kvferry.kv_transfer.offload.disk import layout_fingerprint

SHAPE = (2, 12, 4, 3, 8)  # (K|V, blocks, block_size, kv heads, head_dim)


def _hnd_pool(seed: int, layers: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        t = KVCacheLayout.HND.allocate(SHAPE, torch.float32, torch.device("cpu"), _zeros)
        t.copy_(torch.randn(SHAPE, generator=gen))
        out.append(t)
    return out


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def test_layout_of_and_physical() -> None:
    (hnd,) = _hnd_pool(0, 1)
    nhd = hnd.contiguous()
    assert layout_of(nhd) is KVCacheLayout.NHD and layout_of(hnd) is KVCacheLayout.HND
    assert physical(hnd).is_contiguous() and physical(hnd).shape == (2, 12, 3, 4, 8)
    assert layout_of(hnd[:, :, :2]) is None
    with pytest.raises(ValueError, match="dense in no KV cache layout"):
        physical(hnd[:, :, :2])
    assert KVCacheLayout.named(" hnd ") is KVCacheLayout.HND and KVCacheLayout.named("x") is None


@pytest.mark.parametrize("native", [True, False])
def test_block_copies_round_trip_through_a_host_buffer_in_the_engine_layout(native) -> None:
    engine = _hnd_pool(1)
    host = [empty_like_layout(t, 5) for t in engine]
    assert all(layout_of(h) is KVCacheLayout.HND for h in host)
    out = BlockCopier(engine, host)
    assert out.same_layout and out.on_host
    if not native:
        out.native = None
        out.rows = [(s.numpy().reshape(s.shape[0], -1), d.numpy().reshape(d.shape[0], -1))
                    for s, d in [(h0.view(torch.uint8), h1.view(torch.uint8))
                                 for h0, h1 in out.halves]]  # fmt: skip
    src, dst = [7, 2, 3, 11], [0, 1, 2, 4]
    out.copy(src, dst)
    for e, h in zip(engine, host, strict=True):
        assert torch.equal(h[:, dst], e[:, src])
    back = [torch.zeros(SHAPE) for _ in engine]  # NHD: another layout, element by element
    assert not BlockCopier(host, back).same_layout
    copy_blocks(host, back, dst, src)
    for e, b in zip(engine, back, strict=True):
        assert torch.equal(b[:, src], e[:, src])
        others = [i for i in range(SHAPE[1]) if i not in src]
        assert not b[:, others].any()


@pytest.mark.parametrize("native", [True, False])
def test_store_payloads_hold_blocks_in_memory_order(native: bool) -> None:
    engine = _hnd_pool(2)
    bpc = 3
    inner = physical(engine[0]).shape[2:]
    staging = torch.zeros(len(engine) * 2 * bpc * engine[0][0, 0].numel())
    payload = staging.view(len(engine), 2, bpc, *inner)
    copier = SlotCopier(engine, bpc, [int(staging.data_ptr())], [payload])
    if not native:
        copier.kernel = None
    copier.out_of_pool(0, [5, 0, 9])
    for layer, t in enumerate(engine):
        assert torch.equal(payload[layer], physical(t)[:, [5, 0, 9]])
    before = [t.clone() for t in engine]
    copier.into_pool(0, 0, [1, 2, 3])
    for layer, t in enumerate(engine):
        assert torch.equal(t[:, [1, 2, 3]], before[layer][:, [5, 0, 9]])


def test_disk_and_store_namespaces_name_a_non_default_layout() -> None:
    args = ("m", 2, 3, 8, torch.float32, 4, 2)
    nhd = layout_fingerprint(*args)
    assert layout_fingerprint(*args, kv_layout=KVCacheLayout.NHD) == nhd  # names unchanged
    hnd = layout_fingerprint(*args, kv_layout=KVCacheLayout.HND)
    assert hnd != nhd and "-hnd-" in hnd
