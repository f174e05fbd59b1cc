"""Expected events and a set-keeping subscriber for the event-source tests.

A subscriber that keeps, per medium, the set of hashes it was told about must end up with
exactly what the engine holds: :class:`HashIndex` replays the events and checks that
nothing is announced twice or withdrawn without having been announced.
"""

from __future__ import annotations

from typing import Any

from kvferry.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    external_block_hash,
)
from kvferry.request import Request
from tests.helpers.kv_events import RecordingPublisher, events_on
from tests.helpers.scheduler import (
    BLOCK_SIZE,
    create_scheduler,
)

BS = BLOCK_SIZE


def ext(request: Request, *blocks: int) -> list[int | bytes]:
    return [external_block_hash(request.block_hashes[i]) for i in blocks]


def stored(request: Request, start: int, end: int, medium: str = MEDIUM_GPU) -> BlockStored:
    """The BlockStored a source must emit for blocks [start, end) of ``request``."""
    return BlockStored(
        block_hashes=ext(request, *range(start, end)),
        parent_block_hash=ext(request, start - 1)[0] if start else None,
        token_ids=request.all_token_ids[start * BS : end * BS],
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=[None] * (end - start),
        group_idx=0,
    )


class HashIndex:
    """What a set-keeping subscriber knows: hashes per medium, checked as events arrive."""

    def __init__(self) -> None:
        self.held: dict[str | None, set[Any]] = {}

    def apply(self, events: list[Any]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                held = self.held.setdefault(e.medium, set())
                assert not held & set(e.block_hashes), f"announced twice: {e}"
                if e.medium == MEDIUM_GPU and e.parent_block_hash is not None:
                    assert e.parent_block_hash in held, "a parent the pool never announced"
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
                held |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                held = self.held.setdefault(e.medium, set())
                assert set(e.block_hashes) <= held, f"withdrawn unannounced: {e}"
                held -= set(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.held.pop(MEDIUM_GPU, None)

    def of(self, medium: str) -> set[Any]:
        return self.held.get(medium, set())


def gpu_hashes(s: Any) -> set[Any]:
    return {external_block_hash(h) for h in s.kv_cache_manager.block_pool.cached_blocks}


def events_scheduler(**kw: Any) -> tuple[Any, RecordingPublisher]:
    pub = RecordingPublisher()
    return create_scheduler(kv_events_config=events_on(), kv_event_publisher=pub, **kw), pub
