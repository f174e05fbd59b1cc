"""Block copies between per-layer KV tensors, and the engine's copy op built on them.

Tensors are per layer ``(2, num_blocks, block_size, num_kv_heads, head_dim)``, the engine's
shape; the block dimension is 1. Copies work on the keys half and the values half of each
layer separately: in either KV layout (NHD, HND; see :mod:`kvferry.kv_layout`) each is a
contiguous ``(num_blocks, ...)`` run in memory order, so a run of adjacent block ids on both
sides is one ``memcpy``. Sides in different layouts are copied element by element by torch.
Host-to-host copies use the C row-copy kernel (one call for every half of a job, as a call per half costs as much as the bytes of a small job),
or numpy where it cannot be built; copies to or from a device go through one indexed copy
per half.

:class:`KVBlockCopy` is the engine's :data:`~kvferry.kv_transfer.base.CopyBlocksOp`, handed
to connectors through ``set_host_xfer_buffer_ops``; :func:`copy_kv_blocks` is its one-off
form.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kvferry.kv_layout import layout_of, physical
from kvferry.native.block_copy import RowCopyPlan, load_block_copy

# Pairs whose ids are adjacent on both sides for at least this many blocks are copied as a
# slice; shorter runs are cheaper as part of one indexed copy.
MIN_SLICE_RUN = 4
# Below this many bytes a copy runs on one thread: handing it out costs more than it saves
# (judged with cold caches, as loads run; see docs/benchmarks.md).
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
        pairs = list(zip(src_layers, dst_layers, strict=True))
        # Sides dense in one layout (NHD or HND) copy blocks as bytes, in memory order; sides
        # in different layouts copy element by element through torch, which follows strides.
        self.same_layout = all(
            (layout := layout_of(s)) is not None and layout_of(d) is layout for s, d in pairs
        )
        if self.same_layout:
            pairs = [(physical(s), physical(d)) for s, d in pairs]
        self.halves = [(s[k], d[k]) for s, d in pairs for k in range(s.shape[0])]
        self.bytes_per_block = sum(s[0].numel() * s.element_size() for s, _ in self.halves)
        self.on_host = self.same_layout and all(
            s.device.type == "cpu" and d.device.type == "cpu" for s, d in self.halves
        )
        devices = [t.device for pair in self.halves for t in pair if t.device.type == "cuda"]
        self.cuda_device: torch.device | None = devices[0] if devices else None
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


class KVBlockCopy:
    """The engine's block copy (a ``CopyBlocksOp``): ``op(src_caches, dst_caches,
    src_block_ids, dst_block_ids, direction)`` copies block ``src_block_ids[i]`` to
    ``dst_block_ids[i]`` in every layer named in both dicts. ``direction``: "d2h" reads the
    engine's KV into a connector's buffer, "h2d" the reverse.

    Host-to-host copies of at least ``PARALLEL_COPY_BYTES`` run on ``threads`` threads (by
    default as many as torch uses, at most 4). Copies to or from a CUDA device run on the
    current stream and are complete when the op returns. Safe to call from several threads.
    It keeps a copier for each of the last few pairs of tensor sets it was called with (and
    so keeps those tensors alive), so it suits long-lived tensors: the engine's KV and a
    connector's buffers. :meth:`close` stops its threads.
    """

    MAX_COPIERS = 16

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or min(4, max(1, torch.get_num_threads()))
        self._pool = CopyPool(self.threads)  # threads start on first use
        self._copiers: OrderedDict[tuple[int, ...], tuple[list[torch.Tensor], BlockCopier]]
        self._copiers = OrderedDict()
        self._lock = threading.Lock()

    def __call__(
        self,
        src_caches: dict[str, torch.Tensor],
        dst_caches: dict[str, torch.Tensor],
        src_block_ids: list[int],
        dst_block_ids: list[int],
        direction: Literal["h2d", "d2h"],
    ) -> None:
        _check(src_block_ids, dst_block_ids, direction)
        if not src_block_ids:
            return
        copier = self._copier(src_caches, dst_caches)
        _run(copier, src_block_ids, dst_block_ids)

    def _copier(
        self, src_caches: dict[str, torch.Tensor], dst_caches: dict[str, torch.Tensor]
    ) -> BlockCopier:
        pairs = [(s, dst_caches[n]) for n, s in src_caches.items() if n in dst_caches]
        # The entry holds the tensors, so their ids cannot be reused while it is cached.
        key = tuple(id(t) for pair in pairs for t in pair)
        with self._lock:
            cached = self._copiers.get(key)
            if cached is not None:
                self._copiers.move_to_end(key)
                return cached[1]
        copier = BlockCopier([s for s, _ in pairs], [d for _, d in pairs], self._pool)
        with self._lock:
            self._copiers[key] = ([t for pair in pairs for t in pair], copier)
            while len(self._copiers) > self.MAX_COPIERS:
                self._copiers.popitem(last=False)
        return copier

    def close(self) -> None:
        with self._lock:
            self._copiers.clear()
        self._pool.shutdown(wait=True)


def copy_kv_blocks(
    src_caches: dict[str, torch.Tensor],
    dst_caches: dict[str, torch.Tensor],
    src_block_ids: list[int],
    dst_block_ids: list[int],
    direction: Literal["h2d", "d2h"],
) -> None:
    """:class:`KVBlockCopy` for a single call, on the calling thread (nothing is kept)."""
    _check(src_block_ids, dst_block_ids, direction)
    if not src_block_ids:
        return
    names = [n for n in src_caches if n in dst_caches]
    copier = BlockCopier([src_caches[n] for n in names], [dst_caches[n] for n in names])
    _run(copier, src_block_ids, dst_block_ids)


def _check(src_block_ids: list[int], dst_block_ids: list[int], direction: str) -> None:
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError("src_block_ids and dst_block_ids must have the same length")
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")


def _run(copier: BlockCopier, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
    keep: list[torch.Tensor] = []  # temporaries the queued device copies still read
    copier.copy(src_block_ids, dst_block_ids, keep)
    if copier.cuda_device is not None:
        torch.cuda.current_stream(copier.cuda_device).synchronize()
