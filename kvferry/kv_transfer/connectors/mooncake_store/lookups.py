"""Asynchronous existence lookups for the scheduler half: one thread asks the store which
chunks it holds, so the scheduler never waits on the network (it answers ``None`` meanwhile
and asks again next step)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

from kvferry.kv_transfer.stores.link import StoreLink


@dataclass
class Lookup:
    """One request's lookup: chunks ``[first, first + len(chunk_keys))``; ``hits`` (per chunk:
    every rank's value present) once answered, None while in flight or after a failure."""

    first: int
    chunk_keys: list[str]
    started: float
    done: bool = False
    hits: list[bool] | None = None
    latency: float = 0.0


class LookupService:
    def __init__(self, link: StoreLink, world_size: int) -> None:
        self.link = link
        self.world_size = world_size
        self._queue: queue.Queue[Lookup | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="mc-store-lookup", daemon=True)
        self._thread.start()

    def submit(self, first: int, chunk_keys: list[str]) -> Lookup:
        lookup = Lookup(first, chunk_keys, time.monotonic())
        self._queue.put(lookup)
        return lookup

    def _run(self) -> None:
        while (lookup := self._queue.get()) is not None:
            keys = [f"{k}/r{r}" for k in lookup.chunk_keys for r in range(self.world_size)]
            found = self.link.client.exists(keys) if self.link.up else None
            if found is None and self.link.up:
                self.link.report_failure("a lookup failed")
            if found is not None:
                w = self.world_size
                lookup.hits = [
                    all(found[i * w : (i + 1) * w]) for i in range(len(lookup.chunk_keys))
                ]
            lookup.latency = time.monotonic() - lookup.started
            lookup.done = True  # published last: the scheduler reads hits after done

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
