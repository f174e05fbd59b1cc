"""CPU feature detection, the KVFERRY_CPU_ISA cap, and the start-up line of chosen paths."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry.config import ConfigError
from kvferry.worker import cpu_features as cf
from kvferry.worker.cpu_backend import CPUBackend


def test_parse_isa() -> None:
    assert cf.parse_isa(None) is None and cf.parse_isa("auto") is None
    assert cf.parse_isa(" AVX2 ") == "avx2"
    with pytest.raises(ConfigError, match="KVFERRY_CPU_ISA"):
        cf.parse_isa("sse9")


def test_level_from_flags() -> None:
    assert cf._level(frozenset({"avx2", "fma", "avx512f", "avx512bw"})) == "avx512"
    assert cf._level(frozenset({"avx2", "fma", "avx512f"})) == "avx2"
    assert cf._level(frozenset({"avx2"})) == "scalar"


def test_native_bf16_needs_avx512_level_and_bf16_instructions() -> None:
    flags = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"})
    assert cf.CPUFeatures("x", flags, "avx512").native_bf16
    assert not cf.CPUFeatures("x", flags, "avx2", forced="avx2").native_bf16
    assert not cf.CPUFeatures("x", flags - {"avx512_bf16"}, "avx512").native_bf16
    assert cf.CPUFeatures("x", flags - {"avx512_bf16"} | {"amx_bf16"}, "avx512").native_bf16


def test_bf16_dot_needs_avx512_level_and_avx512_bf16() -> None:
    flags = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"})
    assert cf.CPUFeatures("x", flags, "avx512").bf16_dot
    assert not cf.CPUFeatures("x", flags, "avx2", forced="avx2").bf16_dot
    # AMX alone is a tile unit, not the dot-product instructions the C kernel uses.
    assert not cf.CPUFeatures("x", flags - {"avx512_bf16"} | {"amx_bf16"}, "avx512").bf16_dot


def test_amx_bf16_needs_avx512_level_and_both_tile_flags() -> None:
    flags = frozenset({"avx2", "fma", "avx512f", "avx512bw", "amx_tile", "amx_bf16"})
    assert cf.CPUFeatures("x", flags, "avx512").amx_bf16
    assert not cf.CPUFeatures("x", flags, "avx2", forced="avx2").amx_bf16
    assert not cf.CPUFeatures("x", flags - {"amx_tile"}, "avx512").amx_bf16
    assert not cf.CPUFeatures("x", flags - {"amx_bf16"} | {"avx512_bf16"}, "avx512").amx_bf16


def test_vendor_from_cpuinfo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Some Xeon\n"
        "flags\t\t: fpu avx2 fma avx512f avx512bw\n\nprocessor\t: 1\n"
        "vendor_id\t: Other\n"
    )
    real_open = open

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        return real_open(info if path == "/proc/cpuinfo" else path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    got = cf.detect()
    assert (got.vendor, got.model) == ("GenuineIntel", "Some Xeon")
    assert got.as_dict()["cpu_vendor"] == "GenuineIntel"
    assert {"avx512f", "avx512bw"} <= got.flags
    info.write_text("processor\t: 0\n")  # no vendor line (e.g. some ARM kernels)
    assert cf.detect().vendor == "" and cf.detect().as_dict()["cpu_vendor"] == "-"


def test_cap_lowers_and_never_raises_the_level() -> None:
    own = cf.detect()
    assert own.isa == own.cpu_isa and own.forced is None
    scalar = cf.detect("scalar")
    assert scalar.isa == "scalar" and not scalar.native_bf16 and scalar.flags == own.flags
    top = cf.detect("avx512")
    assert top.isa == own.isa  # a cap above the CPU changes nothing


def test_env_cap_applies_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_CPU_ISA", "scalar")
    cf.cpu_features.cache_clear()
    try:
        assert cf.cpu_features().isa == "scalar"
        assert cf.cpu_features().as_dict()["forced_isa"] == "scalar"
    finally:
        cf.cpu_features.cache_clear()


def test_start_up_line_names_features_and_paths(
    tiny_model_factory, caplog: pytest.LogCaptureFixture
) -> None:
    from kvferry.config import ModelConfig
    from kvferry.model.loader import load_model

    model = load_model(
        ModelConfig(str(tiny_model_factory("llama")), dtype="float32"), torch.device("cpu")
    )
    backend = CPUBackend(torch.float32)
    with caplog.at_level(logging.INFO, logger="kvferry"):
        backend.prepare_model(model)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU paths")]
    assert len(lines) == 1
    facts = backend.describe()
    keys = ("cpu_model", "cpu_flags", "isa", "native_bf16", "linear", "logits", "argmax", "malloc")
    for key in keys:
        assert key in facts and f"{key}=" in lines[0]


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_fp32_row_padding_at_the_avx512_level_by_vendor(tiny_model_factory, vendor: str) -> None:
    """fp32 at the AVX-512 level pads steps from 256 rows to a multiple of 8; on Intel only up
    to the rows oneDNN serves, since MKL's GEMM takes longer steps unpadded."""
    from kvferry.config import ModelConfig
    from kvferry.model.loader import load_model
    from kvferry.worker import cpu_backend

    model = load_model(
        ModelConfig(str(tiny_model_factory("llama")), dtype="float32"), torch.device("cpu")
    )
    cpu = cf.CPUFeatures(model="x", flags=frozenset({"avx512f"}), isa="avx512", vendor=vendor)
    backend = CPUBackend(torch.float32, native_kernels=False, features=cpu)
    backend.prepare_model(model)
    assert model.model.row_multiple == cpu_backend.F32_ROW_MULTIPLE
    assert model.model.pad_min_rows == cpu_backend.F32_PAD_MIN_ROWS
    if vendor == "GenuineIntel":
        dense = cpu_backend.F32_INTEL_DENSE_MIN_ROWS
        assert model.model.pad_max_rows == dense - 1 == cpu_backend.packed_max_rows(cpu)
        assert (dense - 1) % cpu_backend.F32_ROW_MULTIPLE == 0  # padded steps stay on oneDNN
        assert backend.describe()["row_pad"].endswith(f"<={dense - 1}rows")
    else:
        assert model.model.pad_max_rows is None
        assert cpu_backend.packed_max_rows(cpu) is None
