"""vLLM's serving endpoints people script against, on a real ``kvferry serve`` (and through
``kvferry proxy`` where it forwards): ``/version``, ``/tokenize``, ``/detokenize``, the
``/v1/models`` card's fields, ``max_tokens`` beyond the remaining context refused with a 400
(never clamped), and malformed JSON answered with a readable message naming the ``body``."""

from __future__ import annotations

import httpx
import pytest

from kvferry import LLM
from kvferry.version import __version__
from tests.helpers.servers import (
    OFFLINE_KW,
    pd_kv_config,
    ready,
    serving,
    start_proxy,
    stop,
)

CARD_FIELDS = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"}
PERMISSION_FIELDS = {
    "id",
    "object",
    "created",
    "allow_create_engine",
    "allow_sampling",
    "allow_logprobs",
    "allow_search_indices",
    "allow_view",
    "allow_fine_tuning",
    "organization",
    "group",
    "is_blocking",
}
CHAT = [{"role": "user", "content": "Hi there!"}]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-endpoints")
    with serving("server", model, logs, pd_kv_config(logs / "store")) as inst:
        yield inst


@pytest.fixture(scope="module")
def proxy(server, tmp_path_factory):
    inst = start_proxy("proxy", tmp_path_factory.mktemp("proxy"), [server.url], [server.url])
    try:
        ready(inst)
        yield inst
    finally:
        stop([inst])


@pytest.fixture(scope="module")
def tokenizer(model):
    return LLM(model=str(model), **OFFLINE_KW).get_tokenizer()


def _post(url: str, body: dict | str) -> httpx.Response:
    if isinstance(body, str):
        headers = {"Content-Type": "application/json"}
        return httpx.post(url, content=body, headers=headers, timeout=60)
    return httpx.post(url, json=body, timeout=60)


def test_version(server) -> None:
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_tokenize_prompt_and_messages(server, tokenizer) -> None:
    prompt = "The ferry crossed the river"
    r = _post(server.url + "/tokenize", {"model": "tiny", "prompt": prompt})
    assert r.status_code == 200, r.text
    want = tokenizer.encode(prompt)
    assert r.json() == {
        "count": len(want),
        "max_model_len": 512,
        "tokens": want,
        "token_strs": None,
    }
    body = {"prompt": prompt, "add_special_tokens": False, "return_token_strs": True}
    got = _post(server.url + "/tokenize", body).json()
    assert got["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert len(got["token_strs"]) == got["count"] and all(got["token_strs"])
    # Messages go through the chat template, whose special tokens are already there.
    got = _post(server.url + "/tokenize", {"messages": CHAT}).json()
    text = tokenizer.apply_chat_template(CHAT)
    assert got["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    # The same ids the chat endpoint reports for its prompt.
    chat = _post(
        server.url + "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 1, "return_token_ids": True},
    ).json()
    assert chat["prompt_token_ids"] == got["tokens"]


def test_detokenize_round_trip(server, tokenizer) -> None:
    ids = tokenizer.encode("A short note on caches:")
    r = _post(server.url + "/detokenize", {"model": "tiny", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(ids, False)}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-17"}, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_tokenize_errors(server, path, body, param) -> None:
    r = _post(server.url + path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def _check_card(body: dict) -> None:
    card = body["data"][0]
    assert set(card) >= CARD_FIELDS and card["object"] == "model" and card["id"] == "tiny"
    assert card["max_model_len"] == 512 and card["parent"] is None and card["root"]
    assert set(card["permission"][0]) == PERMISSION_FIELDS
    assert card["permission"][0]["object"] == "model_permission"


def test_models_card_fields(server, proxy) -> None:
    _check_card(httpx.get(server.url + "/v1/models").json())
    _check_card(httpx.get(proxy.url + "/v1/models").json())


@pytest.mark.parametrize("via", ["server", "proxy"])
def test_max_tokens_beyond_the_context_is_a_400(server, proxy, via) -> None:
    url = (server if via == "server" else proxy).url
    r = _post(url + "/v1/completions", {"prompt": "hello", "max_tokens": 100_000})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens"
    assert "maximum context length is 512 tokens" in err["message"]
    body = {"messages": CHAT, "max_completion_tokens": 100_000}
    r = _post(url + "/v1/chat/completions", body)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    # What fits is served, up to the context.
    r = _post(url + "/v1/completions", {"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("via", ["server", "proxy"])
def test_malformed_json_gets_a_readable_message(server, proxy, via) -> None:
    url = (server if via == "server" else proxy).url
    r = _post(url + "/v1/completions", '{"prompt": "x", "max_tokens": 5,}')
    assert r.status_code == 400
    err = r.json()["error"]
    assert "not valid JSON" in err["message"] and not err["message"].split(":")[0].isdigit()
    if via == "server":
        assert "line 1 column" in err["message"]
    assert err["param"] is None
