"""Layer building blocks against Hugging Face's definitions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvferry.model.layers import RMSNorm, RotaryEmbedding, apply_rotary, rope_inv_freq
from kvferry.worker import cpu_backend
from kvferry.worker.cpu_backend import cpu_linear

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_matches_hf(scaling: dict[str, Any] | None) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = transformers.LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        max_position_embeddings=16384,
        rope_theta=500000.0,
        rope_scaling=scaling,
    )
    head_dim = 128
    hf_rope = LlamaRotaryEmbedding(cfg)
    expected_inv = hf_rope.inv_freq
    got_inv = rope_inv_freq(head_dim, 500000.0, scaling, 16384)
    assert torch.equal(got_inv, expected_inv)

    positions = torch.tensor([0, 1, 7, 300, 9000, 16383])
    x = torch.randn(len(positions), 3, head_dim)
    cos, sin = hf_rope(x, positions[None])
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    ours = RotaryEmbedding(head_dim, 16384, 500000.0, scaling)
    c, s = ours.cos_sin(positions, x.dtype)
    assert torch.equal(apply_rotary(x, c, s), expected[0].transpose(0, 1))


def test_rms_norm_matches_hf() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        hf = LlamaRMSNorm(64, eps=1e-5)
        ours = RMSNorm(64, eps=1e-5)
        w = torch.randn(64)
        hf.weight.data.copy_(w)
        ours.weight.data.copy_(w)
        hf.to(dtype)
        ours.to(dtype)
        x, r = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
        assert torch.equal(ours(x), hf(x))
        normed, summed = ours.add_norm(x, r)
        assert torch.equal(summed, x + r) and torch.equal(normed, hf(x + r))


@pytest.mark.parametrize("rows", [1, 64])
def test_half_precision_linear(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(rows, 96).bfloat16()
    w, b = torch.randn(40, 96).bfloat16(), torch.randn(40).bfloat16()
    exact = F.linear(x.double(), w.double(), b.double())
    for native in (True, False):
        monkeypatch.setitem(cpu_backend._NATIVE_HALF, torch.bfloat16, native)
        out = cpu_linear(x, w, b)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), exact, atol=0.1, rtol=1e-2)


@pytest.mark.parametrize(
    "rows", [1, 8, cpu_backend.PACKED_MAX_ROWS, cpu_backend.PACKED_MAX_ROWS + 1]
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_fp32_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(rows, 32, generator=g)
    packed = cpu_backend.pack_weight(w)
    if packed is None:
        pytest.skip("this torch build has no oneDNN")
    want = F.linear(x, w, b)
    got = cpu_linear(x, cpu_backend.input_major(w), b, packed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # A non-contiguous input (a column slice, as attention outputs can be) works too.
    wide = torch.randn(rows, 64, generator=g)
    got = cpu_linear(wide[:, :32], w, b, packed)
    torch.testing.assert_close(got, F.linear(wide[:, :32], w, b))


def test_packed_weight_serves_every_step_from_avx2_up() -> None:
    def features(isa: str) -> cpu_backend.CPUFeatures:
        return cpu_backend.CPUFeatures(model="x", flags=frozenset(), isa=isa, forced=None)  # type: ignore[arg-type]

    assert cpu_backend.packed_max_rows(features("avx512")) is None
    assert cpu_backend.packed_max_rows(features("avx2")) is None
    assert cpu_backend.packed_max_rows(features("scalar")) == cpu_backend.PACKED_MAX_ROWS
    amx = cpu_backend.CPUFeatures(
        model="x",
        flags=frozenset({"avx512f", "amx_tile", "amx_bf16"}),
        isa="avx512",  # type: ignore[arg-type]
        forced=None,
    )
    assert cpu_backend.packed_max_rows(amx) is None  # fp32
    bf16 = cpu_backend.packed_max_rows(amx, torch.bfloat16)
    assert bf16 == cpu_backend.BF16_AMX_PACKED_MAX_ROWS
    assert cpu_backend.packed_max_rows(features("avx512"), torch.bfloat16) is None
    # fp32 on Intel at the AVX-512 level: MKL's GEMM on the dense weight from 513 rows on.
    for vendor, isa, dtype, want in [
        ("GenuineIntel", "avx512", torch.float32, cpu_backend.F32_INTEL_DENSE_MIN_ROWS - 1),
        ("GenuineIntel", "avx2", torch.float32, None),
        ("GenuineIntel", "avx512", torch.bfloat16, None),
        ("AuthenticAMD", "avx512", torch.float32, None),
    ]:
        cpu = cpu_backend.CPUFeatures(model="x", flags=frozenset(), isa=isa, vendor=vendor)  # type: ignore[arg-type]
        assert cpu_backend.packed_max_rows(cpu, dtype) == want, (vendor, isa, dtype)
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    packed = cpu_backend.pack_weight(w)
    if packed is None:
        pytest.skip("this torch build has no oneDNN")
    x = torch.randn(3 * cpu_backend.PACKED_MAX_ROWS, 32, generator=g)
    torch.testing.assert_close(cpu_linear(x, w, b, packed, max_rows=None), F.linear(x, w, b))
    # A weight it must not read (zeros) proves which path served the step.
    zeros = torch.zeros_like(w)
    torch.testing.assert_close(cpu_linear(x, zeros, b, packed, max_rows=None), F.linear(x, w, b))
    torch.testing.assert_close(cpu_linear(x, zeros, b, packed), F.linear(x, zeros, b))
