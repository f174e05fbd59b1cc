"""The C kernels: building, caching and falling back; the row-copy kernel's contract."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvferry.config import ModelConfig
from kvferry.model.layers import RMSNorm, RotaryEmbedding, apply_rotary
from kvferry.model.loader import load_model
from kvferry.model.sampler import Sampler, SamplingRow
from kvferry.native import build
from kvferry.native.argmax import load_argmax
from kvferry.native.block_copy import load_block_copy
from kvferry.native.fused_ops import FusedOps, load_fused_ops
from kvferry.native.paged_decode import load_paged_decode
from kvferry.sampling_params import SamplingParams
from kvferry.worker.cpu_features import cpu_features
from kvferry.worker.model_runner import ModelRunner

needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler on this machine"
)


def _cpu_runner(folder: Path, dtype: str) -> ModelRunner:
    """A loaded model as a CPU engine's model runner has tuned it."""
    model = load_model(ModelConfig(model=str(folder), dtype=dtype), torch.device("cpu"))
    return ModelRunner(model, 16, torch.device("cpu"), 0)


def _load(
    monkeypatch: pytest.MonkeyPatch, cache: Path, name: str = "block_copy", **env: str
) -> ctypes.CDLL | None:
    monkeypatch.setenv("KVFERRY_KERNEL_CACHE", str(cache))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return build.load_library(name)


@needs_cc
def test_built_once_then_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _load(monkeypatch, tmp_path) is not None
    (so,) = tmp_path.glob("block_copy-*.so")
    stamp = so.stat().st_mtime_ns
    build._load.cache_clear()  # a new process: finds the cached file, does not rebuild
    assert _load(monkeypatch, tmp_path) is not None
    assert [p.name for p in tmp_path.iterdir()] == [so.name]  # no temp files left behind
    assert so.stat().st_mtime_ns == stamp


def test_disabled_by_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _load(monkeypatch, tmp_path, KVFERRY_NATIVE_KERNELS="0") is None
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_no_compiler_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert _load(monkeypatch, tmp_path, CC="kvferry-no-such-cc") is None
    assert "no C compiler" in caplog.text


@needs_cc
def test_failing_build_falls_back_with_the_compiler_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C;\n")
    monkeypatch.setenv("KVFERRY_KERNEL_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert build.load_library("bad", bad) is None
    assert "building the bad kernel failed" in caplog.text and "error" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))


@needs_cc
def test_paged_decode_supports_only_dense_cpu_fp32_and_bf16() -> None:
    kernel = load_paged_decode(cpu_features().isa)
    assert kernel is not None
    cache = torch.zeros(2, 4, 16, 2, 8)
    q = torch.zeros(3, 4, 8)
    assert kernel.supports(cache, q)
    assert kernel.supports(cache.bfloat16(), q.bfloat16())
    assert not kernel.supports(cache.half(), q.half())
    assert not kernel.supports(cache, q.bfloat16())
    assert not kernel.supports(cache[:, :, ::2], q)


@needs_cc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_runner_attaches_the_decode_kernel_on_cpu(
    tiny_model_factory: object, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_model_factory()  # type: ignore[operator]
    runner = _cpu_runner(folder, dtype)
    assert (runner.attn_workspace.decode_kernel is not None) == (dtype != "float16")
    monkeypatch.setenv("KVFERRY_NATIVE_KERNELS", "0")
    runner = _cpu_runner(folder, dtype)
    assert runner.attn_workspace.decode_kernel is None


@needs_cc
def test_row_copy_merges_runs_and_checks_ids() -> None:
    kernel = load_block_copy()
    assert kernel is not None
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(50, 3, 5, generator=g), torch.randn(50, 7, generator=g).double()]
    dsts = [torch.zeros(40, 3, 5), torch.zeros(40, 7, dtype=torch.float64)]
    plan = kernel.plan(list(zip(srcs, dsts, strict=True)))
    src_ids = np.array([3, 4, 5, 6, 40, 41, 0, 49, 17])
    dst_ids = np.array([10, 11, 12, 13, 0, 1, 39, 2, 20])
    plan.copy(src_ids, dst_ids, threads=2)
    for s, d in zip(srcs, dsts, strict=True):
        assert torch.equal(d[dst_ids], s[src_ids])
        rest = sorted(set(range(40)) - set(dst_ids.tolist()))
        assert not d[rest].any()
    with pytest.raises(IndexError, match="out of range"):
        plan.copy(np.array([0]), np.array([40]))
    with pytest.raises(IndexError, match="out of range"):
        plan.copy(np.array([-1]), np.array([0]))
    with pytest.raises(ValueError, match="differ in length"):
        plan.copy(np.array([0, 1]), np.array([0]))
    with pytest.raises(ValueError, match="contiguous"):
        kernel.plan([(srcs[0].transpose(1, 2), dsts[0].transpose(1, 2))])
    with pytest.raises(ValueError, match="rows differ"):
        kernel.plan([(srcs[0], torch.zeros(40, 3, 4))])


def _bf16_close(got: torch.Tensor, want: torch.Tensor, share: float, steps: int) -> None:
    """bf16 ``got`` equals ``want`` but for at most ``share`` of the elements, which are at most
    ``steps`` bf16 steps off."""
    assert got.dtype == want.dtype == torch.bfloat16
    off = got != want
    assert off.float().mean().item() <= share
    # a bf16 step is at most 2**-7 of the value
    rel = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
    assert not off.any() or rel[off].max().item() <= steps * 2**-7


@needs_cc
@pytest.mark.parametrize("rows", [1, 7, 64, 600])  # 600 x 256 takes the threaded path
def test_fused_ops_match_the_torch_ops(rows: int) -> None:
    ops = load_fused_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(rows)
    dim, heads, head_dim = 256, 6, 64
    weight = 1.0 + 0.2 * torch.randn(dim, generator=gen)
    norm = RMSNorm(dim, eps=1e-5)
    norm.weight.data = weight
    # Strided rows: views into wider buffers, as the layers pass them.
    x = torch.randn(rows, dim + 32, generator=gen)[:, :dim]
    residual = torch.randn(rows, dim + 8, generator=gen)[:, 8:]
    want_sum = x + residual
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), norm(x), atol=1e-5, rtol=1e-5)
    before = residual.clone()
    got = ops.add_rms_norm_(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(got, norm(want_sum), atol=1e-5, rtol=1e-5)
    assert not torch.equal(residual, before)

    qkv = torch.randn(rows, (heads + 2) * head_dim, generator=gen)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    cos, sin = rope.cos_sin(positions, torch.float32)
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    want = apply_rotary(qk, cos, sin)
    tail = qkv[:, heads * head_dim :].clone()
    assert ops.rotary_(qk, cos, sin) is qk
    torch.testing.assert_close(qk, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, heads * head_dim :], tail)  # the v part is untouched

    gate_up = torch.randn(rows, 2 * 688 + 16, generator=gen)[:, : 2 * 688]
    want_act = F.silu(gate_up[:, :688]) * gate_up[:, 688:]
    torch.testing.assert_close(ops.silu_mul(gate_up), want_act, atol=1e-5, rtol=1e-5)


def _portable_fused_ops(tmp_path: Path) -> FusedOps:
    """The fused ops built with their portable bf16 loops (what CPUs without AVX512_BF16 run),
    so that every CPU checks them."""
    src = tmp_path / "fused_ops_portable.c"
    # The whole source, not an #include of it: the build cache is keyed by the file's text.
    src.write_text("#define KVF_PORTABLE_BF16 1\n" + (build.CSRC / "fused_ops.c").read_text())
    lib = build.load_library("fused_ops_portable", source=src)
    assert lib is not None
    return FusedOps(lib)


@needs_cc
@pytest.mark.parametrize("build_kind", ["native", "portable"])
# 1024 / 64 / 2048: whole vectors; 1000 / 40 / 1009: the vector loops' scalar tails
@pytest.mark.parametrize("dims", [(1024, 64, 2048), (1000, 40, 1009)])
@pytest.mark.parametrize("rows", [1, 7, 600])  # 600 x 1000 takes the threaded path
def test_bf16_fused_ops_round_where_the_torch_ops_do(
    rows: int, dims: tuple[int, int, int], build_kind: str, tmp_path: Path
) -> None:
    """bf16: the same bits as the torch ops (Hugging Face's rounding after every op), but for
    rare results one bf16 step apart where fp32 evaluation order differs (sum of squares,
    exp)."""
    ops = load_fused_ops() if build_kind == "native" else _portable_fused_ops(tmp_path)
    assert ops is not None
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(rows)
    dim, head_dim, inter = dims
    heads = 6
    norm = RMSNorm(dim, eps=1e-6).to(bf)
    norm.weight.data = (1.0 + 0.2 * torch.randn(dim, generator=gen)).to(bf)
    x = torch.randn(rows, dim + 32, generator=gen).to(bf)[:, :dim]
    residual = (3 * torch.randn(rows, dim, generator=gen)).to(bf)
    want_sum = x + residual
    got = ops.add_rms_norm_(x, residual, norm.weight, 1e-6)
    assert torch.equal(residual, want_sum)

    _bf16_close(got, norm(want_sum), 1e-3, 1)
    _bf16_close(ops.rms_norm(x, norm.weight, 1e-6), norm(x), 1e-3, 1)

    rope = RotaryEmbedding(head_dim, 4096, 10000.0)
    cos, sin = rope.cos_sin(torch.randint(0, 4096, (rows,), generator=gen), bf)
    qkv = torch.randn(rows, (heads + 2) * head_dim, generator=gen).to(bf)
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    want = apply_rotary(qk, cos, sin)
    tail = qkv[:, heads * head_dim :].clone()
    assert apply_rotary(qk, cos, sin, ops) is qk
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, heads * head_dim :], tail)

    gate_up = (3 * torch.randn(rows, 2 * inter, generator=gen)).to(bf)
    # one step in silu(gate) may become two in the rounded product
    _bf16_close(ops.silu_mul(gate_up), F.silu(gate_up[:, :inter]) * gate_up[:, inter:], 3e-3, 2)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 600])  # 600 x 3 x 40 takes the threaded path
def test_fused_rms_norm_of_strided_heads_matches_the_torch_formula(
    rows: int, dtype: torch.dtype
) -> None:
    """Qwen3's per-head q/k norm: heads of a view into a wider qkv row, each normalised on its
    own, into a new contiguous tensor."""
    ops = load_fused_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(rows)
    heads, head_dim, eps = 3, 40, 1e-6
    weight = (1.0 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype)
    qkv = (3 * torch.randn(rows, 7 * head_dim + 4, generator=gen)).to(dtype)
    # k's place in qkv: an offset into the row and a row stride well past heads * head_dim
    x = qkv[:, 2 * head_dim : 5 * head_dim].view(rows, heads, head_dim)
    # (a one-row view gets a packed row stride, which no row ever steps over)
    assert ops.supports_heads(x) and (rows == 1 or x.stride(0) == qkv.stride(0))
    before = qkv.clone()

    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    want = weight * h.to(x.dtype)
    got = ops.rms_norm(x, weight, eps)
    assert got.shape == x.shape and got.is_contiguous() and got.dtype == dtype
    assert torch.equal(qkv, before)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        _bf16_close(got, want, 1e-3, 1)

    # Through the layer: the heads view takes the kernel, a layout it cannot take the torch ops.
    norm = RMSNorm(head_dim, eps=eps).to(dtype)
    norm.weight.data = weight
    norm.fused = ops
    assert torch.equal(norm(x), got)
    xt = x.transpose(0, 1)
    assert not ops.supports_heads(xt)
    torch.testing.assert_close(norm(xt), want.transpose(0, 1), atol=0, rtol=0)


@needs_cc
def test_fused_ops_serve_only_fp32_and_bf16_cpu_rows() -> None:
    ops = load_fused_ops()
    assert ops is not None
    x = torch.zeros(4, 8)
    assert ops.supports(x) and ops.supports(torch.zeros(4, 16)[:, :8])
    assert ops.supports(x.bfloat16()) and not ops.supports(x.half())
    assert not ops.supports(x.t()) and not ops.supports(x[None])
    h = torch.zeros(4, 3, 8)
    assert ops.supports_heads(h) and ops.supports_heads(torch.zeros(4, 40)[:, :24].view(4, 3, 8))
    assert ops.supports_heads(h.bfloat16())
    assert not ops.supports_heads(h.transpose(0, 1)) and not ops.supports_heads(h.half())
    # Through the layers: an fp16 norm keeps the torch ops.
    norm = RMSNorm(8).half()
    norm.fused = ops
    xh = torch.randn(4, 8).half()
    torch.testing.assert_close(norm(xh), RMSNorm(8).half()(xh), atol=0, rtol=0)
    # A bf16 x with fp32 cos/sin (no such caller) keeps the torch rotary.
    rope = RotaryEmbedding(8, 16, 10000.0)
    cos, sin = rope.cos_sin(torch.arange(4), torch.float32)
    hb = torch.randn(4, 3, 8).bfloat16()
    assert apply_rotary(hb, cos, sin, ops) is not hb


@needs_cc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_runner_attaches_fused_ops_to_fp32_and_bf16_cpu_models(
    tiny_model_factory: object, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_model_factory()  # type: ignore[operator]
    model = _cpu_runner(folder, dtype).model
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all((m.fused is not None) == (dtype != "float16") for m in norms)
    monkeypatch.setenv("KVFERRY_NATIVE_KERNELS", "0")
    model = _cpu_runner(folder, dtype).model
    assert all(m.fused is None for m in model.modules() if isinstance(m, RMSNorm))


@needs_cc
def test_argmax_matches_torch_including_ties_and_strided_rows() -> None:
    kernel = load_argmax()
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    for rows, cols in [(1, 1), (3, 7), (64, 2048), (5, 40000)]:  # the last one is threaded
        x = torch.randn(rows, cols + 3, generator=gen)[:, :cols]
        assert kernel.supports(x)
        assert torch.equal(kernel(x), x.argmax(-1))
    ties = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -1.0, -2.0]])
    assert kernel(ties).tolist() == [1, 0, 0] == ties.argmax(-1).tolist()
    inf = torch.full((2, 9), float("-inf"))
    inf[1, 4] = float("inf")
    assert kernel(inf).tolist() == [0, 4]
    nan = torch.randn(2, 100, generator=gen)
    nan[0, 10] = float("nan")
    assert all(0 <= i < 100 for i in kernel(nan).tolist())  # garbage in, an index out
    assert (
        not kernel.supports(x.double())
        and not kernel.supports(x.t())
        and not kernel.supports(torch.zeros(3, 0))
    )


@needs_cc
def test_sampler_with_the_argmax_kernel_picks_the_same_tokens() -> None:
    kernel = load_argmax()
    logits = torch.randn(16, 3000, generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=2), None) for _ in range(16)]
    plain = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    fast = Sampler(torch.Generator().manual_seed(0), argmax=kernel)(logits, rows)
    assert fast.token_ids == plain.token_ids == logits.argmax(-1).tolist()
    assert fast.logprobs == plain.logprobs


@needs_cc
@pytest.mark.parametrize(
    ("dtype", "build_kind"),
    [(torch.float32, "native"), (torch.bfloat16, "native"), (torch.bfloat16, "portable")],
)
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: the vector loops' scalar tails
@pytest.mark.parametrize("rows", [1, 5, 600])  # 600 x 8 x 64 takes the threaded path
def test_fused_qk_norm_rotary_is_the_norm_then_the_rotary(
    rows: int, head_dim: int, dtype: torch.dtype, build_kind: str, tmp_path: Path
) -> None:
    """Qwen3's q/k norm and rotary in one call, in place in the qkv row: the same bits as the
    norm and rotary kernels one after the other, and v untouched."""
    ops = load_fused_ops() if build_kind == "native" else _portable_fused_ops(tmp_path)
    assert ops is not None
    gen = torch.Generator().manual_seed(rows)
    q_heads, k_heads, eps = 6, 2, 1e-6
    q_weight = (1.0 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype)
    k_weight = (1.0 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype)
    qkv = (3 * torch.randn(rows, (q_heads + 2 * k_heads) * head_dim, generator=gen)).to(dtype)
    qk = qkv[:, : (q_heads + k_heads) * head_dim].view(rows, -1, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0)
    cos, sin = rope.cos_sin(torch.randint(0, 4096, (rows,), generator=gen), dtype)
    want_q = ops.rotary_(ops.rms_norm(qk[:, :q_heads], q_weight, eps), cos, sin)
    want_k = ops.rotary_(ops.rms_norm(qk[:, q_heads:], k_weight, eps), cos, sin)
    v = qkv[:, (q_heads + k_heads) * head_dim :].clone()
    assert ops.qk_norm_rotary_(qk, q_heads, q_weight, k_weight, eps, cos, sin) is qk
    if dtype == torch.bfloat16 or head_dim == 64:
        assert torch.equal(qk[:, :q_heads], want_q) and torch.equal(qk[:, q_heads:], want_k)
    else:  # fp32 tails: the compiler may order the sum of squares differently per call site
        torch.testing.assert_close(qk[:, :q_heads], want_q, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(qk[:, q_heads:], want_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, (q_heads + k_heads) * head_dim :], v)
