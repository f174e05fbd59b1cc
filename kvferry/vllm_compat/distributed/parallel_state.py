"""``vllm.distributed.parallel_state``: rank and group accessors.

The tensor-parallel group is this process's (``kvferry.model.parallel``): rank 0 of one in the
engine process and a single-worker engine, rank r of N in a tensor-parallel worker. The world
group is the same (no pipeline or data parallelism); the pipeline group has one member. The
object collectives and the barrier run over the workers' ``torch.distributed`` group (every
rank must call them, in the same order); in a group of one they return their input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvferry.model import parallel
from kvferry.model.parallel import tp_rank, tp_size

__all__ = [
    "GroupCoordinator",
    "get_pp_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "get_world_group",
    "model_parallel_is_initialized",
]


@dataclass
class GroupCoordinator:
    unique_name: str
    rank: int = 0
    local_rank: int = 0
    ranks: list[int] = field(default_factory=lambda: [0])
    # Not exposed: the collectives below use the default torch.distributed group.
    cpu_group: Any = None
    device_group: Any = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.last_rank

    def barrier(self) -> None:
        if self.world_size > 1:
            parallel.barrier()

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        return obj if self.world_size == 1 else parallel.broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] if self.world_size == 1 else parallel.all_gather_object(obj)


_WORLD = GroupCoordinator("world")
_TP = GroupCoordinator("tp")
_PP = GroupCoordinator("pp")


def _this_process(name: str, cached: GroupCoordinator) -> GroupCoordinator:
    if tp_size() == 1:
        return cached
    return GroupCoordinator(
        name, rank=tp_rank(), local_rank=tp_rank(), ranks=list(range(tp_size()))
    )


def get_world_group() -> GroupCoordinator:
    return _this_process("world", _WORLD)


def get_tp_group() -> GroupCoordinator:
    return _this_process("tp", _TP)


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_tensor_model_parallel_rank() -> int:
    return tp_rank()


def get_tensor_model_parallel_world_size() -> int:
    return tp_size()


def model_parallel_is_initialized() -> bool:
    return True
