"""Routing policies and the load tracker, with a hand-fed prefix index and fake loads."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client import CollectorRegistry

from kvferry.core.block_hash import hash_token_blocks
from kvferry.entrypoints.proxy.load import LoadTracker, queue_depth
from kvferry.entrypoints.proxy.policies import KVAware, LeastLoaded, Prompt, RoundRobin
from kvferry.entrypoints.proxy.prefix_index import PrefixIndex
from kvferry.entrypoints.proxy.recent_routes import RecentRoutes
from kvferry.entrypoints.proxy.routing_metrics import RoutingMetrics
from kvferry.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, KVEventBatch, external_block_hash
from tests.proxy.events_pub import stored

URLS = ["http://a", "http://b", "http://c"]
A, B, C = URLS
BS = 4
PROMPT = list(range(1000, 1032))  # 8 blocks


def tracker() -> LoadTracker:
    return LoadTracker(URLS, RoutingMetrics(CollectorRegistry()), interval=0)


def hold(index: PrefixIndex, url: str, n_blocks: int, medium: str = "GPU") -> None:
    hashes = [external_block_hash(h) for h in hash_token_blocks(PROMPT, BS)][:n_blocks]
    ev = stored(hashes, PROMPT[: n_blocks * BS], BS, medium=medium)
    index.apply(url, KVEventBatch(ts=time.time(), events=[ev]))


def kv_policy(loads: LoadTracker, index: PrefixIndex, **kw) -> KVAware:
    return KVAware(URLS, loads, index, synced=kw.pop("synced", lambda u: True), **kw)


def test_round_robin_and_least_loaded_skip_down_instances() -> None:
    loads = tracker()
    rr = RoundRobin(URLS, loads)
    assert [rr.choose(None).url for _ in range(4)] == [A, B, C, A]
    loads.mark_down(B)
    assert [rr.choose(None).url for _ in range(3)] == [C, A, C]
    ll = LeastLoaded(URLS, loads)
    loads.begin(A)
    assert {ll.choose(None).url for _ in range(4)} == {C}
    for u in URLS:
        loads.mark_down(u)
    assert rr.choose(None).reason == "all_down"


def test_kv_aware_sends_a_prompt_to_its_holder_weighted_by_tier() -> None:
    loads, index = tracker(), PrefixIndex()
    hold(index, A, 1)  # 4 tokens in the GPU pool: worth 4
    hold(index, B, 6, MEDIUM_STORAGE)  # 24 tokens on disk: worth 6
    hold(index, C, 4, MEDIUM_CPU)  # 16 tokens in host memory: worth 8
    policy = kv_policy(loads, index)
    choice = policy.choose(Prompt(PROMPT + [1, 2]))
    assert (choice.url, choice.reason, choice.matched_tokens) == (C, "kv_hit", 16)
    assert policy.hits(Prompt(PROMPT))[B] == (6.0, 24)


def test_kv_aware_balances_hits_against_load() -> None:
    loads, index = tracker(), PrefixIndex()
    hold(index, A, 8)  # the whole prompt: worth hit_weight (4) queued requests
    policy = kv_policy(loads, index, hit_weight=4.0)
    for _ in range(3):
        loads.begin(A)
    assert policy.choose(Prompt(PROMPT)).url == A  # 4 - 3 > 0
    for _ in range(2):
        loads.begin(A)
    choice = policy.choose(Prompt(PROMPT))
    assert choice.url != A and choice.reason == "kv_load"  # 4 - 5 < 0 - 0
    hold(index, B, 4)
    for _ in range(2):
        loads.begin(C)
    choice = policy.choose(Prompt(PROMPT))
    assert (choice.url, choice.reason) == (B, "kv_load")  # B holds half, A is too busy


def test_kv_aware_fallbacks() -> None:
    loads, index = tracker(), PrefixIndex()
    policy = kv_policy(loads, index)
    assert policy.choose(None).reason == "no_prompt"
    assert policy.choose(Prompt(PROMPT)).reason == "no_match"
    hold(index, A, 8)
    loads.mark_down(A)
    choice = policy.choose(Prompt(PROMPT))
    assert choice.reason == "holder_down" and choice.url != A
    stale = kv_policy(loads, index, synced=lambda u: False)
    assert stale.choose(Prompt(PROMPT)).reason == "stale"


def test_recent_routes_hold_a_prefix_until_events_arrive() -> None:
    loads, index = tracker(), PrefixIndex()
    policy = kv_policy(loads, index, recent=RecentRoutes(ttl=30.0))
    first = policy.choose(Prompt(PROMPT))
    policy.routed(first, Prompt(PROMPT))
    loads.begin(first.url)  # still computing the first one
    again = policy.choose(Prompt(PROMPT + [5]))
    assert (again.url, again.reason) == (first.url, "kv_hit")
    # A salted prompt shares nothing with it.
    assert policy.choose(Prompt(PROMPT, cache_salt="s")).url != first.url


def test_recomputed_hashes_match_salted_prompts() -> None:
    loads, index = tracker(), PrefixIndex()
    salted = [external_block_hash(h) for h in hash_token_blocks(PROMPT, BS, cache_salt="s")]
    extra = [("s",)] + [None] * (len(salted) - 1)  # the salt rides on the first block
    ev = stored(salted, PROMPT, BS, extra_keys=extra)
    index.apply(B, KVEventBatch(ts=time.time(), events=[ev]))
    plain = kv_policy(loads, index)
    # Without the algorithm the salted blocks are invisible (never matched by tokens alone).
    assert plain.choose(Prompt(PROMPT, cache_salt="s")).reason == "no_match"
    assert plain.choose(Prompt(PROMPT)).reason == "no_match"
    rehash = kv_policy(loads, index, hasher=hash_token_blocks)
    assert rehash.choose(Prompt(PROMPT, cache_salt="s")).url == B
    assert rehash.choose(Prompt(PROMPT)).reason == "no_match"


def test_queue_depth_reads_vllm_names_then_kvferry_ones() -> None:
    vllm = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 5.0\n'
        'kvferry_num_requests_waiting{model_name="m"} 99.0\n'
    )
    assert queue_depth(vllm) == (3.0, 5.0)
    assert queue_depth('kvferry_num_requests_waiting{model_name="m"} 4\n') == (0.0, 4.0)
    assert queue_depth("other 1\n") is None


def test_load_tracker_polls_health_and_metrics_and_reports_comebacks() -> None:
    up = {A: True, B: False, C: True}

    def handler(request: httpx.Request) -> httpx.Response:
        url = f"http://{request.url.host}"
        if not up[url]:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(
            200, text="vllm:num_requests_running 1\nvllm:num_requests_waiting 6\n"
        )

    came_back: list[str] = []
    loads = LoadTracker(URLS, RoutingMetrics(CollectorRegistry()), on_up=came_back.append)

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            await loads.poll(http)
            assert [loads.up(u) for u in URLS] == [True, False, True]
            assert loads.load(A) == 7.0 and loads.load(B) == 0.0
            up[B] = True
            await loads.poll(http)

    asyncio.run(run())
    assert loads.up(B) and came_back == [B]
    for _ in range(9):
        loads.begin(C)
    assert loads.load(C) == 9.0  # in flight beats a stale scrape
