"""Instruction-set variants of the C kernels that hold several in one build: each such source
compiles its variants through target attributes, says which it holds through
``kvf_<name>_variants()`` (a bit mask), and takes the chosen one's number as an argument."""

from __future__ import annotations

import ctypes
from typing import Literal

# The levels of kernels with one variant per vector width (KVFERRY_CPU_ISA's levels).
IsaVariant = Literal["scalar", "avx2", "avx512"]
# Variant numbers shared by the C sources (csrc/variants.h: KVF_SCALAR, KVF_AVX2, KVF_AVX512,
# KVF_AVX512BF16, KVF_AMX).
VARIANT_CODES: dict[str, int] = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3, "amx": 4}


def compiled_variants(lib: ctypes.CDLL, name: str) -> tuple[str, ...]:
    """The variants ``lib``'s build of kernel ``name`` holds, narrowest first."""
    variants = getattr(lib, f"kvf_{name}_variants")
    variants.restype = ctypes.c_int
    mask = variants()
    return tuple(v for v, bit in VARIANT_CODES.items() if mask & (1 << bit))


def variant_code(name: str, variant: str, compiled: tuple[str, ...]) -> int:
    """``variant``'s number; ValueError when the build lacks it."""
    if variant not in compiled:
        raise ValueError(f"{name} variant {variant!r} is not in this build")
    return VARIANT_CODES[variant]


class VariantChoice:
    """What a kernel with variants keeps of its build and of the caller's choice:
    :attr:`variant`, its number (``_code``, passed on every call) and :meth:`compiled`."""

    variant: str
    _code: int

    def _choose_variant(self, lib: ctypes.CDLL, name: str, variant: str) -> None:
        """Takes ``variant`` of ``lib``'s build of kernel ``name``; ValueError when the build
        lacks it."""
        self._compiled = compiled_variants(lib, name)
        self._code = variant_code(name, variant, self._compiled)
        self.variant = variant

    def compiled(self) -> tuple[str, ...]:
        """The variants this build of the kernel holds."""
        return self._compiled
