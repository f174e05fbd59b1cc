"""CPU tuning of a loaded model: weight layouts for the CPU GEMMs and the native kernels.

The model files mirror the Hugging Face architecture and compute with plain torch ops; on a
CPU engine the model runner applies a :class:`CPUBackend` right after loading (before the KV
pool is sized, so the pool is sized from the memory the tuned weights leave). The backend
decides everything here and sets the model's few hooks: ``Linear.kernel``,
``CausalLM.logits_kernel`` and the ``fused`` ops of norms, rotary and MLP; the attention
choices go in the :class:`~kvferry.model.attention_workspace.AttentionWorkspace` the runner
owns, and the greedy argmax in the runner's sampler.

Which path serves what (all on CPU):

* fp32: each linear layer gets a oneDNN-packed copy of its weight. On an AVX2 or AVX-512 CPU
  it serves every step, prefill included (oneDNN's GEMMs beat MKL's on AMD CPUs, where MKL
  takes generic kernels); below AVX2 it serves small steps (decode) and MKL the rest. At the
  AVX2 level, steps of at most :data:`F32_KERNEL_MAX_ROWS` rows (decode, the logits) run a C
  kernel on the dense weight instead, which beats oneDNN there; at the AVX-512 level, on
  Intel CPUs steps of at most :data:`F32_KERNEL_MAX_ROWS_AVX512` rows run its AVX-512
  variant, and steps of up to :data:`F32_PANEL_MAX_ROWS` rows a C kernel on a third copy of
  the weight, laid out in panels of outputs (it overlaps reading the weights with computing
  on them, where oneDNN does one after the other). Where torch has no oneDNN the weight
  becomes input-major instead. Fused norm, rotary and SiLU-and-mul kernels serve the
  elementwise steps. On AVX-512, steps of :data:`F32_PAD_MIN_ROWS` rows or more run on rows
  padded to a multiple of :data:`F32_ROW_MULTIPLE` (bf16 on AMX: steps past the small-step
  kernel's rows, to a multiple of :data:`BF16_AMX_ROW_MULTIPLE`).
* bf16 on AMX: steps of fewer than :data:`BF16_AMX_GEMM_MIN_ROWS` rows (decode, the logits,
  short prompts) run the C kernel's AMX variant on the dense bf16 weight, steps of up to
  :data:`BF16_AMX_GEMM_MAX_ROWS` rows (a prompt of a few hundred tokens) the AMX GEMM kernel
  on its own packed copy of the weight, larger ones oneDNN's GEMM on the dense weight. A layer
  whose sizes the GEMM kernel does not take, or a build without it, keeps the scheme below:
  oneDNN's packed copy up to :data:`BF16_AMX_PACKED_MAX_ROWS` rows, the C kernel up to
  :data:`BF16_AMX_MAX_ROWS`.
* bf16 with native bf16 GEMMs (AVX512_BF16): as fp32, a oneDNN-packed bf16 copy of each
  weight; steps of at most :data:`BF16_DOT_MAX_ROWS` rows (a lone decode) run the C kernel's
  AVX512-BF16 variant on the dense weight.
* bf16 without them (e.g. AVX2 only, or ``KVFERRY_CPU_ISA=avx2``): steps of at most
  :data:`BF16_KERNEL_MAX_ROWS` rows, the logits included, run the C kernel that reads the bf16
  weights as they are and widens them in registers (the variant of the CPU's level); larger
  steps widen the weight to fp32 for the call and run oneDNN's fp32 GEMM on it, as does every
  step where the kernel cannot be built (the logits then keep a persistent packed fp32 copy).
* fp16 without native fp16 GEMMs: weights are widened to fp32 per call for steps large enough
  to gain from it. Half-precision weights keep their layout: without native bf16/fp16 GEMMs a
  transposed one falls onto a much slower path.
* fp32 and bf16: decode attention reads the paged pool in place (C kernel); other decodes are
  gathered a cache-sized chunk of requests at a time.
* every dtype: a layer's new keys and values go into the pool in one C call (two torch index
  copies cost several times as much at decode sizes).
* greedy sampling: a C argmax.

The CPU's features (:mod:`kvferry.worker.cpu_features`) are detected once per process; each
backend logs them with the paths it chose in one line, and :meth:`CPUBackend.describe` gives
the same facts to benchmarks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvferry import envs
from kvferry.logger import fmt_fields, init_logger
from kvferry.model.attention_workspace import AttentionWorkspace
from kvferry.model.layers import GatedMLP, Linear, LinearKernel, RMSNorm
from kvferry.model.llama import CausalLM, DecoderAttention
from kvferry.native.argmax import ArgmaxKernel, load_argmax
from kvferry.native.bf16_amx_gemm import BF16AMXGemmKernel, load_bf16_amx_gemm
from kvferry.native.bf16_linear import BF16LinearKernel, load_bf16_linear
from kvferry.native.f32_linear import load_f32_linear
from kvferry.native.f32_panel_linear import F32PanelLinearKernel, load_f32_panel_linear
from kvferry.native.fused_ops import FusedOps, load_fused_ops
from kvferry.native.kv_write import KVWriteKernel, load_kv_write
from kvferry.native.packed_linear import PackedLinearKernel
from kvferry.native.paged_decode import PagedDecodeKernel, load_paged_decode
from kvferry.native.paged_prefill import (
    PagedPrefillKernel,
    load_paged_prefill,
    load_paged_prefill_amx,
)
from kvferry.native.rows_linear import RowsLinearKernel
from kvferry.worker.cpu_features import CPUFeatures, cpu_features
from kvferry.worker.malloc_tuning import tune_malloc

logger = init_logger(__name__)

# Below AVX2, up to this many rows a oneDNN-packed weight beats MKL on a dense one: the GEMM
# streams the weight from memory, and the blocked layout streams faster.
PACKED_MAX_ROWS = 128
# Below this many rows the half-precision GEMV is memory-bound and beats converting the weight.
_UPCAST_MIN_ROWS = 6
# Target size of one decode gather: small enough to stay in the last-level cache.
DECODE_GATHER_BYTES = 4 << 20
# Largest gate/up buffer of one MLP pass. glibc serves blocks of 32 MiB and up with a fresh
# mmap (its highest threshold), so a 2,048-row prefill's gate/up output (32 MiB on a 2,048-wide
# fp32 MLP) page-faulted in every layer of every step; smaller passes reuse heap memory.
MLP_CHUNK_BYTES = 16 << 20


# Up to this many rows the bf16 C kernel beats widening the weight to fp32 for the call on a
# CPU without bf16 instructions: below it the step is bound by the weight's bytes, which the
# kernel reads once, as bf16; above it the fp32 GEMM's higher arithmetic rate wins.
BF16_KERNEL_MAX_ROWS = 128
# Up to this many rows the fp32 C kernel beats oneDNN's packed GEMM at the AVX2 level, where
# oneDNN's small steps neither stream the weight at the memory rate nor compute at the GEMM
# rate; the two cross near 40 rows on the benchmark models' shapes.
F32_KERNEL_MAX_ROWS = 32
# At the AVX-512 level on Intel CPUs the kernel's AVX-512 variant streams the dense weight at
# the memory rate for steps of one or two rows, 5-10% ahead of the panel kernel there (Intel
# Xeon with AMX); on AMD's Zen 5 the panel kernel is 20-25% ahead at one to four rows, so
# elsewhere the dense kernel serves only where the panel kernel cannot be built.
F32_KERNEL_MAX_ROWS_AVX512 = 2
# At the AVX-512 level, up to this many rows the panel kernel (csrc/f32_panel_linear.c) beats
# oneDNN's packed GEMM with the weights coming from memory, as in an engine step: 1.2-1.5x at
# 8-64 rows, level at 128 (Intel Xeon with AMX, docs/benchmarks.md).
F32_PANEL_MAX_ROWS = 128
# Up to this many rows the bf16 C kernel's AMX variant beats oneDNN's packed bf16 GEMM (on AMX
# as well): it reads each dense weight once, in place, near the memory rate, where oneDNN's
# small steps stay well below it; the two are level at 128 and oneDNN leads at 192 (Intel
# Xeon with AMX, docs/benchmarks.md).
BF16_AMX_MAX_ROWS = 128
# Up to this many rows the bf16 C kernel's dot-product variant beats oneDNN's packed bf16 GEMM
# on a CPU with AVX512_BF16: a one-row step streams the weight once at the memory rate, where
# oneDNN's small-step GEMM (AMX or not) stays below it; from two rows on they are level.
BF16_DOT_MAX_ROWS = 1
# bf16 on AMX: oneDNN's GEMM on the plain weight matches or beats its packed one from 384 rows
# on (prefill), where the packed plans of some shapes run at 0.5-0.65x (the 0.6B o_proj at
# 512-576 rows; Intel Xeon with AMX), so the packed copy serves steps up to here.
BF16_AMX_PACKED_MAX_ROWS = 383
# bf16 on AMX: up to this many rows the AMX GEMM kernel on its own packed copy of the weight
# (csrc/bf16_amx_gemm.c) serves the steps past the small-step kernel's rows, in place of
# oneDNN's packed copy (so the weights still take two copies); oneDNN's GEMM on the plain
# weight serves the larger ones. Over the 0.6B layers' four shapes, weights from memory, the
# kernel runs 1.16x / 1.07x the better of oneDNN's two at 384 / 528 rows, level at 640, 0.9x
# at 768; at 256 rows 0.94x oneDNN's packed GEMM (Intel Xeon with AMX, docs/benchmarks.md).
BF16_AMX_GEMM_MAX_ROWS = 640
# ... and from this many rows on: below, the small-step AMX kernel on the dense weight runs
# level with it or ahead (1.08x at 144 rows, level at 192; the GEMM leads 1.19x at 256).
BF16_AMX_GEMM_MIN_ROWS = 193
# fp32 on an Intel CPU at the AVX-512 level: from this many rows on (a prompt's step with
# decode rows beside it, long prefill steps, MLP passes of 1,024 rows) MKL's GEMM on the dense
# weight (F.linear), which takes its AVX-512 kernels on Intel CPUs only, runs unpadded 2-6%
# ahead of oneDNN's packed one on rows padded to a multiple of 8; at 300-512 rows they are
# level, below 256 oneDNN leads (Intel Xeon with AMX, docs/benchmarks.md). Steps of at most
# 512 rows keep the padding (DecoderModel.pad_max_rows).
F32_INTEL_DENSE_MIN_ROWS = 513
# oneDNN's fp32 AVX-512 GEMM runs some row counts of a prefill step up to 1.4x slower per
# row than the nearest multiple of 8 (e.g. 259, 517 or 533 rows; none below 256 on the Intel
# Xeon with AMX), so such steps run their layers on zero rows appended up to a multiple of 8
# (DecoderModel.row_multiple).
F32_ROW_MULTIPLE = 8
F32_PAD_MIN_ROWS = 256
# bf16 on AMX: oneDNN builds a GEMM plan for each row count the first time it meets one (over
# the 0.6B layers' four shapes ~50 ms, paid by the step that first has that many rows: a
# request's first token), and computes in tiles of 16 rows; so steps past the AMX C kernel's
# rows run on rows padded to a multiple of 16: no more tiles, a 16th of the plans.
BF16_AMX_ROW_MULTIPLE = 16


def _native_fp16_matmul(features: CPUFeatures) -> bool:
    probe = getattr(torch.cpu, "_is_amx_fp16_supported", None)
    try:
        return features.isa == "avx512" and probe is not None and bool(probe())
    except RuntimeError:
        return False


# Whether bf16/fp16 GEMMs run on matrix instructions (AVX512-BF16, AMX) at the level in use.
_NATIVE_HALF = {
    torch.bfloat16: cpu_features().native_bf16,
    torch.float16: _native_fp16_matmul(cpu_features()),
}


def emulated_half_matmul(dtype: torch.dtype) -> bool:
    """True for bf16/fp16 on a CPU that has no matrix instructions for them."""
    return dtype in _NATIVE_HALF and not _NATIVE_HALF[dtype]


def input_major(weight: torch.Tensor) -> torch.Tensor:
    """The same ``(out, in)`` matrix stored column-major (strides ``(1, out)``); ``weight``
    itself when it already is."""
    if weight.stride() == (1, weight.shape[0]):
        return weight
    return weight.t().contiguous().t()


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-blocked copy of an fp32 ``(out, in)`` CPU weight (or a bf16 one, where the CPU
    has bf16 instructions) for :func:`cpu_linear`, or None where this torch build has no
    oneDNN."""
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except (AttributeError, RuntimeError):
        return None
    return packed


def packed_max_rows(features: CPUFeatures, dtype: torch.dtype = torch.float32) -> int | None:
    """Up to how many rows a step uses the oneDNN-packed weight (None: every step). With AVX2
    or AVX-512, oneDNN's GEMMs beat MKL's at every size measured on the AMD CPUs this runs on
    (docs/benchmarks.md); below AVX2, only where the step streams the weight from memory. bf16
    on AMX: up to BF16_AMX_PACKED_MAX_ROWS; fp32 on an Intel CPU at the AVX-512 level: below
    F32_INTEL_DENSE_MIN_ROWS."""
    if dtype == torch.bfloat16 and features.amx_bf16:
        return BF16_AMX_PACKED_MAX_ROWS
    if dtype == torch.float32 and features.isa == "avx512" and features.intel:
        return F32_INTEL_DENSE_MIN_ROWS - 1
    return None if features.isa in ("avx512", "avx2") else PACKED_MAX_ROWS


def cpu_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    emulated: bool | None = None,
    max_rows: int | None = PACKED_MAX_ROWS,
) -> torch.Tensor:
    """``F.linear`` with two CPU fast paths.

    ``packed`` (from :func:`pack_weight`, fp32 or bf16): used for 2-D inputs of at most
    ``max_rows`` rows (None: any; see :func:`packed_max_rows`). A bf16 input meets a bf16
    packed weight as it is; otherwise the input is computed in fp32 and rounded back, as the
    path below does.

    Half precision on a CPU without bf16/fp16 matrix instructions (e.g. AVX2 only): torch
    emulates those GEMMs, far slower than fp32, so the weight is widened to fp32 for the call
    instead: bf16 x bf16 products are exact in fp32 and both paths accumulate in fp32, so the
    result only differs by summation order. ``emulated`` says whether this CPU is such a one
    (default: :func:`emulated_half_matmul`). Elsewhere this is F.linear.
    """
    if packed is not None and x.dim() == 2 and (max_rows is None or x.shape[0] <= max_rows):
        if packed.dtype == x.dtype:
            return _onednn_linear(x, packed, bias)
        b = None if bias is None else bias.float()
        return _onednn_linear(x.float(), packed, b).to(x.dtype)
    if emulated is None:
        emulated = emulated_half_matmul(x.dtype)
    if x.device.type == "cpu" and emulated and x.numel() >= _UPCAST_MIN_ROWS * x.shape[-1]:
        return widened_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _has_onednn_linear() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):
        return False


_ONEDNN_LINEAR = _has_onednn_linear()


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """oneDNN's linear of a 2-D ``x`` with a plain or packed (:func:`pack_weight`) weight of
    ``x``'s dtype."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), weight, bias, "none", [], ""
    )
    return out


def widened_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` of half-precision CPU tensors computed in fp32: the weight is widened for
    the call (exact: a bf16 or fp16 value is an fp32 one) and the result rounded back once.
    oneDNN serves the fp32 product where torch has it, on the widened weight as it is: MKL's,
    which ``F.linear`` takes, ran at 0.45-0.7x its rate on the AMD CPUs measured."""
    b = None if bias is None else bias.float()
    wide = weight.float().contiguous()
    if _ONEDNN_LINEAR and x.dim() == 2:
        return _onednn_linear(x.float(), wide, b).to(x.dtype)
    return F.linear(x.float(), wide, b).to(x.dtype)


class CPULinear:
    """A ``Linear.kernel``: :func:`cpu_linear` with the layer's packed weight, if any, the
    steps it serves, and the backend's answer to whether half-precision products are emulated
    (None: this CPU's)."""

    def __init__(
        self,
        packed: torch.Tensor | None,
        emulated: bool | None = None,
        max_rows: int | None = PACKED_MAX_ROWS,
    ) -> None:
        self.packed = packed
        self.emulated = emulated
        self.max_rows = max_rows

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return cpu_linear(x, weight, bias, self.packed, self.emulated, self.max_rows)


class SmallStepsLinear:
    """A ``Linear.kernel``: a C kernel on the dense weight for 2-D steps of at most
    ``max_rows`` rows, ``rest`` for the others."""

    def __init__(self, kernel: RowsLinearKernel, max_rows: int, rest: LinearKernel) -> None:
        self.kernel = kernel
        self.max_rows = max_rows
        self.rest = rest

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows and self.kernel.supports(x, weight):
            return self.kernel(x, weight, bias)
        return self.rest(x, weight, bias)


class PackedStepsLinear:
    """A ``Linear.kernel``: a C kernel on its own copy of the weight (``packed``, of ``n``
    outputs: the fp32 panel kernel's panels, or the bf16 AMX kernel's tiles) for 2-D steps of
    at most ``max_rows`` rows, ``rest`` for the others."""

    def __init__(
        self,
        kernel: PackedLinearKernel,
        packed: torch.Tensor,
        n: int,
        max_rows: int,
        rest: LinearKernel,
    ) -> None:
        self.kernel = kernel
        self.packed = packed
        self.n = n
        self.max_rows = max_rows
        self.rest = rest

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if (
            x.dim() == 2
            and x.shape[0] <= self.max_rows
            and self.kernel.supports(x, weight.shape[1])
        ):
            return self.kernel(x, self.packed, self.n, bias)
        return self.rest(x, weight, bias)


class BF16Linear(SmallStepsLinear):
    """A ``Linear.kernel`` for bf16 on a CPU without bf16 instructions: the C kernel for 2-D
    steps of at most ``max_rows`` rows (reading the bf16 weight once), the weight widened to
    fp32 for the call otherwise. Both sum exact products in fp32 and round once to bf16."""

    def __init__(self, kernel: BF16LinearKernel, max_rows: int) -> None:
        super().__init__(kernel, max_rows, widened_linear)


class CPUBackend:
    """The CPU choices for a model of ``dtype`` on a CPU with ``features`` (default: this
    one's, under ``KVFERRY_CPU_ISA``). ``native_kernels=False`` keeps torch ops wherever a C
    kernel would serve (weight layouts still apply); ``KVFERRY_NATIVE_KERNELS=0`` has the same
    effect, and a kernel that cannot be built is left out the same way."""

    def __init__(
        self,
        dtype: torch.dtype,
        native_kernels: bool = True,
        features: CPUFeatures | None = None,
    ) -> None:
        self.dtype = dtype
        self.features = features or cpu_features()
        self.fused_ops: FusedOps | None = None
        self.decode_kernel: PagedDecodeKernel | None = None
        self.prefill_kernel: PagedPrefillKernel | None = None
        self.write_kernel: KVWriteKernel | None = None
        self.argmax: ArgmaxKernel | None = None
        # bf16 without bf16 instructions: the kernel that serves every step it supports.
        self.bf16_linear: BF16LinearKernel | None = None
        # A C kernel in front of the packed weights, for steps of at most so many rows.
        self.small_steps: tuple[RowsLinearKernel, int] | None = None
        # fp32 on AVX-512: the panel kernel in front of them instead.
        self.panel_linear: F32PanelLinearKernel | None = None
        # bf16 on AMX: the GEMM kernel for the larger steps, on its copy instead of oneDNN's.
        self.amx_gemm: BF16AMXGemmKernel | None = None
        if dtype == torch.bfloat16:
            self.native_half = self.features.native_bf16
        else:
            self.native_half = dtype == torch.float16 and _native_fp16_matmul(self.features)
        if native_kernels:
            # fp16 keeps the torch ops: no fused kernel rounds the way they do in fp16.
            if dtype in FusedOps.DTYPES:
                self.fused_ops = load_fused_ops()
            if dtype in PagedDecodeKernel.DTYPES:
                self.decode_kernel = load_paged_decode(self.features.isa)
            # With AMX, bf16 products on tiles beat the fp32 arithmetic several times over.
            if dtype == torch.bfloat16 and self.features.amx_bf16:
                self.prefill_kernel = load_paged_prefill_amx()
            elif dtype in PagedPrefillKernel.DTYPES:
                self.prefill_kernel = load_paged_prefill()
            self.write_kernel = load_kv_write()
            small: RowsLinearKernel | None = None
            amx = None
            if dtype == torch.bfloat16 and self.features.amx_bf16 and self.features.bf16_dot:
                amx = load_bf16_linear("amx")
            if dtype == torch.bfloat16 and not self.native_half:
                self.bf16_linear = load_bf16_linear(self.features.isa)
            elif dtype == torch.bfloat16 and amx is not None:
                self.amx_gemm = load_bf16_amx_gemm()
                small = amx
                rows = BF16_AMX_MAX_ROWS if self.amx_gemm is None else BF16_AMX_GEMM_MIN_ROWS - 1
            elif dtype == torch.bfloat16 and self.features.bf16_dot:
                small, rows = load_bf16_linear("avx512bf16"), BF16_DOT_MAX_ROWS
            elif dtype == torch.float32 and self.features.isa == "avx2":
                small, rows = load_f32_linear("avx2"), F32_KERNEL_MAX_ROWS
            elif dtype == torch.float32 and self.features.isa == "avx512":
                self.panel_linear = load_f32_panel_linear()
                if self.features.intel or self.panel_linear is None:
                    small, rows = load_f32_linear("avx512"), F32_KERNEL_MAX_ROWS_AVX512
            if small is not None:
                self.small_steps = small, rows
            self.argmax = load_argmax()
        self.paths: dict[str, str] = {}

    def prepare_model(self, model: CausalLM) -> None:
        """Lay out ``model``'s weights and set its hooks; inference only from then on (the
        kernels write through raw pointers, out of autograd's sight)."""
        if self.dtype == torch.float32 or (self.dtype == torch.bfloat16 and self.native_half):
            self._pack(model)
        elif self.bf16_linear is not None:
            hook = BF16Linear(self.bf16_linear, BF16_KERNEL_MAX_ROWS)
            for module in model.modules():
                if isinstance(module, Linear):
                    module.kernel = hook
            model.logits_kernel = hook
            name = f"c-bf16-{self.bf16_linear.variant}<={hook.max_rows}rows,widen"
            self.paths.update(linear=name, logits=name)
        elif self.dtype in _NATIVE_HALF and not self.native_half:
            widen = CPULinear(None, emulated=True)
            for module in model.modules():
                if isinstance(module, Linear):
                    module.kernel = widen
            # Widening the vocabulary-sized matrix per step costs more than the product
            # itself at decode sizes, so the logits keep a widened copy (4 bytes per
            # vocabulary entry and hidden unit).
            logits = pack_weight(_logits_weight(model).data.float())
            model.logits_kernel = CPULinear(logits, emulated=True)
            self.paths.update(linear=f"torch-{_name(self.dtype)},widen>={_UPCAST_MIN_ROWS}rows")
            self.paths.update(logits="fp32-copy")
        else:
            self.paths.update(
                linear=f"torch-{_name(self.dtype)}", logits=f"torch-{_name(self.dtype)}"
            )
        if self.dtype == torch.float32 and self.features.isa == "avx512":
            model.model.row_multiple = F32_ROW_MULTIPLE
            model.model.pad_min_rows = F32_PAD_MIN_ROWS
            # Only oneDNN's GEMM needs the padding: MKL's, where it takes over, runs unpadded.
            pad_max = model.model.pad_max_rows = packed_max_rows(self.features, self.dtype)
            row_pad = f"{F32_ROW_MULTIPLE}>={F32_PAD_MIN_ROWS}rows"
            self.paths.update(row_pad=row_pad + (f"<={pad_max}rows" if pad_max is not None else ""))
        elif self.dtype == torch.bfloat16 and self.native_half and self.features.amx_bf16:
            pad_min = BF16_AMX_MAX_ROWS + 1 if self.amx_gemm is None else BF16_AMX_GEMM_MIN_ROWS
            model.model.row_multiple = BF16_AMX_ROW_MULTIPLE
            model.model.pad_min_rows = pad_min
            self.paths.update(row_pad=f"{BF16_AMX_ROW_MULTIPLE}>={pad_min}rows")
        for module in model.modules():
            if isinstance(module, (RMSNorm, GatedMLP, DecoderAttention)):
                module.fused = self.fused_ops
            if isinstance(module, GatedMLP):
                module.max_pass_bytes = MLP_CHUNK_BYTES
        self.paths.update(
            fused_ops="c" if self.fused_ops is not None else "torch",
            decode_attention=(
                f"c-paged-{self.decode_kernel.variant}"
                if self.decode_kernel is not None
                else "torch-gather"
            ),
            prefill_attention=self.prefill_kernel.PATH if self.prefill_kernel else "torch-sdpa",
            kv_write="c" if self.write_kernel is not None else "torch",
            argmax="c" if self.argmax is not None else "torch",
            mlp_chunk=f"{MLP_CHUNK_BYTES >> 20}MiB",
            malloc=tune_malloc(envs.malloc_tuning()),
        )
        logger.info(fmt_fields("CPU paths", dtype=_name(self.dtype), **self.describe()))

    def describe(self) -> dict[str, Any]:
        """The CPU's features and, once :meth:`prepare_model` ran, the path of each step."""
        return {**self.features.as_dict(), **self.paths}

    def attention_workspace(self) -> AttentionWorkspace:
        return AttentionWorkspace(
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
            write_kernel=self.write_kernel,
            decode_gather_bytes=DECODE_GATHER_BYTES,
        )

    def _pack(self, model: CausalLM) -> None:
        """Each weight (fp32, or bf16 on a CPU with bf16 instructions) gets a oneDNN-packed
        copy for the steps :func:`packed_max_rows` gives it, which doubles the memory the
        weights take; other steps use the dense weight, whose layout does not matter there.
        fp32 on AVX-512 adds the panel kernel's copy (three copies in all); bf16 on AMX gives
        the AMX GEMM kernel its copy instead of oneDNN's (two copies). Where torch has no
        oneDNN, fp32 weights become input-major instead, which MKL streams faster for steps of
        a few rows; bf16 ones stay as they are."""
        rows = packed_max_rows(self.features, self.dtype)
        scope = "all-rows" if rows is None else f"<={rows}rows,torch"
        self.paths.update(linear=f"onednn-{_name(self.dtype)}-packed{scope}")
        gemm = self.amx_gemm
        onednn = False  # whether some layer took oneDNN's packed copy
        for module in model.modules():
            if not isinstance(module, Linear):
                continue
            weight = module.weight
            if gemm is not None and gemm.packs(weight.data):
                module.kernel = self._small_steps(
                    PackedStepsLinear(
                        gemm,
                        gemm.pack(weight.data),
                        weight.shape[0],
                        BF16_AMX_GEMM_MAX_ROWS,
                        CPULinear(None),
                    ),
                    weight,
                )
                continue
            packed = pack_weight(weight.data)
            if packed is None:
                if self.dtype == torch.float32:
                    module.weight.data = input_major(weight.data)
                layout = "input-major" if self.dtype == torch.float32 else _name(self.dtype)
                self.paths.update(linear=f"torch-{layout}")
            else:
                onednn = True
                module.kernel = self._small_steps(CPULinear(packed, max_rows=rows), weight)
        if model.tie_word_embeddings:
            embed = model.model.embed_tokens.weight
            if gemm is not None:
                # Steps past the small-step kernel's rows (prompt logprobs, over a hundred
                # decodes) take the plain weight: no copy of the vocabulary-sized matrix.
                model.logits_kernel = self._small_steps(CPULinear(None), embed)
            else:
                packed = pack_weight(embed.data)
                model.logits_kernel = (
                    None
                    if packed is None
                    else self._small_steps(CPULinear(packed, max_rows=rows), embed)
                )
        else:
            model.logits_kernel = model.lm_head.kernel
        if gemm is not None:
            # Layers whose sizes are not multiples of 32 keep oneDNN's packed copy.
            gemm_path = f"c-bf16-amx-gemm<={BF16_AMX_GEMM_MAX_ROWS}rows,torch"
            self.paths.update(linear=gemm_path + (f"|{self.paths['linear']}" if onednn else ""))
        front = ""  # the C kernels in front of the main path
        if self.paths["linear"].startswith(("onednn", "c-bf16-amx-gemm")):
            if self.small_steps is not None:
                kernel, small_rows = self.small_steps
                front = f"c-{kernel.NAME.removesuffix('_linear')}-{kernel.variant}"
                front += f"<={small_rows}rows,"
            if self.panel_linear is not None:
                front += f"c-f32-panels<={F32_PANEL_MAX_ROWS}rows,"
            self.paths.update(linear=front + self.paths["linear"])
        # With the AMX GEMM, tied logits past the small steps take the plain weight.
        tied_plain = gemm is not None and model.tie_word_embeddings
        self.paths.update(logits=front + "torch" if tied_plain else self.paths["linear"])

    def _small_steps(self, rest: LinearKernel, weight: torch.Tensor) -> LinearKernel:
        """``rest``, with the C kernels for small steps in front of it where this backend has
        them: the panel kernel (which gets its copy of ``weight`` here), and in front of that
        the dense-weight kernel."""
        hook: LinearKernel = rest
        if self.panel_linear is not None:
            panels = self.panel_linear.pack(weight.data)
            hook = PackedStepsLinear(
                self.panel_linear, panels, weight.shape[0], F32_PANEL_MAX_ROWS, rest
            )
        if self.small_steps is None:
            return hook
        return SmallStepsLinear(*self.small_steps, hook)


def _logits_weight(model: CausalLM) -> torch.Tensor:
    if model.tie_word_embeddings:
        return model.model.embed_tokens.weight
    return model.lm_head.weight


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
