"""Routing policies: which instance serves a request.

- ``round_robin``: each instance in turn;
- ``least_loaded``: the instance with the lowest load (see :mod:`.load`);
- ``kv_aware``: the instance that holds the longest prefix of the prompt, weighted by tier
  (:data:`.prefix_index.TIER_WEIGHTS`), balanced against load:
  ``score = hit_weight * weighted_matched_tokens / prompt_tokens - load``, so a whole-prompt
  hit in the engine pool is worth ``hit_weight`` queued requests. It falls back to the least
  loaded instance when nothing matches, when only down instances hold the prefix, when no
  index is in sync, or when the prompt could not be tokenized.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvferry.entrypoints.proxy.load import LoadTracker
from kvferry.entrypoints.proxy.prefix_index import PrefixIndex
from kvferry.entrypoints.proxy.recent_routes import RecentRoutes, chain_keys
from kvferry.kv_events import ExternalBlockHash, external_block_hash

POLICIES = ("round_robin", "least_loaded", "kv_aware")
# token_ids, block_size, cache_salt -> block hashes (kvferry.core.block_hash.token_block_hasher)
BlockHasher = Callable[..., list[bytes]]


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    cache_salt: str | None = None


@dataclass(frozen=True)
class Choice:
    url: str
    reason: str
    matched_tokens: int = 0


class RoutingPolicy(ABC):
    """Picks one of ``urls`` for a request.

    Contract: ``choose`` runs on the proxy's event loop, so it must not block (no I/O); it
    returns an instance that is up whenever one is (``all_down`` otherwise: each in turn).
    ``routed`` is told where the request actually went.
    """

    name: ClassVar[str]

    def __init__(self, urls: Sequence[str], loads: LoadTracker) -> None:
        self.urls = list(urls)
        self.loads = loads
        self._turn = 0

    @abstractmethod
    def choose(self, prompt: Prompt | None) -> Choice: ...

    def routed(self, choice: Choice, prompt: Prompt | None) -> None:
        return None

    def _rotation(self) -> list[str]:
        """Every instance, starting one further each call (ties break in turn)."""
        i = self._turn % len(self.urls)
        self._turn += 1
        return self.urls[i:] + self.urls[:i]

    def _up(self) -> list[str] | None:
        order = self._rotation()
        up = [u for u in order if self.loads.up(u)]
        return up or None

    def _least_loaded(self, reason: str, up: list[str] | None = None) -> Choice:
        up = up or self._up()
        if up is None:
            return Choice(self._rotation()[0], "all_down")
        return Choice(min(up, key=self.loads.load), reason)


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def choose(self, prompt: Prompt | None) -> Choice:
        # The next instance that is up after the last one chosen: down ones are skipped
        # without giving their turn to a single neighbour.
        n = len(self.urls)
        for step in range(1, n + 1):
            i = (self._turn + step - 1) % n
            if self.loads.up(self.urls[i]):
                self._turn = i + 1
                return Choice(self.urls[i], "round_robin")
        self._turn += 1
        return Choice(self.urls[(self._turn - 1) % n], "all_down")


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def choose(self, prompt: Prompt | None) -> Choice:
        return self._least_loaded("least_loaded")


class KVAware(RoutingPolicy):
    name = "kv_aware"

    def __init__(
        self,
        urls: Sequence[str],
        loads: LoadTracker,
        index: PrefixIndex,
        synced: Callable[[str], bool],
        recent: RecentRoutes | None = None,
        hit_weight: float = 4.0,
        hasher: BlockHasher | None = None,
        block_size: int = 16,
    ) -> None:
        super().__init__(urls, loads)
        self.index = index
        self.synced = synced
        self.recent = recent
        self.hit_weight = hit_weight
        self.hasher = hasher
        self.default_block_size = block_size

    def _block_size(self, url: str) -> int:
        bs = self.index.block_size(url)
        if bs:
            return bs
        known = (self.index.block_size(u) for u in self.urls)
        return next((b for b in known if b), self.default_block_size)

    def _hashes(self, prompt: Prompt, bs: int) -> list[tuple[ExternalBlockHash, ...]] | None:
        if self.hasher is None:
            return None
        raw = self.hasher(prompt.token_ids, bs, prompt.cache_salt)
        return [(external_block_hash(h, as_int=True), bytes(h)) for h in raw]

    def _recent_keys(self, prompt: Prompt, bs: int) -> list[int]:
        keys = chain_keys(prompt.token_ids, bs)
        if prompt.cache_salt:  # a salted prompt shares no recent route with an unsalted one
            keys = [hash((prompt.cache_salt, k)) for k in keys]
        return keys

    def hits(self, prompt: Prompt) -> dict[str, tuple[float, int]]:
        """Per instance: (tier-weighted matched tokens, matched tokens)."""
        out: dict[str, tuple[float, int]] = {}
        per_bs: dict[int, tuple[list[tuple[ExternalBlockHash, ...]] | None, list[int]]] = {}
        for u in self.urls:
            bs = self._block_size(u)
            if bs not in per_bs:
                per_bs[bs] = (self._hashes(prompt, bs), self._recent_keys(prompt, bs))
            hashes, keys = per_bs[bs]
            weighted, tokens = 0.0, 0
            if self.synced(u):
                m = self.index.match(
                    u, prompt.token_ids, bs, hashes, use_tokens=prompt.cache_salt is None
                )
                weighted, tokens = m.weighted_tokens, m.tokens
            if self.recent is not None:
                recent = self.recent.matched_blocks(u, keys) * bs
                if recent > weighted:
                    weighted, tokens = float(recent), max(tokens, recent)
            out[u] = (weighted, tokens)
        return out

    def choose(self, prompt: Prompt | None) -> Choice:
        if prompt is None or not prompt.token_ids:
            return self._least_loaded("no_prompt")
        up = self._up()
        if up is None:
            return Choice(self._rotation()[0], "all_down")
        if not any(self.synced(u) for u in self.urls) and self.recent is None:
            return self._least_loaded("stale", up)
        hits = self.hits(prompt)
        n = len(prompt.token_ids)

        def score(u: str) -> tuple[float, float]:
            return (self.hit_weight * hits[u][0] / n - self.loads.load(u), -self.loads.load(u))

        best = max(up, key=score)  # max keeps the first of equals: rotation breaks ties
        top = max(hits[u][0] for u in up)
        if top == 0:
            down_holds = any(hits[u][0] > 0 for u in self.urls if u not in up)
            if not any(self.synced(u) for u in up):
                return self._least_loaded("stale", up)
            return self._least_loaded("holder_down" if down_holds else "no_match", up)
        reason = "kv_hit" if hits[best][0] == top else "kv_load"
        return Choice(best, reason, hits[best][1])

    def routed(self, choice: Choice, prompt: Prompt | None) -> None:
        if self.recent is None or prompt is None or not prompt.token_ids:
            return
        bs = self._block_size(choice.url)
        self.recent.record(choice.url, self._recent_keys(prompt, bs))


def make_policy(
    name: str, urls: Sequence[str], loads: LoadTracker, **kv_aware: object
) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobin(urls, loads)
    if name == "least_loaded":
        return LeastLoaded(urls, loads)
    if name == "kv_aware":
        return KVAware(urls, loads, **kv_aware)  # type: ignore[arg-type]
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
