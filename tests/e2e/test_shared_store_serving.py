"""The shared cache in the serving picture, end to end: a real ``mooncake_master``, two
``kvferry serve`` instances with the MultiConnector chain (engine pool -> host memory through
OffloadingConnector -> the shared store through MooncakeStoreConnector), each publishing KV
events, behind ``kvferry proxy --policy kv_aware --kv-shared-medium cpu``, and the ``openai``
client; greedy answers are compared with a plain instance (no connector) of the same model.

- A prompt computed on one instance is a store hit on the other (whose host tier is empty),
  and a host-tier hit on the first once its pool dropped it: where two children could load,
  the first one reporting a hit (the host tier) loads, and the store is not asked to.
- The proxy counts the store as a tier of every instance: with the instance that computed a
  prompt stopped, the prompt goes to the other as a KV hit and is served from the store; the
  restarted instance (empty pool and host tier) gets it from the store too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvferry.entrypoints.demo import connector_stats, scrape
from kvferry.entrypoints.demo.shared_cluster import STORE_CHILD, SharedCluster
from tests.helpers.servers import ENGINE_FLAGS, _env

# 32 blocks of 16 tokens: one 512-token context. Four 150-token fills push a prompt out.
FLAGS = [*ENGINE_FLAGS, "--num-kv-blocks", "32"]
PROMPT_LEN = 150
CHUNKS = 4  # whole 32-token chunks (2 blocks) before a 150-token prompt's last token
HIT = CHUNKS * 32
MAX_TOKENS = 6


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 2000, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(tiny_model_factory, tmp_path_factory) -> Iterator[SharedCluster]:
    logs = tmp_path_factory.mktemp("shared-serving")
    model = tiny_model_factory("llama")
    with SharedCluster(model, logs, FLAGS, env=_env(), model_name="tiny") as c:
        yield c
        assert c.logs_without_traceback() == []


def _reference(c: SharedCluster, prompt: list[int]) -> list[int]:
    assert c.reference is not None
    return c.complete(c.reference.url, prompt, MAX_TOKENS)


def _other(c: SharedCluster, name: str) -> str:
    return next(s.name for s in c.servers if s.name != name)


def _stats(c: SharedCluster, name: str) -> dict[str, float]:
    return connector_stats(scrape(c.server(name).url))


def test_hit_on_the_other_instance_from_the_store_and_on_itself_from_host(cluster) -> None:
    c = cluster
    prompt, *fills = _prompts(1 + 4, seed=3)
    want = _reference(c, prompt)

    first = c.ask(prompt, MAX_TOKENS)
    assert (first.reason, first.token_ids) == ("no_match", want)
    assert sum(first.cached.values()) == 0
    x = first.instance
    y = _other(c, x)
    c.wait_stored(x, CHUNKS)

    on_y = c.ask(prompt, MAX_TOKENS, to=y)  # y has computed nothing: an empty host tier
    assert on_y.token_ids == want
    assert on_y.cached == {"pool": 0, "host": 0, "store": HIT}
    assert _stats(c, y)[f"{STORE_CHILD}.hit_tokens"] == HIT

    for fill in fills:  # x's pool drops the prompt; its host tier (64 MiB) keeps it
        c.ask(fill, MAX_TOKENS, to=x)
    on_x = c.ask(prompt, MAX_TOKENS, to=x)
    assert on_x.token_ids == want
    # Both children hold the prompt: the first reporting a hit (the host tier) loads it.
    assert on_x.cached == {"pool": 0, "host": HIT, "store": 0}
    stats = _stats(c, x)
    assert stats["0.OffloadingConnector.hit_tokens_host"] == HIT
    assert stats.get(f"{STORE_CHILD}.hit_tokens", 0.0) == 0.0
    assert stats.get(f"{STORE_CHILD}.get_chunks", 0.0) == 0.0


def test_proxy_counts_the_store_as_a_tier_of_every_instance(cluster) -> None:
    c = cluster
    (prompt,) = _prompts(1, seed=11)
    want = _reference(c, prompt)
    first = c.ask(prompt, MAX_TOKENS)
    assert first.token_ids == want and sum(first.cached.values()) == 0
    x = first.instance
    y = _other(c, x)
    stored = _stats(c, x).get(f"{STORE_CHILD}.stored_chunks", 0.0)
    c.wait_stored(x, int(stored) if stored >= CHUNKS else CHUNKS)

    c.stop_instance(x)
    moved = c.ask(prompt, MAX_TOKENS)
    # Only the store's events name this prompt on y: the shared medium makes it a hit there.
    assert (moved.instance, moved.reason) == (y, "kv_hit")
    assert moved.token_ids == want
    assert moved.cached["store"] == HIT and moved.cached["host"] == 0

    c.start_instance(x)  # a new process: empty pool and host tier, the store remembers
    again = c.ask(prompt, MAX_TOKENS, to=x)
    assert again.token_ids == want
    assert again.cached == {"pool": 0, "host": 0, "store": HIT}


def test_the_shared_medium_is_the_stores_alone() -> None:
    """The host tier's events ("CPU") stay the instance's own: only "cpu" is shared."""
    from kvferry.entrypoints.proxy.prefix_index import PrefixIndex
    from kvferry.kv_events import BlockStored, KVEventBatch

    index = PrefixIndex(shared_media=["cpu"])
    tokens = list(range(32))

    def stored(h: int, parent: int | None, toks: list[int], medium: str) -> KVEventBatch:
        ev = BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=toks,
                         block_size=16, lora_id=None, medium=medium, lora_name=None)  # fmt: skip
        return KVEventBatch(ts=0.0, events=[ev])

    index.apply("a", stored(1, None, tokens[:16], "CPU"))
    assert index.match("b", tokens).tokens == 0 and index.match("a", tokens).tokens == 16
    index.apply("a", stored(2, 1, tokens[16:], "cpu"))
    index.apply("a", stored(1, None, tokens[:16], "cpu"))
    assert index.match("b", tokens).tokens == 32
