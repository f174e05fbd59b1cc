"""End to end: three ``kvferry serve`` instances publishing KV events behind ``kvferry proxy
--policy kv_aware``; many users over a few long shared system prompts.

The first test: repeats of a system prompt go to the instance holding it (the answers report
its cached tokens), and every answer is token-identical to one offline instance (greedy). The
second: the holder is killed (requests fall back and the prompt moves), then restarted on
the same ports (the proxy resyncs its index from the new publisher and routes to it again).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from kvferry import LLM, SamplingParams
from kvferry.entrypoints.demo import Instance, start
from kvferry.tokenizer import Tokenizer
from tests.helpers.servers import (
    OFFLINE_KW,
    _env,
    dead_port,
    metric,
    ready,
    start_server,
    stop,
    wait_for,
    wait_healthy,
    wait_listening,
)

MAX_TOKENS = 6
SYSTEMS = [
    f"You are assistant number {i} of the river ferry company. "
    + "Timetables, tickets, bicycles and dogs are your subjects; answer in one line. " * 5
    for i in range(3)
]


class Cluster:
    def __init__(self, model: Path, logs: Path) -> None:
        self.model, self.logs = model, logs
        self.ports = [(dead_port(), dead_port(), dead_port()) for _ in range(3)]
        self.servers: list[Instance] = [self.start_server(i) for i in range(3)]
        self.urls = [f"http://127.0.0.1:{http}" for http, _, _ in self.ports]
        argv = ["proxy", "--port", "0", "--instance", *self.urls, "--policy", "kv_aware"]
        argv += ["--tokenizer", str(model), "--load-poll-interval", "0.2"]
        argv += ["--kv-events-endpoint", *(f"tcp://127.0.0.1:{e}" for _, e, _ in self.ports)]
        argv += ["--kv-replay-endpoint", *(f"tcp://127.0.0.1:{r}" for _, _, r in self.ports)]
        self.proxy = start("proxy", argv, logs, env=_env())
        ready(*self.servers, self.proxy)
        self.client = openai.OpenAI(base_url=self.proxy.url + "/v1", api_key="x", max_retries=0)
        self.llm = LLM(model=str(model), **OFFLINE_KW)
        self.tok = Tokenizer(model)

    def start_server(self, i: int) -> Instance:
        http, events, replay = self.ports[i]
        cfg = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{events}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
        return start_server(
            f"serve{i}", self.model, self.logs, None, "--port", str(http),
            "--kv-events-config", json.dumps(cfg),
        )  # fmt: skip

    def proxy_metric(self, name: str, **labels: str) -> float:
        return metric(self.proxy.url, name, **labels)

    def index_blocks(self) -> list[float]:
        return [self.proxy_metric("kvferry_proxy_kv_index_blocks", instance=u) for u in self.urls]

    def ask(
        self, system: str, user: str, client: openai.OpenAI | None = None
    ) -> tuple[int, list[int]]:
        """(cached prompt tokens, output token ids) of one greedy chat request."""
        messages: Any = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        r = (client or self.client).chat.completions.create(
            model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        details = r.usage.prompt_tokens_details if r.usage else None
        return (details.cached_tokens or 0) if details else 0, list(r.choices[0].token_ids)  # type: ignore[attr-defined]

    def offline(self, system: str, user: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        ids = self.tok.encode(self.tok.apply_chat_template(messages), add_special_tokens=False)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        (out,) = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return list(out.outputs[0].token_ids)

    def system_tokens(self, system: str) -> int:
        return len(
            self.tok.encode(
                self.tok.apply_chat_template([{"role": "system", "content": system}]),
                add_special_tokens=False,
            )
        )

    def close(self) -> None:
        stop([self.proxy, *self.servers])
        for inst in (self.proxy, *self.servers):
            assert "Traceback" not in inst.log.read_text(), inst.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def cluster(tiny_model_factory, tmp_path_factory) -> Iterator[Cluster]:
    c = Cluster(tiny_model_factory("llama"), tmp_path_factory.mktemp("kv-routing"))
    try:
        yield c
    finally:
        c.close()


def test_repeats_go_to_the_holder_and_answers_match_one_instance(cluster: Cluster) -> None:
    # First user of each system prompt: nobody holds it yet.
    for s in SYSTEMS:
        cached, out = cluster.ask(s, "user 0: when is the first ferry?")
        assert out == cluster.offline(s, "user 0: when is the first ferry?")
    wait_for(lambda: sum(cluster.index_blocks()) >= 3 * 8, what="the instances' events")
    # Many users, concurrently: each lands where its system prompt is cached.
    jobs = [(s, f"user {u}: can I bring my dog?") for u in range(1, 5) for s in SYSTEMS]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda j: cluster.ask(*j), jobs))
    for (s, user), (cached, out) in zip(jobs, results, strict=True):
        assert cached >= cluster.system_tokens(s) - 16, (s[:30], cached)
        assert out == cluster.offline(s, user)
    assert cluster.proxy_metric("kvferry_proxy_kv_event_errors_total") == 0
    hits = sum(
        cluster.proxy_metric("kvferry_proxy_routing_decisions_total", reason="kv_hit", instance=u)
        for u in cluster.urls
    )
    assert hits >= len(jobs)


def test_holder_killed_falls_back_then_recovers(cluster: Cluster) -> None:
    system = "You are the harbour master. " + "Tides, moorings and fees, in few words. " * 6
    before = cluster.index_blocks()
    cluster.ask(system, "first")
    wait_for(lambda: sum(cluster.index_blocks()) > sum(before), what="the new prompt's events")
    grown = [a - b for a, b in zip(cluster.index_blocks(), before, strict=True)]
    holder = max(range(3), key=lambda i: grown[i])
    h_url = cluster.urls[holder]
    stop([cluster.servers[holder]])

    # Killed: requests still succeed elsewhere, same answers; the prompt moves to a new holder.
    outs = [cluster.ask(system, f"after kill {u}") for u in range(3)]
    for u, (_, out) in enumerate(outs):
        assert out == cluster.offline(system, f"after kill {u}")
    assert cluster.proxy_metric("kvferry_proxy_instance_up", instance=h_url) == 0
    assert outs[-1][0] >= cluster.system_tokens(system) - 16, "cached again on the fallback"

    # Back on the same ports: a fresh process (empty cache, sequence numbers from 0).
    resyncs = sum(
        cluster.proxy_metric("kvferry_proxy_kv_index_resyncs_total", instance=h_url, cause=c)
        for c in ("restart", "reconnect")
    )
    cluster.servers[holder] = cluster.start_server(holder)
    wait_listening(cluster.servers[holder])
    wait_healthy(h_url, inst=cluster.servers[holder])
    # A prompt only the restarted instance has seen: the proxy learns it from its new stream.
    fresh = "You are the lighthouse keeper. " + "Storm warnings and lamp hours, briefly. " * 6
    direct = openai.OpenAI(base_url=h_url + "/v1", api_key="x", max_retries=0)
    cluster.ask(fresh, "seed", client=direct)
    wait_for(
        lambda: cluster.proxy_metric("kvferry_proxy_instance_up", instance=h_url) == 1,
        what="the proxy to see the instance back",
    )
    n_blocks = cluster.system_tokens(fresh) // 16
    wait_for(
        lambda: cluster.proxy_metric("kvferry_proxy_kv_index_blocks", instance=h_url) >= n_blocks,
        timeout=30,
        what="the restarted instance's index",
    )
    after = sum(
        cluster.proxy_metric("kvferry_proxy_kv_index_resyncs_total", instance=h_url, cause=c)
        for c in ("restart", "reconnect")
    )
    assert after > resyncs
    for u in range(3):
        cached, out = cluster.ask(fresh, f"via proxy {u}")
        assert cached >= cluster.system_tokens(fresh) - 16
        assert out == cluster.offline(fresh, f"via proxy {u}")
