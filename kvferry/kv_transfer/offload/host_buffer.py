"""HostKVBuffer: the host-memory tier's bytes, and block copies between it and the engine.

Per layer the buffer is a tensor shaped like the engine's KV, ``(2, num_host_blocks,
block_size, num_kv_heads, head_dim)``, so one host block holds exactly one engine block and
a chunk of ``B`` blocks is host blocks ``[slot * B, (slot + 1) * B)``. On a CUDA engine the
buffer is pinned, so copies run as DMA on a side stream. Memory is reserved with
``torch.empty``: pages are only touched when a block is first written.

Copies work on the keys half and the values half of each layer separately: each is a
contiguous ``(num_blocks, ...)`` tensor, so a run of adjacent block ids on both sides is one
``memcpy``. Host-to-host copies use the C row-copy kernel (one call for every half of a job:
per-half calls cost as much as the bytes for jobs of a few MiB), or numpy where it cannot be
built; copies to or from a device go through one indexed copy per half.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.native.block_copy import RowCopyPlan, load_block_copy

# Pairs whose ids are adjacent on both sides for at least this many blocks are copied as a
# slice; shorter runs are cheaper as part of one indexed copy.
MIN_SLICE_RUN = 4
# Below this many bytes a copy runs on one thread: handing it out costs more than it saves.
# (Measured with cold caches, as loads run: a 3 MiB job is latency-bound on one thread.)
PARALLEL_COPY_BYTES = 1 << 20


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split the pairs ``(src[i], dst[i])`` into maximal runs ``(src0, dst0, length)`` whose ids
    both count up by one."""
    runs: list[tuple[int, int, int]] = []
    i, n = 0, len(src)
    while i < n:
        j = i + 1
        while j < n and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        runs.append((src[i], dst[i], j - i))
        i = j
    return runs


class HostKVBuffer:
    def __init__(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, pin_memory: bool
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("the host buffer needs at least one block")
        self.layer_names = list(kv_caches)
        self.num_blocks = num_blocks
        self.layers: dict[str, torch.Tensor] = {}
        for name, cache in kv_caches.items():
            shape = (cache.shape[0], num_blocks, *cache.shape[2:])
            self.layers[name] = torch.empty(shape, dtype=cache.dtype, pin_memory=pin_memory)
        first = next(iter(kv_caches.values()))
        self.bytes_per_block = sum(c[:, 0].numel() * c.element_size() for c in kv_caches.values())
        self.dtype = first.dtype

    def chunk_views(self, host_blocks: list[int]) -> list[torch.Tensor]:
        """Contiguous views (per layer, keys then values) of consecutive host blocks, in the
        order a chunk file stores them."""
        start, n = host_blocks[0], len(host_blocks)
        assert host_blocks == list(range(start, start + n)), "a chunk is consecutive blocks"
        return [t[k, start : start + n] for t in self.layers.values() for k in range(t.shape[0])]


class CopyPool(ThreadPoolExecutor):
    """Threads that split one host-to-host copy by layer."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers, thread_name_prefix="kv-offload-memcpy")
        self.workers = workers


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)


def _rows(t: torch.Tensor) -> np.ndarray:
    """A ``(blocks, bytes)`` uint8 numpy view of a contiguous CPU half (no copy)."""
    array: np.ndarray = t.view(torch.uint8).numpy()
    return array.reshape(t.shape[0], -1)


@dataclass
class _Plan:
    """How one block list is copied: slices for long runs, one indexed copy for the rest
    (``src``/``dst``; ``src_range``/``dst_range`` when that side is one adjacent range)."""

    slices: list[tuple[int, int, int]]
    src: list[int]
    dst: list[int]
    src_idx: np.ndarray
    dst_idx: np.ndarray
    src_range: bool
    dst_range: bool

    @staticmethod
    def of(src_ids: list[int], dst_ids: list[int]) -> _Plan:
        runs = coalesce(src_ids, dst_ids)
        short = [r for r in runs if r[2] < MIN_SLICE_RUN]
        src = [s + i for s, _, n in short for i in range(n)]
        dst = [d + i for _, d, n in short for i in range(n)]
        return _Plan(
            [r for r in runs if r[2] >= MIN_SLICE_RUN],
            src,
            dst,
            np.asarray(src, dtype=np.int64),
            np.asarray(dst, dtype=np.int64),
            bool(src) and src == list(range(src[0], src[0] + len(src))),
            bool(dst) and dst == list(range(dst[0], dst[0] + len(dst))),
        )


class BlockCopier:
    """Copies blocks from one set of per-layer tensors to another (see :func:`copy_blocks`).

    Built once per pair of long-lived tensor sets (engine KV <-> host buffer), so the numpy
    views of host-to-host copies are made once, not per job.
    """

    def __init__(
        self,
        src_layers: Sequence[torch.Tensor],
        dst_layers: Sequence[torch.Tensor],
        pool: CopyPool | None = None,
    ) -> None:
        self.halves = [
            (s[k], d[k])
            for s, d in zip(src_layers, dst_layers, strict=True)
            for k in range(s.shape[0])
        ]
        self.bytes_per_block = sum(s[0].numel() * s.element_size() for s, _ in self.halves)
        self.on_host = all(
            s.device.type == "cpu" and d.device.type == "cpu" for s, d in self.halves
        )
        self.pool = pool
        kernel = load_block_copy() if self.on_host else None
        self.native: RowCopyPlan | None = None if kernel is None else kernel.plan(self.halves)
        # numpy views, for host copies where the kernel could not be built
        host_fallback = self.on_host and self.native is None
        self.rows = [(_rows(s), _rows(d)) for s, d in self.halves] if host_fallback else []

    def copy(
        self, src_ids: list[int], dst_ids: list[int], keep_alive: list[torch.Tensor] | None = None
    ) -> int:
        if len(src_ids) != len(dst_ids):
            raise ValueError("src_ids and dst_ids differ in length")
        if not src_ids:
            return 0
        nbytes = len(src_ids) * self.bytes_per_block
        if self.native is not None:
            # The kernel brings its own threads (as many as the pool has); small copies stay
            # on one, as waking the others costs more than they save.
            threads = 1
            if self.pool is not None and nbytes >= PARALLEL_COPY_BYTES:
                threads = self.pool.workers
            self.native.copy(src_ids, dst_ids, threads)
            return nbytes
        plan = _Plan.of(src_ids, dst_ids)
        if self.on_host:

            def run(group: list[tuple[np.ndarray, np.ndarray]]) -> None:
                for src, dst in group:
                    _copy_rows(src, dst, plan)

            pool = self.pool
            if pool is not None and pool.workers > 1 and nbytes >= PARALLEL_COPY_BYTES:
                # One task per thread (not per half): dispatch costs more than small copies.
                list(pool.map(run, [self.rows[i :: pool.workers] for i in range(pool.workers)]))
            else:
                run(self.rows)
            return nbytes
        for s, d in self.halves:
            for s0, d0, n in plan.slices:
                d[d0 : d0 + n].copy_(s[s0 : s0 + n], non_blocking=True)
            if plan.src:
                _copy_indexed(s, d, plan.src, plan.dst, keep_alive)
        return nbytes


def copy_blocks(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_ids: list[int],
    dst_ids: list[int],
    keep_alive: list[torch.Tensor] | None = None,
    pool: CopyPool | None = None,
) -> int:
    """Copy blocks ``src_ids[i] -> dst_ids[i]`` of every layer; returns the bytes copied.

    Tensors are per layer ``(2, num_blocks, ...)``; source and destination may live on
    different devices (one of them host memory). Host-to-host copies go through numpy
    (``memcpy`` per run, no GIL, no OpenMP team per call: much faster off the main thread),
    spread over ``pool``'s threads by layer. Cross-device copies are issued non-blocking:
    the caller synchronizes the current stream before using the data, and passes
    ``keep_alive`` to hold temporaries until then.
    """
    return BlockCopier(src_layers, dst_layers, pool).copy(src_ids, dst_ids, keep_alive)


def _copy_rows(src: np.ndarray, dst: np.ndarray, plan: _Plan) -> None:
    for s0, d0, n in plan.slices:
        np.copyto(dst[d0 : d0 + n], src[s0 : s0 + n])
    if not plan.src:
        return
    n, d0, s0 = len(plan.dst), plan.dst[0], plan.src[0]
    if plan.dst_range:  # gather straight into the destination
        np.take(src, plan.src_idx, axis=0, out=dst[d0 : d0 + n])
    elif plan.src_range:
        dst[plan.dst_idx] = src[s0 : s0 + n]
    else:
        dst[plan.dst_idx] = src[plan.src_idx]


def _copy_indexed(
    s: torch.Tensor,
    d: torch.Tensor,
    src_ids: list[int],
    dst_ids: list[int],
    keep_alive: list[torch.Tensor] | None,
) -> None:
    """Indexed copy between devices (one side host memory)."""
    n = len(dst_ids)
    dst_range = dst_ids == list(range(dst_ids[0], dst_ids[0] + n))
    src_range = src_ids == list(range(src_ids[0], src_ids[0] + n))
    # Gather on the source device, move once, scatter on the destination.
    if src_range:
        gathered = s[src_ids[0] : src_ids[0] + n]
    else:
        gathered = s.index_select(0, _index(src_ids, s.device))
    if dst_range:
        d[dst_ids[0] : dst_ids[0] + n].copy_(gathered, non_blocking=True)
        if keep_alive is not None:
            keep_alive.append(gathered)
        return
    if d.device.type == "cpu":
        # Device -> host scatter: the bytes must have arrived before the CPU scatters them.
        moved = gathered.to(d.device)
    else:
        moved = gathered.to(d.device, non_blocking=True)
        if keep_alive is not None:
            keep_alive.extend((gathered, moved))
    d.index_copy_(0, _index(dst_ids, d.device), moved)
