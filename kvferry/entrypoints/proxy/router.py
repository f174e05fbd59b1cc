"""Router: the policy, the load tracker and (for kv_aware) the prefix index and its event
subscriber behind one ``choose`` per request, with the metrics of each decision."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvferry.config import ConfigError
from kvferry.entrypoints.proxy.event_subscriber import EventSource, KVEventSubscriber
from kvferry.entrypoints.proxy.load import LoadTracker
from kvferry.entrypoints.proxy.policies import (
    POLICIES,
    BlockHasher,
    Choice,
    Prompt,
    RoutingPolicy,
    make_policy,
)
from kvferry.entrypoints.proxy.prefix_index import PrefixIndex
from kvferry.entrypoints.proxy.prompt_tokens import PromptTokens
from kvferry.entrypoints.proxy.recent_routes import RecentRoutes
from kvferry.entrypoints.proxy.routing_metrics import RoutingMetrics


@dataclass
class RouterConfig:
    policy: str = "round_robin"
    # kv_aware: the model folder the instances serve (its tokenizer and chat template).
    tokenizer: str | None = None
    events: list[EventSource] = field(default_factory=list)
    hit_weight: float = 4.0
    poll_interval: float = 1.0
    index_max_blocks: int = 200_000
    # The instances' prefix_caching_hash_algo, when known: hashes are recomputed too.
    hash_algo: str | None = None
    block_size: int = 16
    recent_ttl: float = 10.0
    replay_timeout: float = 3.0
    # KV event media that name a store every instance reads (e.g. Mooncake Store).
    shared_media: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.policy == "kv_aware":
            if not self.tokenizer:
                raise ConfigError(
                    "--policy kv_aware needs --tokenizer MODEL_DIR (the model folder the "
                    "instances serve) to tokenize prompts as they do"
                )
            if not self.events:
                raise ConfigError("--policy kv_aware needs --kv-events-endpoint for every instance")
        if self.index_max_blocks < 1 or self.block_size < 1:
            raise ConfigError("--kv-index-max-blocks and --kv-block-size must be positive")


def _hasher(algo: str | None) -> BlockHasher | None:
    if algo is None:
        return None
    from kvferry.core.block_hash import token_block_hasher

    try:
        return token_block_hasher(algo)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"--prefix-caching-hash-algo {algo!r}: {e}") from None


class Router:
    def __init__(self, urls: Sequence[str], config: RouterConfig, metrics: RoutingMetrics) -> None:
        self.urls = list(urls)
        self.config = config
        self.metrics = metrics
        self.index: PrefixIndex | None = None
        self.subscriber: KVEventSubscriber | None = None
        self.tokens: PromptTokens | None = None
        on_up = None
        kv: dict[str, Any] = {}
        if config.policy == "kv_aware":
            known = set(self.urls)
            for src in config.events:
                if src.instance not in known:
                    raise ConfigError(f"KV events given for unknown instance {src.instance}")
            self.index = PrefixIndex(config.index_max_blocks, config.shared_media)
            self.recent = RecentRoutes(config.recent_ttl)
            self.subscriber = KVEventSubscriber(
                self.index,
                config.events,
                metrics,
                replay_timeout=config.replay_timeout,
                on_drop=self.recent.forget,
            )
            self.tokens = PromptTokens(config.tokenizer or "")
            on_up = self.subscriber.resync
            kv = dict(
                index=self.index,
                synced=self.subscriber.synced,
                recent=self.recent,
                hit_weight=config.hit_weight,
                hasher=_hasher(config.hash_algo),
                block_size=config.block_size,
            )
        self.loads = LoadTracker(self.urls, metrics, config.poll_interval, on_up=on_up)
        self.policy: RoutingPolicy = make_policy(config.policy, self.urls, self.loads, **kv)

    def start(self, http: httpx.AsyncClient) -> None:
        """Start polling the instances and following their events (on the event loop)."""
        self.loads.start(http)
        if self.subscriber is not None:
            self.subscriber.start()

    async def close(self) -> None:
        await self.loads.close()
        if self.subscriber is not None:
            await asyncio.to_thread(self.subscriber.close)

    async def prompt(self, body: dict[str, Any], endpoint: str) -> Prompt | None:
        if self.tokens is None:
            return None
        ids = await asyncio.to_thread(self.tokens.token_ids, body, endpoint)
        if ids is None:
            return None
        salt = body.get("cache_salt")
        return Prompt(ids, salt if isinstance(salt, str) and salt else None)

    def choose(self, prompt: Prompt | None, avoid: Sequence[str] = ()) -> Choice:
        choice = self.policy.choose(prompt)
        if choice.url in avoid:  # a retry after a refused connection: the next untried one
            rest = [u for u in self.urls if u not in avoid]
            if rest:
                choice = Choice(min(rest, key=self.loads.load), choice.reason)
        self.policy.routed(choice, prompt)
        self.metrics.decisions.labels(choice.reason, choice.url).inc()
        return choice
