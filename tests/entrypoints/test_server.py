"""``kvferry serve`` as a subprocess, driven through the official ``openai`` client: greedy
answers token-identical to offline ``LLM.generate``, streaming and not, kv_transfer_params in
and out, the release endpoint, OpenAI-shaped errors, API keys, aborts on disconnect, metrics."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvferry import LLM, SamplingParams
from tests.helpers.servers import OFFLINE_KW, metric, pd_kv_config, serving, wait_for

KEY = "test-key"
PROMPTS = ["The ferry crossed the river at dawn", "A short note on caches:"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
GREEDY = {"temperature": 0.0, "max_tokens": 12}
EXTRA = {"ignore_eos": True, "return_token_ids": True}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server")
    kv = pd_kv_config(logs / "store")
    with serving("server", tiny_model_factory("llama"), logs, kv, "--api-key", KEY) as inst:
        yield inst


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model_factory) -> LLM:
    return LLM(model=str(tiny_model_factory("llama")), **OFFLINE_KW)


def _offline_ids(llm: LLM, prompt) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def _chat_prompt(llm: LLM) -> dict:
    tok = llm.get_tokenizer()
    return {"prompt_token_ids": tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)}


def test_completions_match_offline(client, offline) -> None:
    want = [_offline_ids(offline, p) for p in PROMPTS]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], extra_body=EXTRA, **GREEDY)
    c = r.choices[0]
    assert c.token_ids == want[0] and c.finish_reason == "length"
    assert c.text == offline.get_tokenizer().decode(want[0])
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(c.prompt_token_ids)
    # A batch of prompts: one choice each, in order.
    r = client.completions.create(model="tiny", prompt=PROMPTS, extra_body=EXTRA, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.token_ids for c in r.choices] == want
    # Streaming: the deltas add up to the same tokens and text.
    ids, text, finish = [], "", []
    for ev in client.completions.create(
        model="tiny", prompt=PROMPTS[1], stream=True, extra_body=EXTRA, **GREEDY
    ):
        ids += ev.choices[0].token_ids
        text += ev.choices[0].text
        finish.append(ev.choices[0].finish_reason)
    assert ids == want[1] and text == offline.get_tokenizer().decode(want[1])
    assert finish[-1] == "length" and set(finish[:-1]) <= {None}


def test_chat_matches_offline(client, offline) -> None:
    want = _offline_ids(offline, _chat_prompt(offline))
    r = client.chat.completions.create(model="tiny", messages=CHAT, extra_body=EXTRA, **GREEDY)
    assert r.choices[0].token_ids == want
    assert r.choices[0].message.role == "assistant"
    assert r.prompt_token_ids == _chat_prompt(offline)["prompt_token_ids"]
    events = list(
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
            **GREEDY,
        )
    )
    assert events[0].choices[0].delta.role == "assistant"
    ids = [t for ev in events if ev.choices for t in ev.choices[0].token_ids]
    assert ids == want
    assert (
        "".join(ev.choices[0].delta.content or "" for ev in events if ev.choices)
        == r.choices[0].message.content
    )
    assert events[-1].usage.completion_tokens == 12 and not events[-1].choices


def test_kv_transfer_params_round_trip_and_release(server, client, offline) -> None:
    """One server plays prefill, then decode, then the release endpoint frees held blocks."""
    want = _offline_ids(offline, PROMPTS[0] * 4)
    held = lambda: metric(server.url, "kvferry_num_requests_held_by_connector")  # noqa: E731
    usage = lambda: metric(server.url, "vllm:kv_cache_usage_perc")  # noqa: E731
    prefill = {"kv_transfer_params": {"do_remote_decode": True}, **EXTRA}
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[0] * 4, temperature=0.0, max_tokens=1, extra_body=prefill
    )
    params = r.kv_transfer_params
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert r.choices[0].token_ids == want[:1]
    wait_for(lambda: held() == 1, what="the prefill to hold its blocks")
    # Decode with those params (streaming): identical tokens, prompt KV from the connector.
    hits0 = metric(server.url, "vllm:external_prefix_cache_hits_total")
    events = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[0] * 4,
            stream=True,
            # Another cache salt: no local prefix hit on the prefill's own blocks.
            extra_body={**EXTRA, "kv_transfer_params": params, "cache_salt": "decode"},
            **GREEDY,
        )
    )
    assert [t for ev in events for t in ev.choices[0].token_ids] == want
    assert events[-1].kv_transfer_params is None
    assert metric(server.url, "vllm:external_prefix_cache_hits_total") > hits0
    wait_for(lambda: held() == 0 and usage() == 0, what="the decode to release the prefill")
    assert metric(server.url, "kvferry_kv_connector_total", stat="bytes_transferred") > 0
    # Streaming prefill: params on the final chunk; then give them back explicitly.
    events = list(
        client.completions.create(
            model="tiny", prompt=PROMPTS[1] * 4, stream=True, max_tokens=1, extra_body=prefill
        )
    )
    params = events[-1].kv_transfer_params
    assert params["do_remote_prefill"] is True
    wait_for(lambda: held() == 1, what="the prefill to hold its blocks")
    resp = httpx.post(
        server.url + "/v1/kv/release", json={"kv_transfer_params": params}, headers=AUTH
    )
    assert resp.status_code == 200 and resp.json()["released"] is True
    wait_for(lambda: held() == 0 and usage() == 0, what="the release to free the blocks")
    # A decode request the server rejects (here: max_tokens=0) gives the KV back as well.
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=1, extra_body=prefill)
    wait_for(lambda: held() == 1, what="the prefill to hold its blocks")
    bad = {"prompt": PROMPTS[0], "max_tokens": 0, "kv_transfer_params": r.kv_transfer_params}
    resp = httpx.post(server.url + "/v1/completions", json=bad, headers=AUTH)
    assert resp.status_code == 400
    wait_for(lambda: held() == 0 and usage() == 0, what="the rejected decode to release")


BAD_BODIES = [
    ("/v1/completions", "{not json", None),
    ("/v1/completions", "[1, 2]", None),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, None),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, None),
    ("/v1/completions", {"prompt": "x", "n": 3}, "n"),
    ("/v1/completions", {"prompt": [1, 99999]}, None),
    ("/v1/completions", {"prompt": "word " * 600}, None),
    ("/v1/completions", {"prompt": ["a", "b"], "kv_transfer_params": {}}, "kv_transfer_params"),
    ("/v1/completions", {"prompt": "x", "stream": True, "min_tokens": 9, "max_tokens": 2}, None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
        None,
    ),
    ("/v1/kv/release", {"kv_transfer_params": "nope"}, "kv_transfer_params"),
    ("/v1/kv/release", {"kv_transfer_params": {}}, None),
]


@pytest.mark.parametrize("path,body,param", BAD_BODIES)
def test_malformed_bodies_get_openai_400(server, path, body, param) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(server.url + path, content=content, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param


def test_unknown_model_bad_key_and_open_endpoints(server, client) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_client_disconnect_aborts_and_frees(server) -> None:
    aborted = lambda: metric(server.url, "vllm:request_success_total", finished_reason="abort")  # noqa: E731
    before = aborted()
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    wait_for(lambda: aborted() == before + 1, what="the stream's abort")
    # Non-streaming: the client gives up (timeout) while the engine still works.
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.3)
    wait_for(lambda: aborted() == before + 2, what="the non-streaming abort")
    wait_for(
        lambda: (
            metric(server.url, "vllm:num_requests_running") == 0
            and metric(server.url, "vllm:kv_cache_usage_perc") == 0
        ),
        what="blocks to be freed",
    )


def test_metrics_names(server) -> None:
    text = httpx.get(server.url + "/metrics").text
    for name in [
        "vllm:request_success_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "kvferry_num_requests_held_by_connector",
        "kvferry_prefix_cache_hit_rate",
        "kvferry_external_prefix_cache_hit_rate",
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",'
        'source="external_kv_transfer"}',
        "kvferry_kv_connector_samples_sum",
    ]:
        assert name in text, name
    assert 'finished_reason="length"' in text and 'stat="transfer_duration"' in text


def test_cli_errors_are_one_line(tiny_model_factory, capsys) -> None:
    from kvferry.entrypoints.cli import main

    model = str(tiny_model_factory("llama"))
    for argv, needle in [
        (["serve", model, "--kv-transfer-config", "{oops"], "not valid JSON"),
        (["serve", model, "--port", "-5"], "cannot listen"),
        (["proxy", "--prefill", "", "--decode", "x"], "must not be empty"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and "Traceback" not in err
