"""P/D across tensor-parallel sizes: a prefill ``kvferry serve`` with TP=a and a decode one
with TP=b (1 -> 2 and 2 -> 1) with NixlConnector (real NIXL/UCX on loopback) behind
``kvferry proxy``. Each decode rank reads its KV heads from the prefill ranks that hold them
(head-sliced pieces); answers are token-identical to one offline TP=1 instance (fp32), and the
prefill instance's pool is empty again afterwards (with TP=1 -> 2 one prefill rank's hold
ends only once both decode ranks read it)."""

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

LONG = ["--max-model-len", "1024", "--max-num-batched-tokens", "512"]
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def _nixl(port: int) -> dict:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_port": port,
        "kv_connector_extra_config": {"side_channel_port": 0, "kv_lease_duration": 60.0},
    }


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module", params=[(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
def pd(request, tiny_model_factory, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("UCX_NET_DEVICES", "lo")
    a, b = request.param
    logs = tmp_path_factory.mktemp(f"pd-nixl-tp{a}-tp{b}")
    model = tiny_model_factory("llama")
    tp = "--tensor-parallel-size"
    p = start_server("prefill", model, logs, _nixl(15601), *LONG, tp, str(a))
    d = start_server("decode", model, logs, _nixl(15701), *LONG, tp, str(b))
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
def offline(tiny_model_factory):
    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", max_model_len=1024)
    yield llm
    llm.shutdown()


def _ids(n: int, seed: int) -> list[int]:
    return [5 + (seed * 7919 + i * 104729) % 500 for i in range(n)]


@pytest.mark.parametrize(("length", "stream"), [(64, True), (700, False)])
def test_pd_across_tp_sizes_is_token_identical(pd, offline, length, stream) -> None:
    prompt = _ids(length, length + 1)
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
    assert metric(d_url, "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}") > 0
    wait_for(
        lambda: (
            metric(p_url, "kvferry_num_requests_held_by_connector") == 0
            and metric(p_url, "vllm:kv_cache_usage_perc") == 0
        ),
        timeout=30,
        what="the prefill instance's blocks to return to its free pool",
    )
