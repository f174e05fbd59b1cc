"""The ctypes side shared by the linear kernels for steps of a few rows (``bf16_linear``,
``f32_linear``): one C entry point ``kvf_<name>(variant, x, sx, w, sw, bias, M, N, K, out,
so, threads)`` and ``kvf_<name>_variants()``, the bit mask of the variants in the build."""

from __future__ import annotations

import ctypes
from typing import Any, ClassVar, TypeVar

import torch

from kvferry.native.build import load_library
from kvferry.native.variants import VariantChoice

# The arguments every linear kernel's entry point ends with (see call_linear).
LINEAR_TAIL_ARGTYPES: list[type] = [
    ctypes.c_void_p,  # bias or NULL
    ctypes.c_int64,  # M (rows of x)
    ctypes.c_int64,  # N (outputs)
    ctypes.c_int64,  # K (inputs)
    ctypes.c_void_p,  # out
    ctypes.c_int64,  # out row stride
    ctypes.c_int,  # threads
]


class RowsLinearKernel(VariantChoice):
    """``F.linear(x, weight, bias)`` for CPU tensors of :attr:`DTYPE`, summed in fp32.

    ``variant`` picks the instruction set; it must be one :meth:`compiled` lists and the CPU
    runs (the caller decides from the CPU's features). :meth:`supports` says whether a call
    can use it: a 2-D input with contiguous rows, a weight with contiguous rows, both of
    :attr:`DTYPE`.
    """

    NAME: ClassVar[str]
    DTYPE: ClassVar[torch.dtype]

    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        self._fn = getattr(lib, f"kvf_{self.NAME}")
        self._fn.argtypes = [
            ctypes.c_int,  # variant
            ctypes.c_void_p,  # x
            ctypes.c_int64,  # x row stride (elements)
            ctypes.c_void_p,  # weight
            ctypes.c_int64,  # weight row stride
            *LINEAR_TAIL_ARGTYPES,
        ]
        self._fn.restype = ctypes.c_int
        self._choose_variant(lib, self.NAME, variant)
        self._failed = f"variant {variant!r} failed"  # formatted once: calls are per layer

    @classmethod
    def supports(cls, x: torch.Tensor, weight: torch.Tensor) -> bool:
        # Cheapest tests first: this runs before every small step's product.
        return (
            x.dtype == cls.DTYPE
            and weight.dtype == cls.DTYPE
            and x.is_cpu
            and x.dim() == 2
            and weight.dim() == 2
            and x.stride()[1] == 1
            and weight.stride()[1] == 1
            and x.shape[1] == weight.shape[1]
        )

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x``: ``[M, K]``, ``weight``: ``[N, K]``, ``bias``: ``[N]`` or None (see
        :meth:`supports`); returns a new ``[M, N]`` tensor of :attr:`DTYPE`."""
        return call_linear(
            self._fn,
            self.NAME,
            self.DTYPE,
            (self._code,),
            x,
            (weight.data_ptr(), weight.stride(0)),
            bias,
            weight.shape[0],
            self._failed,
        )


def call_linear(
    fn: Any,
    name: str,
    dtype: torch.dtype,
    lead: tuple[int, ...],
    x: torch.Tensor,
    weight: tuple[int, ...],
    bias: torch.Tensor | None,
    n: int,
    refused: str,
) -> torch.Tensor:
    """A linear kernel's C entry point ``fn(*lead, x, sx, *weight, bias, M, n, K, out, so,
    threads)`` into a new ``[M, n]`` tensor of ``dtype``: -2 raises MemoryError, any other
    code but 0 RuntimeError (``refused`` says why)."""
    m, k = x.shape
    if bias is not None:
        bias = bias.to(dtype).contiguous()
    out = torch.empty(m, n, dtype=dtype)
    rc = fn(
        *lead,
        x.data_ptr(),
        x.stride(0),
        *weight,
        None if bias is None else bias.data_ptr(),
        m,
        n,
        k,
        out.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError(f"{name}: could not allocate scratch memory")
    if rc != 0:
        raise RuntimeError(f"{name}: {refused} (rc={rc})")
    return out


K = TypeVar("K", bound=RowsLinearKernel)


def load_rows_kernel(cls: type[K], variant: str) -> K | None:
    """``cls``'s kernel in ``variant``, built on first use; None where native kernels are off,
    the kernel is unbuildable or this build lacks the variant."""
    lib = load_library(cls.NAME)
    if lib is None:
        return None
    try:
        return cls(lib, variant)
    except ValueError:
        return None
