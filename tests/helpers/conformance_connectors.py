"""Scripted connectors that drive the conformance kit into the scenarios no built-in connector
reaches (a ``None`` answer to a lookup, a delayed free), and variants that get them wrong.

Both build on ExampleConnector (synchronous loads from a folder), configured through
``kv_connector_extra_config`` next to its ``shared_storage_path``:

* :class:`DeferringConnector`: ``defer_lookups`` (default 2): how many lookups of each request
  are answered ``None`` (not known yet) before the real answer.
* :class:`DelayedFreeConnector`: ``request_finished`` keeps every request's blocks and the
  worker reports them in ``finished_sending`` ``free_after_steps`` (default 2) steps later.
  ``mode``: ``"ok"``; ``"never"`` (keeps the blocks and never reports the free);
  ``"early"`` (reports the free as soon as the request is scheduled, before
  ``request_finished`` kept anything).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvferry.kv_transfer.base import KVConnectorMetadata
from kvferry.kv_transfer.connectors.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)
from kvferry.request import Request
from kvferry.step_types.scheduler_output import SchedulerOutput


class DeferringConnector(ExampleConnector):
    subclass_options = ("defer_lookups",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.defer_lookups = int(extra.get("defer_lookups", 2))
        self._asked: Counter[str] = Counter()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._asked[request.request_id] += 1
        if self._asked[request.request_id] <= self.defer_lookups:
            return None, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


@dataclass
class FreeingMetadata(ExampleConnectorMetadata):
    frees: list[str] = field(default_factory=list)


class DelayedFreeConnector(ExampleConnector):
    subclass_options = ("free_after_steps", "mode")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.free_after_steps = int(extra.get("free_after_steps", 2))
        self.mode = str(extra.get("mode", "ok"))
        self._frees: list[str] = []  # scheduler: frees to hand to the worker
        self._announced: set[str] = set()  # scheduler, mode "early"
        self._countdown: dict[str, int] = {}  # worker: request id -> steps until reported

    # scheduler side
    def update_state_after_alloc(self, request: Request, blocks: Any, num_external: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external)
        if self.mode == "early" and request.request_id not in self._announced:
            self._announced.add(request.request_id)
            self._frees.append(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, ExampleConnectorMetadata)
        frees, self._frees = self._frees, []
        return FreeingMetadata(loads=meta.loads, stores=meta.stores, frees=frees)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        super().request_finished(request, block_ids)
        if self.mode == "ok":
            self._frees.append(request.request_id)
        return True, None

    # worker side
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        if isinstance(metadata, FreeingMetadata):
            for rid in metadata.frees:
                self._countdown[rid] = self.free_after_steps

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = {rid for rid, n in self._countdown.items() if n <= 0}
        for rid in done:
            del self._countdown[rid]
        for rid in self._countdown:
            self._countdown[rid] -= 1
        return done or None, None
