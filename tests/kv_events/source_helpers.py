"""Expected events and a set-keeping subscriber for the event-source tests.

A subscriber that keeps, per medium, the set of hashes it was told about must end up with
exactly what the engine holds: :class:`HashIndex` replays the events and checks that
nothing is announced twice or withdrawn without having been announced.
"""

from __future__ import annotations

from typing import Any

from kvferry.kv_events import (
    KV_CACHE_SPEC_FULL_ATTENTION,
    KV_CACHE_SPEC_SLIDING_WINDOW,
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


def stored(
    request: Request,
    start: int,
    end: int,
    medium: str = MEDIUM_GPU,
    group_idx: int = 0,
    window: int | None = None,
) -> BlockStored:
    """The BlockStored a source must emit for blocks [start, end) of ``request`` in KV cache
    group ``group_idx`` (sliding over ``window`` tokens, or full attention), named by its
    attention type."""
    kind = KV_CACHE_SPEC_FULL_ATTENTION if window is None else KV_CACHE_SPEC_SLIDING_WINDOW
    return BlockStored(
        block_hashes=ext(request, *range(start, end)),
        parent_block_hash=ext(request, start - 1)[0] if start else None,
        token_ids=request.all_token_ids[start * BS : end * BS],
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=[None] * (end - start),
        group_idx=group_idx,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


class HashIndex:
    """What a set-keeping subscriber knows: hashes per medium and KV cache group, checked as
    events arrive."""

    def __init__(self) -> None:
        self.held: dict[tuple[str | None, int | None], set[Any]] = {}

    def apply(self, events: list[Any]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                held = self.held.setdefault((e.medium, e.group_idx), set())
                assert not held & set(e.block_hashes), f"announced twice: {e}"
                if e.medium == MEDIUM_GPU and e.parent_block_hash is not None:
                    assert e.parent_block_hash in held, "a parent the pool never announced"
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
                held |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                held = self.held.setdefault((e.medium, e.group_idx), set())
                assert set(e.block_hashes) <= held, f"withdrawn unannounced: {e}"
                held -= set(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                for key in [k for k in self.held if k[0] == MEDIUM_GPU]:
                    del self.held[key]

    def of(self, medium: str, group_idx: int = 0) -> set[Any]:
        return self.held.get((medium, group_idx), set())


def gpu_hashes(s: Any, group_idx: int = 0) -> set[Any]:
    pool = s.kv_cache_manager.block_pool
    return {external_block_hash(h) for h in pool.cached_by_group[group_idx]}


def events_scheduler(**kw: Any) -> tuple[Any, RecordingPublisher]:
    pub = RecordingPublisher()
    return create_scheduler(kv_events_config=events_on(), kv_event_publisher=pub, **kw), pub
