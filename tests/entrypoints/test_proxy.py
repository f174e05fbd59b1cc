"""The P/D proxy: the flow and every failure path against mocked instances (in process), then
for real with a prefill and a decode ``kvferry serve`` and the PDTestConnector."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from kvferry import LLM, SamplingParams
from kvferry.entrypoints.proxy import PDProxy, build_proxy_app
from tests.helpers.servers import (
    OFFLINE_KW,
    dead_port,
    metric,
    pd_kv_config,
    ready,
    start_proxy,
    start_server,
    stop,
    wait_for,
    wait_listening,
)

P_PARAMS = {"do_remote_prefill": True, "remote_request_id": "r1", "remote_engine_id": "e1"}
BODY = {"model": "m", "prompt": "hi", "max_tokens": 7, "stream_options": {"include_usage": 1}}
SSE = b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'

# -- in process, mocked instances ---------------------------------------------------------------

Handler = Callable[[httpx.Request], httpx.Response]


def _ok_prefill(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"choices": [], "kv_transfer_params": P_PARAMS})


class Mock:
    """Records every call; answers through ``prefill`` / ``decode`` / ``release`` handlers."""

    def __init__(self, decode: Handler, prefill: Handler = _ok_prefill) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.handlers = {"p": prefill, "d": decode}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.calls.append((f"{request.url.host}{request.url.path}", body))
        if request.url.path == "/v1/kv/release":
            return httpx.Response(200, json={"released": True})
        return self.handlers[request.url.host[0]](request)

    def paths(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture()
def make_client() -> Iterator[Callable[..., tuple[TestClient, Mock, PDProxy]]]:
    clients: list[TestClient] = []

    def make(
        mock: Mock, prefill: tuple[str, ...] = ("p1",), decode: tuple[str, ...] = ("d1",)
    ) -> tuple[TestClient, Mock, PDProxy]:
        proxy = PDProxy([f"http://{u}" for u in prefill], [f"http://{u}" for u in decode])
        proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(mock))
        client = TestClient(build_proxy_app(proxy))
        clients.append(client.__enter__())
        return client, mock, proxy

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def _released(mock: Mock, wait: float = 5.0) -> list[dict]:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        found = [b for p, b in mock.calls if p.endswith("/v1/kv/release")]
        if found:
            return found
        time.sleep(0.01)
    return []


def test_flow_bodies_and_round_robin(make_client) -> None:
    client, mock, _ = make_client(
        Mock(lambda r: httpx.Response(200, json={"choices": [{"text": "x"}]})),
        prefill=("p1", "p2"),
        decode=("d1", "d2"),
    )
    for _ in range(4):
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x"
    assert mock.paths() == [f"{h}/v1/completions" for h in ("p1", "d1", "p2", "d2") * 2]
    p_body, d_body = mock.calls[0][1], mock.calls[1][1]
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert "stream_options" not in p_body
    assert d_body == {**BODY, "kv_transfer_params": P_PARAMS}


def test_streaming_is_passed_through(make_client) -> None:
    decode = lambda r: httpx.Response(200, content=SSE)  # noqa: E731
    client, mock, _ = make_client(Mock(decode))
    with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200 and r.read() == SSE
    assert mock.calls[1][1]["stream"] is True
    assert not _released(mock, wait=0.2), "a successful decode must not release"


def _refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


@pytest.mark.parametrize(
    "decode,status",
    [
        (_refuse, 503),
        (lambda r: httpx.Response(500, json={"error": {"message": "kaput"}}), 502),
        (lambda r: httpx.Response(400, json={"error": {"message": "bad", "type": "x"}}), 400),
    ],
)
def test_failed_decode_releases_the_prefill(make_client, decode, status) -> None:
    client, mock, proxy = make_client(Mock(decode))
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and set(err) >= {"message", "type"}
    if status != 400:
        assert "http://d1" in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert _released(mock) == [{"kv_transfer_params": P_PARAMS}]
    assert proxy.metrics.releases.labels("ok")._value.get() == 1


def test_decode_timeout_is_504_without_release(make_client) -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("too slow", request=request)

    client, mock, _ = make_client(Mock(slow))
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 504 and "did not answer" in r.json()["error"]["message"]
    # The decode instance may still be reading the prefill's blocks: no early release.
    assert not _released(mock, wait=0.2)


def test_decode_breaking_mid_stream_releases(make_client) -> None:
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": []}\n\n'
            raise httpx.ReadError("peer closed")

    client, mock, _ = make_client(Mock(lambda r: httpx.Response(200, stream=Broken())))
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        text = r.read().decode()
    assert "broke off" in text and text.endswith("data: [DONE]\n\n")
    assert _released(mock) == [{"kv_transfer_params": P_PARAMS}]


@pytest.mark.parametrize(
    "prefill,status",
    [
        (_refuse, 503),
        (lambda r: httpx.Response(500, text="oops"), 502),
        (lambda r: httpx.Response(400, json={"error": {"message": "bad prompt"}}), 400),
    ],
)
def test_failed_prefill_never_reaches_decode(make_client, prefill, status) -> None:
    client, mock, _ = make_client(Mock(lambda r: pytest.fail("decode called"), prefill))
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == status and r.json()["error"]["message"]
    assert mock.paths() == ["p1/v1/chat/completions"]


def test_bad_body_and_prefill_without_params(make_client) -> None:
    no_params = lambda r: httpx.Response(200, json={"choices": []})  # noqa: E731
    client, mock, _ = make_client(Mock(lambda r: httpx.Response(200, json={}), no_params))
    assert client.post("/v1/completions", content=b"{oops").status_code == 400
    assert client.post("/v1/completions", json=[1]).status_code == 400
    assert client.post("/v1/completions", json=BODY).status_code == 200
    assert "kv_transfer_params" not in mock.calls[1][1]  # decode recomputes
    assert b"kvferry_proxy_requests_total" in client.get("/metrics").content


# -- for real: two servers and the proxy -------------------------------------------------------


@pytest.fixture(scope="module")
def pd(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    model = tiny_model_factory("llama")
    kv = pd_kv_config(logs / "store", lease_s=120.0)
    p = start_server("prefill", model, logs, kv)
    d = start_server("decode", model, logs, kv)
    procs = [p, d]
    try:
        # The servers print their address before building the engine: start the proxies now.
        p_url, d_url = wait_listening(p), wait_listening(d)
        procs.append(start_proxy("proxy", logs, [p_url], [d_url]))
        procs.append(start_proxy("proxy-dead", logs, [p_url], [f"127.0.0.1:{dead_port()}"]))
        ready(p, d, procs[2])
        wait_listening(procs[3])
        yield {i.name: i for i in procs}
    finally:
        stop(procs)
        for inst in procs:
            assert "Traceback" not in inst.log.read_text(), inst.log.read_text()[-3000:]


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def test_pd_answers_match_offline(pd, tiny_model_factory) -> None:
    llm = LLM(model=str(tiny_model_factory("llama")), **OFFLINE_KW)
    tok = llm.get_tokenizer()
    prompt = "The ferry crossed the river at dawn, carrying the morning post. " * 2
    chat = [{"role": "user", "content": prompt}]
    chat_ids = tok.encode(tok.apply_chat_template(chat), add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [
        o.outputs[0].token_ids
        for o in llm.generate([prompt, {"prompt_token_ids": chat_ids}], params, use_tqdm=False)
    ]
    extra = {"ignore_eos": True, "return_token_ids": True}
    client = _openai(pd["proxy"].url)
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=extra
    )
    assert r.choices[0].token_ids == want[0]
    events = client.chat.completions.create(
        model="tiny", messages=chat, max_tokens=12, temperature=0, stream=True, extra_body=extra
    )
    assert [t for ev in events for t in ev.choices[0].token_ids] == want[1]
    d_url, p_url = pd["decode"].url, pd["prefill"].url
    assert metric(d_url, "vllm:external_prefix_cache_hits_total") >= 32
    assert metric(d_url, "kvferry_kv_connector_total", stat="bytes_transferred") > 0
    # The decode side released the prefill's held blocks (long before the 120 s lease).
    wait_for(
        lambda: (
            metric(p_url, "kvferry_num_requests_held_by_connector") == 0
            and metric(p_url, "vllm:kv_cache_usage_perc") == 0
        ),
        what="the prefill's blocks to be released",
    )
    assert httpx.get(pd["proxy"].url + "/health").status_code == 200


def test_demo_exercise_against_the_pd_setup(pd, capsys) -> None:
    """``kvferry demo pd`` minus the process start-up (the same helpers the fixture uses)."""
    from argparse import Namespace

    from kvferry.entrypoints.demo import exercise

    args = Namespace(num_requests=1, max_tokens=8)
    assert exercise(args, pd["prefill"].url, pd["decode"].url, pd["proxy"].url, "tiny") == 0
    out = capsys.readouterr().out
    assert "same as single instance: yes" in out and "decode instance: connector moved" in out


def test_decode_down_gives_503_and_frees_prefill_blocks(pd) -> None:
    proxy, p_url = pd["proxy-dead"].url, pd["prefill"].url
    with pytest.raises(openai.APIStatusError) as e:
        _openai(proxy).completions.create(model="tiny", prompt="word " * 40, max_tokens=4)
    assert e.value.status_code == 503 and "unreachable" in e.value.message
    wait_for(
        lambda: metric(proxy, "kvferry_proxy_kv_releases_total", outcome="ok") == 1,
        what="the proxy's release",
    )
    wait_for(
        lambda: (
            metric(p_url, "kvferry_num_requests_held_by_connector") == 0
            and metric(p_url, "vllm:kv_cache_usage_perc") == 0
        ),
        what="the prefill's blocks to be released",
    )
    assert httpx.get(proxy + "/health").status_code == 503


def test_event_stream_cleans_up_even_if_never_started() -> None:
    import asyncio

    from kvferry.entrypoints.openai.http_utils import EventStream

    closed: list[int] = []

    async def gen():
        yield "never"

    async def cleanup() -> None:
        closed.append(1)

    asyncio.run(EventStream(gen(), cleanup).aclose())
    assert closed == [1]
