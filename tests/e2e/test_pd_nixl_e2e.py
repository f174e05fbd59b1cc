"""Prefill/decode disaggregation end to end: two ``kvferry serve`` instances with NixlConnector
(real NIXL/UCX on loopback) behind ``kvferry proxy``, driven by the official ``openai`` client.

Greedy answers are token-identical to one offline instance for prompts shorter than a block,
exactly a block multiple, and several thousand tokens, streaming and not; after each request
the prefill instance's blocks are all back in its free pool."""

from __future__ import annotations

import openai
import pytest

from kvferry import LLM, SamplingParams
from tests.helpers.servers import (
    metric,
    ready,
    start_proxy,
    start_server,
    stop,
    wait_for,
    wait_listening,
)

LONG = ["--max-model-len", "4096", "--max-num-batched-tokens", "2048"]
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def _nixl(port: int) -> dict:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_port": port,
        "kv_connector_extra_config": {"side_channel_port": 0, "kv_lease_duration": 60.0},
    }


@pytest.fixture(scope="module")
def pd(tiny_model_factory, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("UCX_NET_DEVICES", "lo")
    logs = tmp_path_factory.mktemp("pd-nixl")
    model = tiny_model_factory("llama")
    p = start_server("prefill", model, logs, _nixl(15001), *LONG)
    d = start_server("decode", model, logs, _nixl(15101), *LONG)
    procs = [p, d]
    try:
        p_url, d_url = wait_listening(p), wait_listening(d)
        procs.append(start_proxy("proxy", logs, [p_url], [d_url]))
        ready(*procs)
        yield {i.name: i for i in procs}
    finally:
        stop(procs)
        for inst in procs:
            assert "Traceback" not in inst.log.read_text(), inst.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def offline(tiny_model_factory) -> LLM:
    return LLM(
        model=str(tiny_model_factory("llama")),
        dtype="float32",
        max_model_len=4096,
        max_num_batched_tokens=2048,
    )


def _ids(n: int, seed: int) -> list[int]:
    return [5 + (seed * 7919 + i * 104729) % 500 for i in range(n)]


@pytest.mark.parametrize(("length", "stream"), [(7, False), (64, True), (3000, False)])
def test_pd_is_token_identical_and_frees_prefill_blocks(pd, offline, length, stream) -> None:
    prompt = _ids(length, length)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    client = openai.OpenAI(base_url=pd["proxy"].url + "/v1", api_key="x", max_retries=0)
    kw = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    if stream:
        got = [
            t
            for ev in client.completions.create(stream=True, extra_body=EXTRA, **kw)
            for t in ev.choices[0].token_ids
        ]
    else:
        got = client.completions.create(extra_body=EXTRA, **kw).choices[0].token_ids
    assert got == want[0].outputs[0].token_ids
    p_url, d_url = pd["prefill"].url, pd["decode"].url
    if length > 16:  # a prompt shorter than one block has no full block to move
        assert metric(d_url, "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}") > 0
    wait_for(
        lambda: (
            metric(p_url, "kvferry_num_requests_held_by_connector") == 0
            and metric(p_url, "vllm:kv_cache_usage_perc") == 0
        ),
        timeout=30,
        what="the prefill instance's blocks to return to its free pool",
    )


@pytest.mark.parametrize(
    "forged",
    [
        {"do_remote_prefill": True, "remote_block_ids": "all of them"},
        {"do_remote_prefill": True, "do_remote_decode": True},
        {"do_remote_prefill": "yes"},
        {
            "do_remote_prefill": True,
            "remote_block_ids": [1, 1],
            "remote_engine_id": "x",
            "remote_request_id": "r",
            "remote_host": "127.0.0.1",
            "remote_port": 1,
            "remote_num_tokens": 32,
            "tp_size": 1,
        },
    ],
)
def test_forged_kv_transfer_params_get_400_and_hold_nothing(pd, forged) -> None:
    import httpx

    d_url = pd["decode"].url
    body = {"model": "tiny", "prompt": _ids(32, 1), "max_tokens": 4, "kv_transfer_params": forged}
    r = httpx.post(d_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "kv_transfer_params" in err["message"]
    assert metric(d_url, "vllm:num_requests_running") == 0
    assert metric(d_url, "vllm:kv_cache_usage_perc") == 0
