"""CPU tuning of a loaded model: weight layouts for the CPU GEMMs and the native kernels.

The model files mirror the Hugging Face architecture and compute with plain torch ops; on a
CPU engine the model runner applies a :class:`CPUBackend` right after loading (before the KV
pool is sized, so the pool is sized from the memory the tuned weights leave). The backend
decides everything here and sets the model's few hooks: ``Linear.kernel``,
``CausalLM.logits_kernel`` and the ``fused`` ops of norms, rotary and MLP; the attention
choices go in the :class:`~kvferry.model.attention_workspace.AttentionWorkspace` the runner
owns, and the greedy argmax in the runner's sampler.

Which path serves what (all on CPU):

* fp32: each linear layer gets a oneDNN-packed copy of its weight for small steps (decode);
  where torch has no oneDNN the weight becomes input-major instead. Fused norm, rotary and
  SiLU-and-mul kernels serve the elementwise steps.
* bf16/fp16 without native half-precision GEMMs (e.g. AVX2 only): weights are widened to fp32
  per call for steps large enough to gain from it, and the logits get a persistent packed fp32
  copy. Half-precision weights keep their layout otherwise: without native bf16/fp16 GEMMs a
  transposed one falls onto a much slower path.
* fp32 and bf16: decode attention reads the paged pool in place (C kernel); other decodes are
  gathered a cache-sized chunk of requests at a time.
* greedy sampling: a C argmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvferry.model.attention_workspace import AttentionWorkspace
from kvferry.model.layers import GatedMLP, Linear, RMSNorm
from kvferry.model.llama import CausalLM, DecoderAttention
from kvferry.native.argmax import ArgmaxKernel, load_argmax
from kvferry.native.fused_ops import FusedOps, load_fused_ops
from kvferry.native.paged_decode import PagedDecodeKernel, load_paged_decode

# Up to this many rows a oneDNN-packed weight beats MKL on a dense one: the GEMM streams the
# weight from memory, and the blocked layout streams faster. Larger steps are compute-bound.
PACKED_MAX_ROWS = 128
# Below this many rows the half-precision GEMV is memory-bound and beats converting the weight.
_UPCAST_MIN_ROWS = 6
# Target size of one decode gather: small enough to stay in the last-level cache.
DECODE_GATHER_BYTES = 4 << 20


def _native_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU has bf16/fp16 matrix instructions (AVX512-BF16, AMX)."""
    probes = {
        torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
        torch.float16: ("_is_amx_fp16_supported",),
    }[dtype]
    for name in probes:
        probe = getattr(torch.cpu, name, None)
        try:
            if probe is not None and probe():
                return True
        except RuntimeError:
            pass
    return False


_NATIVE_HALF = {dt: _native_half_matmul(dt) for dt in (torch.bfloat16, torch.float16)}


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
    """A oneDNN-blocked copy of an fp32 ``(out, in)`` CPU weight for :func:`cpu_linear`, or
    None where this torch build has no oneDNN."""
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except (AttributeError, RuntimeError):
        return None
    return packed


def cpu_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear`` with two CPU fast paths.

    ``packed`` (from :func:`pack_weight`, always fp32): used for 2-D inputs of at most
    :data:`PACKED_MAX_ROWS` rows, where the GEMM streams the weight from memory and oneDNN's
    blocked layout streams it faster than MKL does a plain matrix. A half precision input is
    computed in fp32 and rounded back, as the path below does.

    Half precision on a CPU without bf16/fp16 matrix instructions (e.g. AVX2 only): torch
    emulates those GEMMs, far slower than fp32, so the weight is widened to fp32 for the call
    instead: bf16 x bf16 products are exact in fp32 and both paths accumulate in fp32, so the
    result only differs by summation order. Elsewhere this is F.linear.
    """
    if packed is not None and x.dim() == 2 and x.shape[0] <= PACKED_MAX_ROWS:
        b = None if bias is None else bias.float()
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.float().contiguous(), packed, b, "none", [], ""
        )
        return out.to(x.dtype)
    if (
        x.device.type == "cpu"
        and emulated_half_matmul(x.dtype)
        and x.numel() >= _UPCAST_MIN_ROWS * x.shape[-1]
    ):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)


class CPULinear:
    """A ``Linear.kernel``: :func:`cpu_linear` with the layer's packed weight, if any."""

    def __init__(self, packed: torch.Tensor | None) -> None:
        self.packed = packed

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return cpu_linear(x, weight, bias, self.packed)


class CPUBackend:
    """The CPU choices for a model of ``dtype``. ``native_kernels=False`` keeps torch ops
    wherever a C kernel would serve (weight layouts still apply); ``KVFERRY_NATIVE_KERNELS=0``
    has the same effect, and a kernel that cannot be built is left out the same way."""

    def __init__(self, dtype: torch.dtype, native_kernels: bool = True) -> None:
        self.dtype = dtype
        self.fused_ops: FusedOps | None = None
        self.decode_kernel: PagedDecodeKernel | None = None
        self.argmax: ArgmaxKernel | None = None
        if native_kernels:
            # Fused kernels are fp32 only: in half precision the torch ops round after every
            # step exactly as Hugging Face does, which a fused kernel would not.
            if dtype == torch.float32:
                self.fused_ops = load_fused_ops()
            if dtype in PagedDecodeKernel.DTYPES:
                self.decode_kernel = load_paged_decode()
            self.argmax = load_argmax()

    def prepare_model(self, model: CausalLM) -> None:
        """Lay out ``model``'s weights and set its hooks; inference only from then on (the
        kernels write through raw pointers, out of autograd's sight)."""
        if self.dtype == torch.float32:
            self._pack_fp32(model)
        elif emulated_half_matmul(self.dtype):
            widen = CPULinear(None)
            for module in model.modules():
                if isinstance(module, Linear):
                    module.kernel = widen
            # Widening the vocabulary-sized matrix per step costs more than the product
            # itself at decode sizes, so the logits keep a widened copy (4 bytes per
            # vocabulary entry and hidden unit).
            model.logits_kernel = CPULinear(pack_weight(_logits_weight(model).data.float()))
        for module in model.modules():
            if isinstance(module, (RMSNorm, GatedMLP, DecoderAttention)):
                module.fused = self.fused_ops

    def attention_workspace(self) -> AttentionWorkspace:
        return AttentionWorkspace(
            decode_kernel=self.decode_kernel, decode_gather_bytes=DECODE_GATHER_BYTES
        )

    @staticmethod
    def _pack_fp32(model: CausalLM) -> None:
        """Each weight gets a oneDNN-packed copy for steps of at most :data:`PACKED_MAX_ROWS`
        rows, which doubles the memory the weights take; larger steps use the dense weight,
        whose layout does not matter there. Where torch has no oneDNN, weights become
        input-major instead, which MKL streams faster for steps of a few rows."""
        for module in model.modules():
            if isinstance(module, Linear):
                packed = pack_weight(module.weight.data)
                if packed is None:
                    module.weight.data = input_major(module.weight.data)
                else:
                    module.kernel = CPULinear(packed)
        if model.tie_word_embeddings:
            packed = pack_weight(model.model.embed_tokens.weight.data)
            model.logits_kernel = None if packed is None else CPULinear(packed)
        else:
            model.logits_kernel = model.lm_head.kernel


def _logits_weight(model: CausalLM) -> torch.Tensor:
    if model.tie_word_embeddings:
        return model.model.embed_tokens.weight
    return model.lm_head.weight
