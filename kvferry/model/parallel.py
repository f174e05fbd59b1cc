"""This process's place in the tensor-parallel group, and the collectives the sharded layers use.

One engine runs its model in ``tensor_parallel_size`` worker processes (ranks). Each rank calls
:func:`init_tensor_parallel` once, after ``torch.distributed`` is initialised, before the model
is built; every other process (a single-worker engine, tests) keeps the default group of one,
where the collectives return their input untouched and nothing imports ``torch.distributed``
state. Ranks must call the collectives in the same order with tensors of the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1


_GROUP = TensorParallelGroup()


def init_tensor_parallel(rank: int, world_size: int) -> None:
    """Record this process as ``rank`` of ``world_size`` (``torch.distributed`` must already be
    initialised with that world when ``world_size > 1``)."""
    global _GROUP
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    _GROUP = TensorParallelGroup(rank, world_size)


def get_tp_group() -> TensorParallelGroup:
    return _GROUP


def tp_rank() -> int:
    return _GROUP.rank


def tp_size() -> int:
    return _GROUP.world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns ``x``. Every rank ends with the same bits
    (the backends reduce each element once and broadcast it), which keeps the ranks' greedy
    and seeded sampling in step without exchanging tokens."""
    if _GROUP.world_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x`` (same shape everywhere) concatenated along the last dimension, in rank
    order."""
    if _GROUP.world_size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_GROUP.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def all_gather_object(obj: object) -> list[object]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if _GROUP.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[object] = [None] * _GROUP.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank ``src``'s ``obj`` on every rank."""
    if _GROUP.world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if _GROUP.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def all_reduce_min(value: int) -> int:
    """The smallest of the ranks' ``value`` (e.g. how many KV blocks every rank can hold)."""
    if _GROUP.world_size == 1:
        return value
    import torch.distributed as dist

    # NCCL reduces device tensors only.
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
