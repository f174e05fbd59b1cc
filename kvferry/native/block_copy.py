"""Host-to-host block copies of many tensors in one call (``csrc/block_copy.c``)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvferry.native.build import load_library


class RowCopyPlan:
    """A fixed list of (source, destination) CPU tensors shaped ``(rows, ...)``, contiguous,
    whose rows :meth:`copy` moves by id. The tensors must outlive the plan."""

    def __init__(self, fn: Any, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for s, d in pairs:
            if not (s.is_contiguous() and d.is_contiguous()):
                raise ValueError("block copies need contiguous tensors")
            if s.device.type != "cpu" or d.device.type != "cpu":
                raise ValueError("block copies run between CPU tensors")
            if s[0].nbytes != d[0].nbytes:
                raise ValueError("source and destination rows differ in size")
        self._fn = fn
        self.num_tensors = len(pairs)
        self._src = (ctypes.c_void_p * len(pairs))(*(s.data_ptr() for s, _ in pairs))
        self._dst = (ctypes.c_void_p * len(pairs))(*(d.data_ptr() for _, d in pairs))
        self._row_bytes = (ctypes.c_int64 * len(pairs))(*(s[0].nbytes for s, _ in pairs))
        self._src_rows = min((s.shape[0] for s, _ in pairs), default=0)
        self._dst_rows = min((d.shape[0] for _, d in pairs), default=0)

    def copy(
        self,
        src_ids: Sequence[int] | np.ndarray,
        dst_ids: Sequence[int] | np.ndarray,
        threads: int = 1,
    ) -> None:
        """``src_ids`` / ``dst_ids``: block ids of equal length, checked against every
        tensor's row count (an id out of range would write outside the destination); the
        copy is spread over up to ``threads`` OpenMP threads."""
        n = len(src_ids)
        if len(dst_ids) != n:
            raise ValueError("src_ids and dst_ids differ in length")
        if n == 0:
            return
        src = np.ascontiguousarray(src_ids, dtype=np.int64)
        dst = np.ascontiguousarray(dst_ids, dtype=np.int64)
        if (
            min(src.min(), dst.min()) < 0
            or src.max() >= self._src_rows
            or dst.max() >= self._dst_rows
        ):
            raise IndexError("block id out of range for a block copy")
        rc = self._fn(
            self.num_tensors,
            self._src,
            self._dst,
            self._row_bytes,
            src.ctypes.data,
            dst.ctypes.data,
            n,
            threads,
        )
        if rc != 0:
            raise MemoryError("block copy: could not allocate its run table")


class BlockCopyKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvf_copy_rows
        self._fn.argtypes = [
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int,
        ]
        self._fn.restype = ctypes.c_int

    def plan(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> RowCopyPlan:
        return RowCopyPlan(self._fn, pairs)

    def copy_pointers(
        self,
        src: ctypes.Array[ctypes.c_void_p],
        dst: ctypes.Array[ctypes.c_void_p],
        row_bytes: ctypes.Array[ctypes.c_int64],
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        threads: int = 1,
    ) -> None:
        """Row ``src_ids[i]`` of every source region to row ``dst_ids[i]`` of its destination,
        over pointer tables the caller built (``src[t]``, ``dst[t]``, ``row_bytes[t]`` per
        region) and int64 id arrays it checked against every region's row count: nothing is
        checked here, for callers whose regions are not whole tensors (a staging slot's
        slices). The GIL is released for the copy."""
        n = len(src_ids)
        if n != len(dst_ids):
            raise ValueError("src_ids and dst_ids differ in length")
        if n and self._fn(
            len(src), src, dst, row_bytes, src_ids.ctypes.data, dst_ids.ctypes.data, n, threads
        ):
            raise MemoryError("block copy: could not allocate its run table")


def load_block_copy() -> BlockCopyKernel | None:
    """The kernel, built on first use; None where native kernels are off or unbuildable."""
    lib = load_library("block_copy")
    return None if lib is None else BlockCopyKernel(lib)
