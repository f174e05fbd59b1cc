"""FaultPlanner: the scheduler side's choice of which loads and stores to sabotage."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvferry.kv_transfer.connectors.fault_injection.metadata import InjectedLoad
from kvferry.kv_transfer.connectors.fault_injection.options import FaultInjectionOptions

if TYPE_CHECKING:
    from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView
    from kvferry.request import Request
    from kvferry.step_types.scheduler_output import SchedulerOutput


class Selector:
    """Chooses loads (or stores) by index, or at random with a seeded generator."""

    def __init__(self, indexes: Iterable[int] | None, rate: float, rng: random.Random) -> None:
        self.indexes = None if indexes is None else set(indexes)
        self.rate = rate
        self.rng = rng

    def __call__(self, index: int, every: bool = False) -> bool:
        if self.indexes is None:
            return every
        if index in self.indexes:
            return True
        return self.rate > 0 and self.rng.random() < self.rate


class FaultPlanner:
    """Numbers the loads and stores as the scheduler makes them and decides each one's fault.

    A failed store's block hashes are remembered, so a later load that covers one of them fails
    until a later store saves that block again. ``count`` is told each failed store.
    """

    def __init__(
        self, options: FaultInjectionOptions, block_size: int, count: Callable[[str], None]
    ) -> None:
        o = self.options = options
        self.block_size = block_size
        self._count = count
        # One generator for all selectors, drawn in a fixed order, so a seed repeats a run.
        rng = random.Random(o.seed)
        self._fail_load = Selector(o.fail_loads, o.fail_load_rate, rng)
        self._corrupt_load = Selector(o.corrupt_loads, o.corrupt_load_rate, rng)
        self._delay_load = Selector(o.delay_loads, 0.0, rng)
        self._fail_store = Selector(o.fail_stores, o.fail_store_rate, rng)
        self._delay_store = Selector(o.delay_stores, 0.0, rng)
        self._asked: dict[str, tuple[int, bool]] = {}  # req -> (computed tokens, async)
        self._reqs: dict[str, Request] = {}
        self._num_loads = 0
        self._num_stores = 0
        self._lost: set[Any] = set()  # block hashes saved by failed stores
        self._loads: list[InjectedLoad] = []

    def on_lookup(self, req_id: str, num_computed_tokens: int, is_async: bool) -> None:
        self._asked[req_id] = (num_computed_tokens, is_async)

    def on_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        self._reqs[rid] = request
        asked = self._asked.pop(rid, None)
        if num_external_tokens > 0 and asked is not None:
            self._plan_load(request, blocks, num_external_tokens, *asked)

    def _plan_load(
        self,
        request: Request,
        blocks: KVCacheBlocksView,
        num_external: int,
        start: int,
        is_async: bool,
    ) -> None:
        o, bs = self.options, self.block_size
        index, self._num_loads = self._num_loads, self._num_loads + 1
        end = start + num_external
        hashes = request.block_hashes[start // bs : end // bs]
        corrupt = self._corrupt_load(index)
        fail = corrupt or self._fail_load(index) or any(h in self._lost for h in hashes)
        delay = o.delay_loads_s if o.delay_loads_s > 0 and self._delay_load(index, True) else 0.0
        if not (fail or delay):
            return
        block_ids = list(blocks.get_block_ids()[0][start // bs : -(-end // bs)])
        self._loads.append(
            InjectedLoad(request.request_id, block_ids, is_async, fail, corrupt, delay)
        )

    def take_loads(self) -> list[InjectedLoad]:
        """The faulty loads planned since the last call."""
        loads, self._loads = self._loads, []
        return loads

    def plan_stores(self, so: SchedulerOutput) -> float:
        """Count this step's stores (requests completing blocks), lose the failed ones, and
        return how long to delay the step's ``wait_for_save``."""
        o, bs = self.options, self.block_size
        cached = so.scheduled_cached_reqs
        progress = [(n.req_id, n.num_computed_tokens) for n in so.scheduled_new_reqs]
        progress += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        delay = 0.0
        for rid, computed in progress:
            request = self._reqs.get(rid)
            end = computed + so.num_scheduled_tokens.get(rid, 0)
            if request is None or end // bs <= computed // bs:
                continue
            hashes = request.block_hashes[computed // bs : end // bs]
            index, self._num_stores = self._num_stores, self._num_stores + 1
            if self._fail_store(index):
                self._lost.update(hashes)
                self._count("failed_stores")
            else:
                self._lost.difference_update(hashes)
            if o.delay_stores_s > 0 and self._delay_store(index, True):
                delay = o.delay_stores_s
        return delay

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._asked.pop(req_id, None)
