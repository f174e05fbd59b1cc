"""The CPU decode-attention kernel (``csrc/paged_decode.c``): built on first use, then cached.

The kernel is plain C with OpenMP, so building it needs only a C compiler (``$CC`` or ``cc``)
and takes well under a second; no torch headers are involved. It is linked against the
OpenMP runtime's soname (``libgomp.so.1``), which resolves to the runtime torch already
loaded, so kernel and torch share one thread pool instead of two pools fighting over cores.

The shared object is cached under ``$KVFERRY_KERNEL_CACHE`` (default
``~/.cache/kvferry/kernels``), keyed by the source, the compiler command and the CPU's
feature flags (it is built with ``-march=native``). When no compiler is found or the build
fails, :func:`load_paged_decode` logs why once and returns None, and attention keeps its
portable torch path. ``KVFERRY_NATIVE_KERNELS=0`` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvferry import envs
from kvferry.logger import init_logger

logger = init_logger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_ARGTYPES: list[Any] = [
    ctypes.c_void_p,  # q
    ctypes.c_int64,  # q row stride (elements)
    ctypes.c_void_p,  # cache
    ctypes.c_int64,  # num_blocks
    ctypes.c_int64,  # block_size
    ctypes.c_int64,  # num_kv_heads
    ctypes.c_int64,  # head_dim
    ctypes.c_void_p,  # block table
    ctypes.c_int64,  # block table row stride
    ctypes.c_void_p,  # lens
    ctypes.c_int64,  # num_reqs
    ctypes.c_int64,  # group (query heads per kv head)
    ctypes.c_float,  # scale
    ctypes.c_void_p,  # out
    ctypes.c_int,  # threads
]


class PagedDecodeKernel:
    """Decode attention of one query token per request over the paged KV pool, in place.

    :meth:`supports` says whether a layer's cache can use it (CPU, fp32 or bf16, contiguous);
    :meth:`__call__` computes ``[num_reqs, num_heads, head_dim]`` outputs.
    """

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {
            torch.float32: lib.kvf_paged_decode_f32,
            torch.bfloat16: lib.kvf_paged_decode_bf16,
        }
        for fn in self._fns.values():
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int

    def supports(self, kv_cache: torch.Tensor, q: torch.Tensor) -> bool:
        return (
            kv_cache.device.type == "cpu"
            and kv_cache.dtype in self.DTYPES
            and q.dtype == kv_cache.dtype
            and kv_cache.is_contiguous()
        )

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """``q``: ``[num_reqs, num_heads, head_dim]`` whose rows may be strided, heads and
        head_dim contiguous; ``kv_cache``: ``(2, num_blocks, block_size, kv_heads, head_dim)``;
        ``block_table``: ``[num_reqs, >= ceil(len / block_size)]`` int64, rows contiguous;
        ``seq_lens``: ``[num_reqs]`` int64, each >= 1."""
        nreq, heads, head_dim = q.shape
        _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        assert block_table.dtype == torch.int64 and block_table.stride(1) == 1
        assert seq_lens.dtype == torch.int64 and seq_lens.is_contiguous()
        out = torch.empty((nreq, heads, head_dim), dtype=q.dtype)
        rc = self._fns[q.dtype](
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            block_table.data_ptr(),
            block_table.stride(0),
            seq_lens.data_ptr(),
            nreq,
            heads // kv_heads,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("paged decode attention: could not allocate scratch memory")
        return out


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    configured = envs.kernel_cache_dir()
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvferry" / "kernels"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: concurrent engines never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def load_paged_decode() -> PagedDecodeKernel | None:
    """The kernel, building it if this machine has not yet; None when disabled or unbuildable
    (the reason is logged)."""
    if not envs.native_kernels():
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        logger.warning(
            "no C compiler (%s) found: CPU decode attention uses the slower torch path", compiler
        )
        return None
    key = hashlib.sha256()
    key.update(_SOURCE.read_bytes())
    key.update(" ".join([compiler, *_FLAGS]).encode())
    key.update(_cpu_flags().encode())
    target = _cache_dir() / f"paged_decode-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, target)
            logger.info("built the CPU decode-attention kernel path=%s", target)
        return PagedDecodeKernel(ctypes.CDLL(str(target)))
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or "").strip().splitlines()[-5:]
        logger.warning(
            "building the CPU decode-attention kernel failed (%s); using the torch path: %s",
            compiler,
            " | ".join(tail),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("CPU decode-attention kernel unavailable (%s); using the torch path", e)
    return None
