"""SlotCopier: chunk payloads <-> pool blocks, the C path against the indexed-copy path."""

from __future__ import annotations

import pytest
import torch

from kvferry.kv_transfer.connectors.mooncake_store.slot_copy import SlotCopier

LAYERS, BPC, BLOCK, HEADS, DIM, BLOCKS = 3, 4, 8, 2, 16, 20


def _setup(native: bool) -> tuple[SlotCopier, list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    kv = [torch.randn(2, BLOCKS, BLOCK, HEADS, DIM, generator=gen).to(torch.bfloat16)
          for _ in range(LAYERS)]  # fmt: skip
    payload_elems = LAYERS * 2 * BPC * BLOCK * HEADS * DIM
    # Two slots with a gap (the header) before each payload, as the staging buffer has.
    staging = torch.zeros(2, 32 + payload_elems, dtype=torch.bfloat16)
    payloads = [staging[s, 32:].view(LAYERS, 2, BPC, BLOCK, HEADS, DIM) for s in range(2)]
    copier = SlotCopier(kv, BPC, [int(p.data_ptr()) for p in payloads], payloads)
    if not native:
        copier.kernel = None
    elif copier.kernel is None:
        pytest.skip("native kernels unavailable")
    return copier, kv, staging


@pytest.mark.parametrize("native", [True, False])
def test_round_trip_and_partial_chunk(native: bool) -> None:
    copier, kv, staging = _setup(native)
    src = [3, 11, 4, 19]
    copier.out_of_pool(1, src)
    payload = copier.payload_of[1]
    for layer in range(LAYERS):
        assert torch.equal(payload[layer], kv[layer][:, src])
    # Load the last three rows of the chunk into other blocks (a load that starts inside it).
    dst = [0, 7, 8]
    before = [t.clone() for t in kv]
    copier.into_pool(1, 1, dst)
    for layer in range(LAYERS):
        assert torch.equal(kv[layer][:, dst], payload[layer][:, 1:])
        untouched = [b for b in range(BLOCKS) if b not in dst]
        assert torch.equal(kv[layer][:, untouched], before[layer][:, untouched])
    assert torch.count_nonzero(staging[0]) == 0  # the other slot is never touched


def test_paths_agree() -> None:
    results = []
    for native in (True, False):
        copier, kv, _ = _setup(native)
        copier.out_of_pool(0, [1, 2, 3, 5])
        copier.into_pool(0, 0, [9, 10, 12, 13])
        results.append(kv)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("native", [True, False])
def test_out_of_range_refused(native: bool) -> None:
    copier, kv, _ = _setup(native)
    before = [t.clone() for t in kv]
    with pytest.raises(IndexError):
        copier.into_pool(0, 0, [1, BLOCKS])
    with pytest.raises(IndexError):
        copier.into_pool(0, 2, [1, 2, 3])  # rows 2..4 of a 4-block chunk
    with pytest.raises(IndexError):
        copier.out_of_pool(0, [-1])
    for a, b in zip(kv, before, strict=True):
        assert torch.equal(a, b)
