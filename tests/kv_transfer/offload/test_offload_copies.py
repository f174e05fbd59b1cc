"""Block copies: run coalescing, host copies through the C kernel and numpy (on one thread
or split over a pool), and the engine's per-layer copy op."""

from __future__ import annotations

import pytest
import torch

from kvferry.kv_transfer import copy_ops
from kvferry.kv_transfer.copy_ops import CopyPool, coalesce, copy_blocks


def test_coalesce_runs() -> None:
    assert coalesce([1, 2, 3, 9, 5], [7, 8, 9, 10, 0]) == [(1, 7, 3), (9, 10, 1), (5, 0, 1)]


@pytest.mark.parametrize("path", ["native", "numpy", "native-split", "numpy-split"])
@pytest.mark.parametrize("seed", range(4))
def test_copy_blocks_matches_indexing(
    seed: int, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host copies through the C row-copy kernel and through numpy, on the calling thread
    and split over a pool's threads."""
    if path.startswith("numpy"):
        monkeypatch.setattr(copy_ops, "load_block_copy", lambda: None)
    elif copy_ops.load_block_copy() is None:
        pytest.skip("no C compiler: the row-copy kernel cannot be built here")
    pool = None
    if path.endswith("split"):
        monkeypatch.setattr(copy_ops, "PARALLEL_COPY_BYTES", 0)
        pool = CopyPool(2)
    g = torch.Generator().manual_seed(seed)
    src = [torch.randn(2, 40, 4, 1, 2, generator=g) for _ in range(2)]
    dst = [torch.zeros(2, 30, 4, 1, 2) for _ in range(2)]
    n = 20
    src_ids = torch.randperm(40, generator=g)[:n].tolist()
    src_ids[3:10] = range(20, 27)  # a long run among random ids
    dst_ids = torch.randperm(30, generator=g)[:n].tolist()
    dst_ids[3:10] = range(5, 12)
    dst_ids = list(dict.fromkeys(dst_ids))[:n]
    src_ids = list(dict.fromkeys(src_ids))[: len(dst_ids)]
    dst_ids = dst_ids[: len(src_ids)]
    before = [d.clone() for d in dst]
    nbytes = copy_blocks(src, dst, src_ids, dst_ids, pool=pool)
    untouched = [i for i in range(30) if i not in dst_ids]
    for s, d, b in zip(src, dst, before, strict=True):
        assert torch.equal(d[:, dst_ids], s[:, src_ids])
        assert torch.equal(d[:, untouched], b[:, untouched])
    assert nbytes == 2 * len(src_ids) * 2 * 4 * 2 * 4
    if pool is not None:
        pool.shutdown()


@pytest.mark.parametrize("op", ["KVBlockCopy", "copy_kv_blocks"])
def test_engine_copy_op_matches_indexing(op: str) -> None:
    g = torch.Generator().manual_seed(0)
    src = {f"l{i}": torch.randn(2, 12, 4, 1, 2, generator=g) for i in range(3)}
    dst = {f"l{i}": torch.zeros(2, 9, 4, 1, 2) for i in range(2)}  # l2 has no destination
    copy = copy_ops.KVBlockCopy() if op == "KVBlockCopy" else copy_ops.copy_kv_blocks
    for _ in range(2):  # the second call reuses the cached copier
        copy(src, dst, [7, 1, 2, 3, 11], [0, 4, 5, 6, 8], "d2h")
    for n, d in dst.items():
        assert torch.equal(d[:, [0, 4, 5, 6, 8]], src[n][:, [7, 1, 2, 3, 11]])
        assert torch.equal(d[:, [1, 2, 3, 7]], torch.zeros_like(d[:, [1, 2, 3, 7]]))
    with pytest.raises(ValueError, match="same length"):
        copy(src, dst, [1], [], "d2h")
    with pytest.raises(ValueError, match="direction"):
        copy(src, dst, [1], [2], "sideways")  # type: ignore[arg-type]
    if isinstance(copy, copy_ops.KVBlockCopy):
        copy.close()
