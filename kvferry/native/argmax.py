"""Row-wise argmax of fp32 logits (``csrc/argmax.c``), for greedy sampling."""

from __future__ import annotations

import ctypes

import torch

from kvferry.native.build import load_library


class ArgmaxKernel:
    """``torch.argmax(logits, dim=-1)`` for fp32 CPU ``[rows, vocab]`` logits whose rows are
    contiguous (:meth:`supports`); the same indices, first maximum on ties."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvf_argmax_f32
        self._fn.argtypes = [
            ctypes.c_void_p,  # logits
            ctypes.c_int64,  # row stride (elements)
            ctypes.c_int64,  # rows
            ctypes.c_int64,  # cols
            ctypes.c_void_p,  # out (int64)
            ctypes.c_int,  # threads
        ]
        self._fn.restype = None

    @staticmethod
    def supports(logits: torch.Tensor) -> bool:
        return (
            logits.device.type == "cpu"
            and logits.dtype == torch.float32
            and logits.dim() == 2
            and logits.shape[1] > 0
            and logits.stride(1) == 1
        )

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._fn(
            logits.data_ptr(), logits.stride(0), rows, cols, out.data_ptr(), torch.get_num_threads()
        )
        return out


def load_argmax() -> ArgmaxKernel | None:
    """The kernel, built on first use; None where native kernels are off or unbuildable."""
    lib = load_library("argmax")
    return None if lib is None else ArgmaxKernel(lib)
