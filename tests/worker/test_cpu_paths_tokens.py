"""Every CPU path a model can take gives the same greedy tokens.

bf16: oneDNN-packed bf16 weights and torch's bf16 product (native bf16 CPUs; with AMX also
the AMX prefill attention kernel, and torch's SDPA in its place, and steps padded to a
multiple of 16 rows), the C kernel's
AVX2 and portable variants (forced with KVFERRY_CPU_ISA), the C kernel with widening for large
steps, and widening alone (the kernel unbuildable). fp32: the small-step C kernel in front of
oneDNN (the AVX2 level), oneDNN alone (AVX-512, or the kernel unbuildable), oneDNN for small
steps with MKL for the rest (below AVX2), and steps padded to a multiple of 8 rows (AVX-512). The other C kernels stay on in every run: they round
differently from the torch ops they replace, which is not what this compares.

bf16 paths sum in fp32 in different orders and round each layer's output to bf16, so two of
them may break a near-tie between the two likeliest tokens differently: there, and only there,
their greedy outputs may part (see :func:`assert_same_greedy`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvferry import LLM, SamplingParams
from kvferry.worker import cpu_backend
from kvferry.worker import cpu_features as cf

PROMPTS = [[5, 6, 7, 8, 9] * 8, [100, 200, 300], list(range(40, 75))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
# How close (in log-probability) the two likeliest tokens must be for bf16 paths to part there:
# a few bf16 rounding steps of a logit near 1.
BF16_TIE = 0.05

Outputs = list[tuple[list[int], list[dict[int, float]]]]


@pytest.fixture(autouse=True)
def fresh_features() -> Iterator[None]:
    cf.cpu_features.cache_clear()
    yield
    cf.cpu_features.cache_clear()


def generate(
    folder: Path, caplog: pytest.LogCaptureFixture, dtype: str = "bfloat16"
) -> tuple[Outputs, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvferry"):
        llm = LLM(model=str(folder), dtype=dtype, max_model_len=256)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU paths")]
    assert len(lines) == 1
    # The same facts stay readable for benchmark records.
    backend = llm.engine.executor.worker.model_runner.cpu_backend
    assert backend is not None and f"linear={backend.describe()['linear']}" in lines[0]
    got = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs or []) for o in outs]
    return got, lines[0]


def _lead(step: dict[int, float], chosen: int, other: int) -> float:
    """How far the chosen token's log-probability lies above ``other``'s (infinite when
    ``other`` is not among the step's two likeliest)."""
    return step[chosen] - step[other] if other in step else float("inf")


def assert_same_greedy(got: Outputs, want: Outputs, tie: float, where: object) -> None:
    """Token for token equal, except that a request may part at a near-tie: where the two
    sequences first differ, each run's pick must lead the other's by less than ``tie`` in
    that run's own log-probabilities."""
    for (g_ids, g_lp), (w_ids, w_lp) in zip(got, want, strict=True):
        assert len(g_ids) == len(w_ids), where
        i = next((i for i, (a, b) in enumerate(zip(g_ids, w_ids, strict=True)) if a != b), None)
        if i is None:
            continue
        leads = (_lead(w_lp[i], w_ids[i], g_ids[i]), _lead(g_lp[i], g_ids[i], w_ids[i]))
        assert max(leads) < tie, (where, i, g_ids, w_ids, leads)


def test_every_bf16_path_gives_the_same_tokens(
    tiny_model_factory: Callable[..., Path],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = tiny_model_factory("qwen3", tie_word_embeddings=True)
    want, line = generate(folder, caplog)
    own = cf.cpu_features()
    runs = {"auto": line}
    # (level cap, whether the bf16 kernel builds, its row limit): 8 rows sends the prefill
    # steps to the widening branch and keeps decode on the kernel.
    cases: list[tuple[str, bool, int]] = [("scalar", True, 128)]
    if own.cpu_isa != "scalar":
        cases += [("avx2", True, 128), ("avx2", True, 8), ("avx2", False, 128)]
    real_loader = cpu_backend.load_bf16_linear
    for isa, kernel, max_rows in cases:
        monkeypatch.setenv("KVFERRY_CPU_ISA", isa)
        monkeypatch.setattr(cpu_backend, "BF16_KERNEL_MAX_ROWS", max_rows)
        monkeypatch.setattr(
            cpu_backend, "load_bf16_linear", real_loader if kernel else lambda variant: None
        )
        cf.cpu_features.cache_clear()
        got, line = generate(folder, caplog)
        runs[f"{isa}-{kernel}-{max_rows}"] = line
        assert_same_greedy(got, want, BF16_TIE, (isa, kernel, max_rows, line))
        assert "native_bf16=False" in line and f"isa={isa}" in line
        assert "prefill_attention=c-paged" in line and "row_pad" not in line
        if kernel:
            assert f"linear=c-bf16-{isa}<={max_rows}rows" in line
        else:
            assert "linear=torch-bfloat16,widen" in line and "logits=fp32-copy" in line
    # With AMX, the AMX kernel serves prefills (bf16 tile products), the C kernel elsewhere;
    # without the AMX kernel, torch's SDPA (its flash attention, on tiles too).
    prefill = "c-paged-amx" if own.amx_bf16 else "c-paged"
    assert f"prefill_attention={prefill}" in runs["auto"]
    if own.amx_bf16:
        monkeypatch.setenv("KVFERRY_CPU_ISA", "avx512")  # this CPU's own level
        monkeypatch.setattr(cpu_backend, "load_bf16_linear", real_loader)
        real_amx = cpu_backend.load_paged_prefill_amx
        monkeypatch.setattr(cpu_backend, "load_paged_prefill_amx", lambda: None)
        cf.cpu_features.cache_clear()
        got, line = generate(folder, caplog)
        assert "prefill_attention=torch-sdpa" in line
        assert_same_greedy(got, want, BF16_TIE, ("sdpa", line))
        monkeypatch.setattr(cpu_backend, "load_paged_prefill_amx", real_amx)
    if own.native_bf16:  # the auto run took the packed bf16 weights
        assert any(
            f"linear={p}" in runs["auto"]
            for p in ("onednn-bfloat16-packed", "c-bf16-avx512bf16<=", "c-bf16-amx<=")
        )
    # Without the AMX GEMM kernel, with AMX, oneDNN's packed weights serve steps up to
    # BF16_AMX_PACKED_MAX_ROWS, the plain ones (torch's product) the larger ones.
    chosen = cpu_backend.BF16_AMX_PACKED_MAX_ROWS
    packed = f"onednn-bfloat16-packed<={chosen}rows,torch" if own.amx_bf16 else ""
    packed = packed or "onednn-bfloat16-packedall-rows"
    if own.amx_bf16 and own.bf16_dot:
        # As chosen: the small-step AMX kernel, then the AMX GEMM kernel on its packed copy,
        # then torch's product on the plain weight; the logits have no packed copy.
        small = cpu_backend.BF16_AMX_GEMM_MIN_ROWS - 1
        gemm = f"c-bf16-amx-gemm<={cpu_backend.BF16_AMX_GEMM_MAX_ROWS}rows,torch"
        assert f"linear=c-bf16-amx<={small}rows,{gemm}" in runs["auto"]
        assert f"logits=c-bf16-amx<={small}rows,torch" in runs["auto"]
        monkeypatch.delenv("KVFERRY_CPU_ISA")
        cf.cpu_features.cache_clear()
        # The GEMM kernel for every step of 4 rows or more (the prefills: 78 rows), and for
        # 4-8 rows only (the prefills on the plain weights), each step past 3 rows padded.
        chosen_gemm = cpu_backend.BF16_AMX_GEMM_MIN_ROWS, cpu_backend.BF16_AMX_GEMM_MAX_ROWS
        for gemm_min, gemm_max in [(4, 2048), (4, 8)]:
            monkeypatch.setattr(cpu_backend, "BF16_AMX_GEMM_MIN_ROWS", gemm_min)
            monkeypatch.setattr(cpu_backend, "BF16_AMX_GEMM_MAX_ROWS", gemm_max)
            got, line = generate(folder, caplog)
            assert_same_greedy(got, want, BF16_TIE, ("gemm", gemm_min, gemm_max, line))
            path = f"c-bf16-amx<={gemm_min - 1}rows,c-bf16-amx-gemm<={gemm_max}rows,torch"
            assert f"linear={path}" in line
            assert f"row_pad={cpu_backend.BF16_AMX_ROW_MULTIPLE}>={gemm_min}rows" in line
        monkeypatch.setattr(cpu_backend, "BF16_AMX_GEMM_MIN_ROWS", chosen_gemm[0])
        monkeypatch.setattr(cpu_backend, "BF16_AMX_GEMM_MAX_ROWS", chosen_gemm[1])
        real_gemm = cpu_backend.load_bf16_amx_gemm
        monkeypatch.setattr(cpu_backend, "load_bf16_amx_gemm", lambda: None)
        # The AMX kernel in front of the packed weights: as chosen, for every step up to 2,048
        # rows (prefill included), and not at all (the dot-product kernel takes one-row steps);
        # and with the plain weights from 9 rows up (every prefill step here).
        cf.cpu_features.cache_clear()
        got, line = generate(folder, caplog)
        assert f"linear=c-bf16-amx<={cpu_backend.BF16_AMX_MAX_ROWS}rows,{packed}" in line
        for amx_rows, kernel, packed_rows in [
            (2048, True, chosen),
            (0, False, chosen),
            (4, True, 8),
        ]:
            monkeypatch.setattr(cpu_backend, "BF16_AMX_MAX_ROWS", amx_rows)
            monkeypatch.setattr(cpu_backend, "BF16_AMX_PACKED_MAX_ROWS", packed_rows)
            monkeypatch.setattr(
                cpu_backend,
                "load_bf16_linear",
                lambda variant, ok=kernel: real_loader(variant) if ok or variant != "amx" else None,
            )
            got, line = generate(folder, caplog)
            assert_same_greedy(got, want, BF16_TIE, ("amx", amx_rows, kernel, line))
            first = f"c-bf16-amx<={amx_rows}rows" if kernel else "c-bf16-avx512bf16<=1rows"
            assert f"linear={first},onednn-bfloat16-packed<={packed_rows}rows,torch" in line
            # Steps past the AMX kernel's rows run on rows padded to a multiple of 16 (with
            # 4 rows, every prefill step here).
            assert f"row_pad={cpu_backend.BF16_AMX_ROW_MULTIPLE}>={amx_rows + 1}rows" in line
        monkeypatch.setattr(cpu_backend, "BF16_AMX_PACKED_MAX_ROWS", chosen)
        monkeypatch.setattr(cpu_backend, "load_bf16_amx_gemm", real_gemm)
    if own.bf16_dot:
        # The dot-product kernel in front of the packed weights: for one-row steps (as
        # chosen), for every step up to 64 rows (prefill included), and not at all.
        monkeypatch.delenv("KVFERRY_CPU_ISA", raising=False)
        cf.cpu_features.cache_clear()
        # The AMX kernel (where there is one) is left out, as on a CPU without AMX.
        for dot_rows, kernel in [(1, True), (64, True), (1, False)]:
            monkeypatch.setattr(cpu_backend, "BF16_DOT_MAX_ROWS", dot_rows)
            monkeypatch.setattr(
                cpu_backend,
                "load_bf16_linear",
                lambda variant, ok=kernel: (
                    real_loader(variant) if ok and variant != "amx" else None
                ),
            )
            got, line = generate(folder, caplog)
            assert_same_greedy(got, want, BF16_TIE, ("dot", dot_rows, kernel, line))
            path = f"c-bf16-avx512bf16<={dot_rows}rows,{packed}" if kernel else packed
            assert f"linear={path} logits={path}" in line and "native_bf16=True" in line


def test_every_fp32_path_gives_the_same_tokens(
    tiny_model_factory: Callable[..., Path],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = tiny_model_factory("llama", tie_word_embeddings=True)
    own = cf.cpu_features()
    if own.cpu_isa == "scalar":
        pytest.skip("needs an AVX2 CPU")
    real_loader = cpu_backend.load_f32_linear
    real_panels = cpu_backend.load_f32_panel_linear
    want: Outputs | None = None
    # (level cap, whether the dense-weight kernel builds, whether the panel kernel does, the
    # linear path the backend must log)
    small = f"c-f32-avx2<={cpu_backend.F32_KERNEL_MAX_ROWS}rows,"
    onednn = "onednn-float32-packedall-rows"
    cases = [
        ("avx2", True, True, small + onednn),
        ("avx2", False, True, onednn),
        ("scalar", True, True, f"onednn-float32-packed<={cpu_backend.PACKED_MAX_ROWS}rows,torch"),
    ]
    if own.vendor == "GenuineIntel":  # MKL's GEMM on the dense weight for the longest steps
        onednn = f"onednn-float32-packed<={cpu_backend.F32_INTEL_DENSE_MIN_ROWS - 1}rows,torch"
    if own.cpu_isa == "avx512":
        dense = f"c-f32-avx512<={cpu_backend.F32_KERNEL_MAX_ROWS_AVX512}rows,"
        panels = f"c-f32-panels<={cpu_backend.F32_PANEL_MAX_ROWS}rows,"
        # The dense-weight kernel serves 1-2-row steps in front of the panels on Intel only.
        ahead = dense if own.intel else ""
        cases.append(("avx512", True, True, ahead + panels + onednn))
        cases.append(("avx512", False, True, panels + onednn))
        cases.append(("avx512", True, False, dense + onednn))
        cases.append(("avx512", False, False, onednn))
    for isa, kernel, panel, path in cases:
        monkeypatch.setenv("KVFERRY_CPU_ISA", isa)
        monkeypatch.setattr(
            cpu_backend, "load_f32_linear", real_loader if kernel else lambda variant: None
        )
        monkeypatch.setattr(
            cpu_backend, "load_f32_panel_linear", real_panels if panel else lambda: None
        )
        cf.cpu_features.cache_clear()
        got, line = generate(folder, caplog, dtype="float32")
        assert f"linear={path} logits={path}" in line, (isa, kernel, panel, line)
        want = want or got
        assert [ids for ids, _ in got] == [ids for ids, _ in want], (isa, kernel, panel, line)
    if own.cpu_isa == "avx512":
        # Every step of 8 rows or more padded to a multiple of 8 (from 256 rows as chosen).
        monkeypatch.setenv("KVFERRY_CPU_ISA", "avx512")
        monkeypatch.setattr(cpu_backend, "F32_PAD_MIN_ROWS", 8)
        cf.cpu_features.cache_clear()
        got, line = generate(folder, caplog, dtype="float32")
        assert "row_pad=8>=8rows" in line, line
        assert [ids for ids, _ in got] == [ids for ids, _ in want], line
