"""RecentRoutes: prefixes the proxy just sent to an instance, before its events confirm them.

An instance announces a prompt's blocks only once it has computed them (a long prompt takes a
while), so the requests for the same system prompt that arrive meanwhile would find no holder
and spread over every instance, each recomputing the prefix. The proxy therefore remembers,
for ``ttl`` seconds, which instance it sent each prompt's blocks to, and counts them as held
there (in the engine pool) until the events take over. Keys are the proxy's own chained
hashes of the token blocks; memory is capped at ``max_blocks`` entries.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence


def chain_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Process-local chained keys of the full blocks (never leave the proxy)."""
    keys: list[int] = []
    parent = 0
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        keys.append(parent)
    return keys


class RecentRoutes:
    def __init__(self, ttl: float = 10.0, max_blocks: int = 100_000) -> None:
        self.ttl = ttl
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()

    def record(self, instance: str, keys: Sequence[int], now: float | None = None) -> None:
        if self.ttl <= 0:
            return
        expiry = (time.monotonic() if now is None else now) + self.ttl
        with self._lock:
            for k in keys:
                holders = self._entries.get(k)
                if holders is None:
                    holders = self._entries[k] = {}
                else:
                    self._entries.move_to_end(k)
                holders[instance] = expiry
            while len(self._entries) > self.max_blocks:
                self._entries.popitem(last=False)

    def matched_blocks(self, instance: str, keys: Sequence[int], now: float | None = None) -> int:
        """How many leading blocks were sent to ``instance`` within the last ``ttl``."""
        t = time.monotonic() if now is None else now
        n = 0
        with self._lock:
            for k in keys:
                holders = self._entries.get(k)
                if not holders or holders.get(instance, 0.0) <= t:
                    break
                n += 1
        return n

    def forget(self, instance: str) -> None:
        with self._lock:
            for holders in self._entries.values():
                holders.pop(instance, None)

    def __len__(self) -> int:
        return len(self._entries)
