"""Typed options of the SimpleCPUOffloadConnector, parsed from ``kv_connector_extra_config``
(see :mod:`kvferry.kv_transfer.connectors.offloading.options` for how they are checked)."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.config import ConfigError
from kvferry.kv_transfer.connectors.offloading.options import (
    GiB,
    check_positive,
    check_store_mode,
)


@dataclass
class SimpleCPUOffloadOptions:
    """``cpu_bytes_to_use``: host memory for offloaded KV, shared by all ranks (default 8 GiB,
    as in vLLM); ``cpu_bytes_to_use_per_rank`` overrides it per rank; ``num_cpu_blocks``
    overrides both. ``lazy_offload``: instead of copying every computed block out as soon as
    it is complete (eager), copy only cached blocks that are about to be evicted from the
    engine's pool: the ``lazy_window_blocks`` blocks it would evict next (default: an eighth
    of the pool). ``host_store_mode``: see :class:`OffloadingOptions`."""

    cpu_bytes_to_use: int = 8 * GiB
    cpu_bytes_to_use_per_rank: int | None = None
    num_cpu_blocks: int | None = None
    lazy_offload: bool = False
    lazy_window_blocks: int | None = None
    host_store_mode: str = "auto"

    def validate(self, owner: str) -> None:
        check_store_mode(owner, self.host_store_mode)
        check_positive(owner, "cpu_bytes_to_use", self.cpu_bytes_to_use)
        check_positive(owner, "cpu_bytes_to_use_per_rank", self.cpu_bytes_to_use_per_rank)
        check_positive(owner, "num_cpu_blocks", self.num_cpu_blocks)
        check_positive(owner, "lazy_window_blocks", self.lazy_window_blocks)

    def num_blocks(self, bytes_per_block: int, world_size: int, owner: str) -> int:
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        per_rank = self.cpu_bytes_to_use_per_rank or self.cpu_bytes_to_use // max(1, world_size)
        n = per_rank // bytes_per_block
        if n <= 0:
            raise ConfigError(
                f"{owner}: {per_rank} bytes of host memory hold no KV block "
                f"({bytes_per_block} bytes each); raise cpu_bytes_to_use"
            )
        return n
