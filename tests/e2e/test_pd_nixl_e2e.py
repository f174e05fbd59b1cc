"""Prefill/decode disaggregation end to end: two ``kvferry serve`` instances with NixlConnector
(real NIXL/UCX on loopback) behind ``kvferry proxy``, driven by the official ``openai`` client.

Greedy answers are token-identical to one offline instance for prompts shorter than a block,
exactly a block multiple, and several thousand tokens, streaming and not; after each request
the prefill instance's blocks are all back in its free pool."""

from __future__ import annotations

import pytest

from kvferry import LLM
from tests.helpers.pd_requests import check_pd_request, prompt_ids
from tests.helpers.servers import metric, pd_serving

LONG = ["--max-model-len", "4096", "--max-num-batched-tokens", "2048"]


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
    with pd_serving(model, logs, _nixl(15001), _nixl(15101), *LONG) as instances:
        yield instances


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


@pytest.mark.parametrize(("length", "stream"), [(7, False), (64, True), (3000, False)])
def test_pd_is_token_identical_and_frees_prefill_blocks(pd, offline, length, stream) -> None:
    check_pd_request(pd, offline, prompt_ids(length, length), stream)


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
    body = {
        "model": "tiny",
        "prompt": prompt_ids(32, 1),
        "max_tokens": 4,
        "kv_transfer_params": forged,
    }
    r = httpx.post(d_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "kv_transfer_params" in err["message"]
    assert metric(d_url, "vllm:num_requests_running") == 0
    assert metric(d_url, "vllm:kv_cache_usage_perc") == 0
