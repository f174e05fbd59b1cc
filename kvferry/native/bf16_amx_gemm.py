"""bf16 linear layers on AMX tiles for steps of a few hundred rows (a prompt's prefill), from a
copy of the weight packed for the tiles (``csrc/bf16_amx_gemm.c``)."""

from __future__ import annotations

import ctypes

import torch

from kvferry.native.build import load_library
from kvferry.native.packed_linear import PackedLinearKernel


class BF16AMXGemmKernel(PackedLinearKernel):
    """``F.linear(x, weight, bias)`` for bf16 CPU tensors on AMX, with the weight given as the
    copy :meth:`pack` made of it. Sums run in fp32 and round to bf16 once per output, as
    oneDNN's bf16 product does (only their order differs). Weights of ``N`` outputs and ``K``
    inputs, both multiples of 32 (:meth:`packs`)."""

    NAME = "bf16_amx_gemm"
    DTYPE = torch.bfloat16
    REFUSED = "no AMX here, or sizes not multiples of 32"

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        self._pack = lib.kvf_bf16_amx_pack
        self._pack.argtypes = [
            ctypes.c_void_p,  # weight
            ctypes.c_int64,  # weight row stride
            ctypes.c_int64,  # N
            ctypes.c_int64,  # K
            ctypes.c_void_p,  # out
            ctypes.c_int,  # threads
        ]
        self._pack.restype = ctypes.c_int

    @staticmethod
    def packs(weight: torch.Tensor) -> bool:
        """Whether :meth:`pack` takes ``weight``: 2-D bf16 with contiguous rows, both sizes
        multiples of 32."""
        return (
            weight.dtype == torch.bfloat16
            and weight.dim() == 2
            and weight.shape[0] % 32 == 0
            and weight.shape[1] % 32 == 0
            and weight.stride(1) == 1
        )

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of a ``[N, K]`` weight (:meth:`packs`): a new 1-D bf16 tensor of
        ``N * K`` elements."""
        if not self.packs(weight):
            raise ValueError("bf16_amx_gemm packs 2-D bf16 weights of sizes multiple of 32")
        n, k = weight.shape
        out = torch.empty(n * k, dtype=torch.bfloat16)
        rc = self._pack(
            weight.data_ptr(), weight.stride(0), n, k, out.data_ptr(), torch.get_num_threads()
        )
        if rc != 0:
            raise RuntimeError("bf16_amx_gemm: this build has no AMX code")
        return out


def load_bf16_amx_gemm() -> BF16AMXGemmKernel | None:
    """The kernel, built on first use; None where native kernels are off, the kernel is
    unbuildable, or AMX cannot run here (not in the build, or Linux refuses the tile state)."""
    lib = load_library("bf16_amx_gemm")
    if lib is None or lib.kvf_bf16_amx_gemm_ready() != 0:
        return None
    return BF16AMXGemmKernel(lib)
