"""Plain-data transfer jobs the scheduler side plans and the worker side runs.

Job ids are unique per connector instance and chosen by the scheduler side; how completion
travels back to it is the connector's business.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class JobKind(str, enum.Enum):
    LOAD = "load"  # host blocks -> engine blocks
    STORE = "store"  # engine blocks -> host blocks
    DISK_WRITE = "disk_write"  # host chunk -> file (after the store that filled it)
    DISK_STORE = "disk_store"  # engine blocks -> file, when the host tier has no room
    PROMOTE = "promote"  # file -> host chunk, checked before it is offered
    VERIFY = "verify"  # read a file and check it, before it is offered
    DISK_DELETE = "disk_delete"  # remove a file (eviction, corrupt data)


@dataclass
class TransferJob:
    """``engine_blocks[i]`` pairs with ``host_blocks[i]`` (LOAD / STORE). Disk jobs name one
    chunk by ``disk_key`` (hex) and its ``host_blocks`` (its ``engine_blocks`` for
    DISK_STORE). A LOAD may also read chunks straight from files: ``disk_loads`` holds
    ``(key hex, first block of the chunk to load, engine blocks)``. ``req_ids``: requests a
    LOAD finishes. ``after``: a job that must complete first (a DISK_WRITE waits for its
    STORE)."""

    job_id: int
    kind: JobKind
    engine_blocks: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    disk_key: str | None = None
    req_ids: list[str] = field(default_factory=list)
    after: int | None = None
    disk_loads: list[tuple[str, int, list[int]]] = field(default_factory=list)
