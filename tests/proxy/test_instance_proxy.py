"""``kvferry proxy --instance ...``: plain instances behind the proxy, in process (mocked
instances; a real ZMQ publisher for kv_aware), and the CLI's choices."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from kvferry.config import ConfigError
from kvferry.entrypoints.cli import build_parser
from kvferry.entrypoints.proxy import InstanceProxy, PDProxy, build_proxy_app, make_proxy
from kvferry.entrypoints.proxy.event_subscriber import EventSource
from kvferry.entrypoints.proxy.router import RouterConfig
from kvferry.tokenizer import Tokenizer
from tests.helpers.servers import wait_for
from tests.proxy.events_pub import TestPublisher, stored

URLS = ["http://i1", "http://i2", "http://i3"]
SSE = b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'
BODY = {"model": "m", "prompt": "hi", "max_tokens": 3}


class Instances:
    """Mock instances: record (host, path, body); ``down`` hosts refuse connections."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict]] = []
        self.down: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("refused", request=request)
        body = json.loads(request.content) if request.content else {}
        self.calls.append((host, request.url.path, body))
        if body.get("stream"):
            return httpx.Response(200, content=SSE)
        return httpx.Response(200, json={"choices": [{"text": host}]})

    def hosts(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture()
def make_client() -> Iterator[Callable[..., tuple[TestClient, InstanceProxy]]]:
    clients: list[TestClient] = []

    def make(
        mock: Instances, config: RouterConfig | None = None
    ) -> tuple[TestClient, InstanceProxy]:
        proxy = InstanceProxy(URLS, config or RouterConfig(poll_interval=0))
        proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(mock))
        client = TestClient(build_proxy_app(proxy))
        clients.append(client.__enter__())
        return client, proxy

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def test_round_robin_passes_bodies_and_streams_through(make_client) -> None:
    mock = Instances()
    client, proxy = make_client(mock)
    for _ in range(3):
        assert client.post("/v1/completions", json=BODY).status_code == 200
    with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
        assert r.read() == SSE
    assert mock.hosts() == ["i1", "i2", "i3", "i1"]
    assert mock.calls[0][2] == BODY and mock.calls[3][1] == "/v1/chat/completions"
    assert all(s.inflight == 0 for s in proxy.router.loads.state.values())
    text = client.get("/metrics").text
    assert (
        'kvferry_proxy_routing_decisions_total{instance="http://i1",reason="round_robin"} 2.0'
        in text
    )


def test_a_refused_instance_is_skipped_and_marked_down(make_client) -> None:
    mock = Instances()
    mock.down.add("i1")
    client, proxy = make_client(mock)
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("i2", "i3")
    assert not proxy.router.loads.up("http://i1")
    mock.down |= {"i2", "i3"}
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"]


def test_upstream_errors_keep_their_meaning(make_client) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "i1":
            return httpx.Response(400, json={"error": {"message": "bad max_tokens"}})
        return httpx.Response(500, json={"error": {"message": "boom"}})

    client, proxy = make_client(handler)  # type: ignore[arg-type]
    assert client.post("/v1/completions", json=BODY).status_code == 400
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 502 and "boom" in r.json()["error"]["message"]
    assert client.post("/v1/completions", content=b"{").status_code == 400
    assert all(s.inflight == 0 for s in proxy.router.loads.state.values())


def test_kv_aware_routes_to_the_instance_its_events_name(make_client, tiny_model_factory) -> None:
    model = tiny_model_factory("llama")
    tok = Tokenizer(model)
    system = "You are the ferry's helpful assistant. Answer briefly. " * 4
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    bs = 4
    n = len(ids) // bs
    pubs = [TestPublisher() for _ in URLS]
    try:
        cfg = RouterConfig(
            policy="kv_aware",
            tokenizer=str(model),
            events=[
                EventSource(u, p.endpoint, p.replay_endpoint)
                for u, p in zip(URLS, pubs, strict=True)
            ],
            poll_interval=0,
            recent_ttl=0,
        )
        mock = Instances()
        client, proxy = make_client(mock, cfg)
        sub = proxy.router.subscriber
        for p in pubs:
            p.wait_subscribed()
        wait_for(lambda: all(sub.synced(u) for u in URLS), what="the subscribers")
        # i3 announces the chat prompt's blocks (all but a partial last one).
        pubs[2].publish([stored(list(range(1, n + 1)), ids[: n * bs], bs)])
        wait_for(lambda: proxy.router.index.size(URLS[2]) == n, what="the index")
        chat = {"model": "m", "messages": messages, "max_tokens": 2}
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
        assert mock.hosts() == ["i3"] * 3
        # A completion with the same text as tokens: same blocks.
        r = client.post("/v1/completions", json={**BODY, "prompt": ids})
        assert r.json()["choices"][0]["text"] == "i3"
        # Unknown prompt: least loaded, counted as no_match.
        client.post("/v1/completions", json={**BODY, "prompt": "something else entirely"})
        text = client.get("/metrics").text
        assert 'reason="kv_hit"} 4.0' in text and 'reason="no_match"} 1.0' in text
        assert f'kvferry_proxy_kv_index_blocks{{instance="http://i3"}} {float(n)}' in text
    finally:
        for p in pubs:
            p.close()


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["proxy", *argv])


def test_cli_picks_the_mode_and_checks_routing_flags(tiny_model_factory) -> None:
    proxy = make_proxy(
        _args("--instance", "127.0.0.1:1", "127.0.0.1:2", "--policy", "least_loaded")
    )
    assert isinstance(proxy, InstanceProxy) and proxy.router.policy.name == "least_loaded"
    pd = make_proxy(_args("--prefill", "p:1", "--decode", "d:1"))
    assert isinstance(pd, PDProxy) and pd.router is None  # the P/D flow as before
    model = str(tiny_model_factory("llama"))
    pd = make_proxy(
        _args(
            "--prefill",
            "p:1",
            "p:2",
            "--decode",
            "d:1",
            "--policy",
            "kv_aware",
            "--tokenizer",
            model,
            "--kv-events-endpoint",
            "tcp://p:5557",
            "tcp://p:5558",
        )
    )
    assert isinstance(pd, PDProxy) and pd.router is not None
    assert pd.router.policy.name == "kv_aware"
    with pytest.raises(ConfigError, match="tokenizer"):
        make_proxy(_args("--instance", "a:1", "--policy", "kv_aware"))
    with pytest.raises(ConfigError, match="one --kv-events-endpoint"):
        make_proxy(
            _args(
                "--instance",
                "a:1",
                "b:1",
                "--policy",
                "kv_aware",
                "--tokenizer",
                model,
                "--kv-events-endpoint",
                "tcp://a:1",
            )
        )
    with pytest.raises(ConfigError, match="either"):
        make_proxy(_args("--instance", "a:1", "--prefill", "p:1", "--decode", "d:1"))
    with pytest.raises(ConfigError, match="needs"):
        make_proxy(_args("--prefill", "p:1"))


def test_pd_prefill_side_uses_the_policy() -> None:
    """P/D with a router: the prefill instance is the policy's pick (least_loaded here)."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.url.host}{request.url.path}")
        if request.url.host.startswith("p"):
            time.sleep(0)
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    args = _args("--prefill", "p1", "p2", "--decode", "d1", "--policy", "least_loaded")
    args.load_poll_interval = 0
    proxy = make_proxy(args)
    assert isinstance(proxy, PDProxy) and proxy.router is not None
    proxy.router.loads.begin("http://p1")  # p1 is busy
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    with TestClient(build_proxy_app(proxy)) as client:
        for _ in range(2):
            assert client.post("/v1/completions", json=BODY).status_code == 200
    assert calls == ["p2/v1/completions", "d1/v1/completions"] * 2
    assert proxy.router.loads.state["http://p2"].inflight == 0
