"""P/D between instances whose KV pools have different layouts (NHD prefill with HND decode,
and the reverse), two ``kvferry serve`` with MooncakeConnector (Mooncake's transfer engine,
TCP on loopback) behind ``kvferry proxy``: the scenarios of the NIXL test
(``test_pd_layout_mix_nixl_e2e.py``) on Mooncake's transport.

With ``enable_permute_local_kv`` on the decode side the blocks are read whole and permuted
into its layout: greedy answers are token-identical to one offline instance and the prompt's
KV came from the prefill instance (a Mooncake read, counted as an external transfer).
Without it the handshake is refused naming both layouts and the flag, the read fails and
``kv_load_failure_policy`` applies: ``recompute`` recomputes the prompt (still
token-identical), ``fail`` ends the request with a clear error. A request served meanwhile
is untouched either way, and the prefill instance's unread blocks go back at lease expiry."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import openai
import pytest

from kvferry import LLM, SamplingParams
from tests.helpers.pd_requests import EXTRA, check_pd_request, prompt_ids
from tests.helpers.servers import metric, pd_serving, wait_for

pytest.importorskip("mooncake.engine", reason="needs Mooncake's transfer engine (extra 'mooncake')")

LONG = ["--max-model-len", "1024", "--max-num-batched-tokens", "1024"]
STAT = "kvferry_kv_connector_total"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
REFUSED = "the prefill instance's KV cache layout is"
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _mooncake(**top: Any) -> dict:
    # A short lease: in the refused cases the prefill blocks are never claimed and go back
    # only when it runs out.
    return {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"side_channel_port": 0, "kv_lease_duration": 4.0},
        **top,
    }


@pytest.fixture(scope="module")
def offline(tiny_model_factory) -> LLM:
    return LLM(
        model=str(tiny_model_factory("llama")),
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=1024,
    )


def _serve(tiny_model_factory, tmp_path_factory, p: str, d: str, **dkv: Any):
    return pd_serving(
        tiny_model_factory("llama"),
        tmp_path_factory.mktemp(f"pd-mooncake-layout-{p}-{d}"),
        _mooncake(),
        _mooncake(**dkv),
        *LONG,
        prefill_env={"KVFERRY_KV_CACHE_LAYOUT": p},
        decode_env={"KVFERRY_KV_CACHE_LAYOUT": d},
    )


@pytest.fixture(scope="module", params=[("NHD", "HND"), ("HND", "NHD")], ids=str)
def permuting(request, tiny_model_factory, tmp_path_factory):
    p, d = request.param
    with _serve(tiny_model_factory, tmp_path_factory, p, d, enable_permute_local_kv=True) as pd:
        yield pd


@pytest.mark.parametrize(("length", "stream"), [(64, False), (450, True)])
def test_decode_permutes_the_other_layout_token_identically(permuting, offline, length, stream):
    d_url = permuting["decode"].url
    reads = metric(d_url, STAT, stat="mooncake_reads")
    check_pd_request(permuting, offline, prompt_ids(length, length), stream)
    # This prompt's KV was read over Mooncake (not recomputed after a failed read) and
    # permuted into the decode pool's layout before the request ran.
    wait_for(
        lambda: metric(d_url, STAT, stat="mooncake_reads") == reads + 1,
        what="the read in the decode instance's connector stats",
    )
    assert metric(d_url, STAT, stat="mooncake_failed_reads") == 0
    assert REFUSED not in permuting["decode"].log.read_text()


def test_local_prefix_hit_permutes_only_the_blocks_read(permuting, offline):
    """The decode instance holds the first 16 blocks already (in its own layout, from a
    request it served itself): it reads and permutes only the rest."""
    shared = prompt_ids(256, 77)
    d_url = permuting["decode"].url
    assert _ask(d_url, shared + prompt_ids(40, 78)) == _want(offline, shared + prompt_ids(40, 78))
    cached = metric(d_url, BY_SOURCE, source="local_cache_hit")
    reads = metric(d_url, STAT, stat="mooncake_reads")
    check_pd_request(permuting, offline, shared + prompt_ids(100, 79), stream=False)
    wait_for(
        lambda: metric(d_url, BY_SOURCE, source="local_cache_hit") == cached + 256,
        what="the decode instance's local prefix hit in its metrics",
    )
    wait_for(
        lambda: metric(d_url, STAT, stat="mooncake_reads") == reads + 1,
        what="the read in the decode instance's connector stats",
    )
    assert metric(d_url, STAT, stat="mooncake_failed_reads") == 0


def _want(offline: LLM, prompt: list[int]) -> list[int]:
    (out,) = offline.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def _ask(url: str, prompt: list[int]) -> Any:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kw: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 16}
    try:
        choice = client.completions.create(temperature=0.0, extra_body=EXTRA, **kw)
    except openai.APIStatusError as e:
        return e
    return choice.choices[0].token_ids


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_without_permute_the_read_is_refused(tiny_model_factory, tmp_path_factory, offline, policy):
    with _serve(
        tiny_model_factory, tmp_path_factory, "HND", "NHD", kv_load_failure_policy=policy
    ) as pd:
        p_url, d_url = pd["prefill"].url, pd["decode"].url
        prompts = [prompt_ids(200, 3), prompt_ids(90, 4)]
        want = [_want(offline, x) for x in prompts]
        # A P/D request and, meanwhile, a request straight to the decode instance.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pd_answer = pool.submit(_ask, pd["proxy"].url, prompts[0])
            plain = pool.submit(_ask, d_url, prompts[1])
            assert plain.result(timeout=120) == want[1]
            got = pd_answer.result(timeout=120)
        if policy == "recompute":
            assert got == want[0]
        else:  # the request ends with a clear error, through the proxy
            assert isinstance(got, openai.APIStatusError) and got.status_code == 502, got
            assert "KV cache load failed" in str(got) and "policy='fail'" in str(got)
        # The read failed before anything moved; the prompt was recomputed.
        wait_for(
            lambda: metric(d_url, STAT, stat="mooncake_failed_reads") >= 1,
            what="the failed read in the decode instance's connector stats",
        )
        assert metric(d_url, STAT, stat="mooncake_reads") == 0
        # Nor do the prompt-token metrics count the failed read's tokens as transferred.
        wait_for(
            lambda: metric(d_url, "vllm:prompt_tokens_total") == 290,
            what="both prompts (200 + 90 tokens) in the decode instance's metrics",
        )
        assert metric(d_url, BY_SOURCE, source="external_kv_transfer") == 0
        assert metric(d_url, BY_SOURCE, source="local_compute") == 290
        log = pd["decode"].log.read_text()
        assert f"{REFUSED} HND, this instance's is NHD" in log
        assert '"enable_permute_local_kv": true' in log
        # Never claimed, the prefill instance's blocks go back when the lease runs out.
        wait_for(
            lambda: (
                metric(p_url, "kvferry_num_requests_held_by_connector") == 0
                and metric(p_url, "vllm:kv_cache_usage_perc") == 0
            ),
            timeout=30,
            what="the prefill instance's blocks to return to its free pool",
        )
        assert metric(d_url, "vllm:kv_cache_usage_perc") == 0
