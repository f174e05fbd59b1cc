"""``vllm.distributed.parallel_state``: rank and group accessors.

kvferry runs each engine's model in one worker (``UniProcExecutor.world_size == 1``), so every
group has one member, rank 0. Collective calls on a group of one return their input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    # No torch.distributed process groups: one member needs none.
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
        """Nothing to wait for in a group of one."""

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


_WORLD = GroupCoordinator("world")
_TP = GroupCoordinator("tp")
_PP = GroupCoordinator("pp")


def get_world_group() -> GroupCoordinator:
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def model_parallel_is_initialized() -> bool:
    return True
