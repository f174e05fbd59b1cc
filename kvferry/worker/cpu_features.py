"""What this CPU can do, detected once per process, and the instruction set the engine's CPU
paths may use.

The project runs on CPUs of several kinds (AVX2 only; AVX-512 with AVX512_BF16; AMX), and
the fastest path for a step differs between them: torch's own bf16 GEMMs are fast where the
CPU has bf16 instructions and far slower than fp32 where it does not. The features come from
``/proc/cpuinfo`` and from torch's own probes (``torch.cpu._is_*_supported``), which also
answer where there is no ``/proc``.

``KVFERRY_CPU_ISA`` (``avx512``, ``avx2`` or ``scalar``) caps the level the engine's choices
assume, so a bigger CPU can run, and tests can check, the paths of a smaller one: ``avx2``
treats the CPU as one without bf16 instructions and picks the AVX2 variants of the C
kernels; ``scalar`` picks their portable C. The cap is the engine's own: torch and oneDNN
still use whatever the CPU has for the products they compute (``ATEN_CPU_CAPABILITY`` and
``ONEDNN_MAX_CPU_ISA`` cap those, set before torch starts).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvferry import envs
from kvferry.config.errors import ConfigError

ISA = Literal["scalar", "avx2", "avx512"]
ISA_LEVELS: tuple[ISA, ...] = ("scalar", "avx2", "avx512")
# The /proc/cpuinfo flags the CPU paths depend on, in the order they are reported.
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")
# torch's probes for the same features, where /proc/cpuinfo is missing or silent.
_TORCH_PROBES = {
    "avx2": "_is_avx2_supported",
    "avx512f": "_is_avx512_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "amx_tile": "_is_amx_tile_supported",
}


@dataclass(frozen=True)
class CPUFeatures:
    """``flags``: the :data:`FLAGS` this CPU has. ``isa``: the vector level the engine's
    paths use (the CPU's own, or lower where ``KVFERRY_CPU_ISA`` caps it; ``forced`` is that
    cap, None without one). ``native_bf16``: whether bf16 GEMMs run on bf16 instructions at
    the level used (AVX512_BF16 or AMX-BF16, and ``isa`` is ``avx512``). ``vendor``:
    ``/proc/cpuinfo``'s ``vendor_id`` (e.g. ``GenuineIntel``, ``AuthenticAMD``; empty where
    unknown): MKL, which torch's dense GEMMs use, takes its best kernels on Intel CPUs only."""

    model: str
    flags: frozenset[str]
    isa: ISA
    forced: ISA | None = None
    vendor: str = ""

    @property
    def native_bf16(self) -> bool:
        return self.isa == "avx512" and bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def bf16_dot(self) -> bool:
        """Whether AVX512_BF16's dot products (pairs of bf16 summed into fp32 lanes) are
        there at the level used."""
        return self.isa == "avx512" and "avx512_bf16" in self.flags

    @property
    def amx_bf16(self) -> bool:
        """Whether AMX's bf16 tile products are there at the level used."""
        return self.isa == "avx512" and {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def intel(self) -> bool:
        """Whether the vendor is Intel (MKL's best kernels, and the dense-weight fp32 kernel
        for small steps, are chosen there)."""
        return self.vendor == "GenuineIntel"

    @property
    def cpu_isa(self) -> ISA:
        """The CPU's own level, whatever the cap."""
        return _level(self.flags)

    def as_dict(self) -> dict[str, Any]:
        """Plain values for a benchmark record or a log line."""
        return {
            "cpu_model": self.model,
            "cpu_vendor": self.vendor or "-",
            "cpu_flags": ",".join(f for f in FLAGS if f in self.flags) or "-",
            "isa": self.isa,
            "forced_isa": self.forced or "-",
            "native_bf16": self.native_bf16,
            "bf16_dot": self.bf16_dot,
            "amx_bf16": self.amx_bf16,
        }


def _level(flags: frozenset[str]) -> ISA:
    if "avx512f" in flags and "avx512bw" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "scalar"


def _cpuinfo() -> tuple[str, set[str], str]:
    model, flags, vendor = "", set[str](), ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags, vendor


def _torch_flags() -> set[str]:
    found = set()
    for flag, name in _TORCH_PROBES.items():
        probe = getattr(torch.cpu, name, None)
        try:
            if probe is not None and probe():
                found.add(flag)
        except RuntimeError:
            pass
    if "avx512f" in found:
        found.add("avx512bw")  # torch's AVX-512 level requires BW (and DQ, VL)
    if "avx2" in found:
        found.add("fma")  # torch's AVX2 level requires FMA
    return found


def parse_isa(value: str | None) -> ISA | None:
    """``KVFERRY_CPU_ISA``'s value as a level; None for unset or ``auto``."""
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    v = value.strip().lower()
    for level in ISA_LEVELS:
        if v == level:
            return level
    raise ConfigError(
        f"KVFERRY_CPU_ISA must be one of auto, {', '.join(ISA_LEVELS)}; got {value!r}"
    )


def detect(forced: ISA | None = None) -> CPUFeatures:
    """This CPU's features, with the level capped at ``forced`` (never raised above the CPU's
    own: a cap above it changes nothing)."""
    model, flags, vendor = _cpuinfo()
    have = frozenset((flags & set(FLAGS)) | _torch_flags())
    own = _level(have)
    isa = own
    if forced is not None and ISA_LEVELS.index(forced) < ISA_LEVELS.index(own):
        isa = forced
    return CPUFeatures(model=model, flags=have, isa=isa, forced=forced, vendor=vendor)


@functools.cache
def cpu_features() -> CPUFeatures:
    """:func:`detect` under ``KVFERRY_CPU_ISA``, once per process."""
    return detect(parse_isa(envs.cpu_isa()))
