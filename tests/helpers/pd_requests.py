"""One P/D request through ``kvferry proxy`` with the ``openai`` client, checked the way every
P/D end-to-end test checks it: token-identical to an offline engine, KV read from the prefill
instance (when the prompt holds a full block), the prefill pool empty again afterwards."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import openai

from kvferry import LLM, SamplingParams
from tests.helpers.servers import metric, wait_for

EXTRA = {"ignore_eos": True, "return_token_ids": True}


def prompt_ids(n: int, seed: int) -> list[int]:
    return [5 + (seed * 7919 + i * 104729) % 500 for i in range(n)]


def greedy_tokens(offline: LLM, prompt: list[int]) -> list[int]:
    """The 16 greedy tokens the offline engine gives ``prompt``: what a P/D request must return."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (out,) = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def check_pd_request(
    pd: dict[str, Any], offline: LLM, prompt: list[int], stream: bool, block_size: int = 16
) -> None:
    """``pd``: the running instances by name (``prefill``, ``decode``, ``proxy``)."""
    want = greedy_tokens(offline, prompt)
    client = openai.OpenAI(base_url=pd["proxy"].url + "/v1", api_key="x", max_retries=0)
    kw: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    if stream:
        got = [
            t
            for ev in client.completions.create(stream=True, extra_body=EXTRA, **kw)
            for t in ev.choices[0].token_ids
        ]
    else:
        got = list(client.completions.create(extra_body=EXTRA, **kw).choices[0].token_ids)
    assert got == want
    p_url, d_url = pd["prefill"].url, pd["decode"].url
    if len(prompt) > block_size:  # a prompt shorter than one block has no full block to move
        assert metric(d_url, "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}") > 0
    wait_prefill_pool_empty(p_url)


def wait_prefill_pool_empty(p_url: str) -> None:
    """The prefill instance holds no request for a reader and no KV block any more."""
    wait_for(
        lambda: (
            metric(p_url, "kvferry_num_requests_held_by_connector") == 0
            and metric(p_url, "vllm:kv_cache_usage_perc") == 0
        ),
        timeout=30,
        what="the prefill instance's blocks to return to its free pool",
    )


def ask(url: str, prompt: list[int]) -> Any:
    """Greedy 16 tokens of ``prompt`` from ``url``: the token ids, or the API error."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kw: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 16}
    try:
        choice = client.completions.create(temperature=0.0, extra_body=EXTRA, **kw)
    except openai.APIStatusError as e:
        return e
    return list(choice.choices[0].token_ids)


def check_refused_read(pd: dict[str, Any], offline: LLM, policy: str, stat: str) -> None:
    """The decode instance refused the prefill instance's layout (HND prefill, NHD decode,
    no ``enable_permute_local_kv``): ``kv_load_failure_policy`` ``policy`` applies to a P/D
    request while a request straight to the decode instance is untouched; nothing counts as
    transferred, the log names both layouts and the flag, and the prefill blocks go back at
    lease expiry. ``stat``: the connector's stats prefix (``nixl``, ``mooncake``)."""
    p_url, d_url = pd["prefill"].url, pd["decode"].url
    prompts = [prompt_ids(200, 3), prompt_ids(90, 4)]
    want = [greedy_tokens(offline, x) for x in prompts]
    # A P/D request and, meanwhile, a request straight to the decode instance.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pd_answer = pool.submit(ask, pd["proxy"].url, prompts[0])
        plain = pool.submit(ask, d_url, prompts[1])
        assert plain.result(timeout=120) == want[1]
        got = pd_answer.result(timeout=120)
    if policy == "recompute":
        assert got == want[0]
    else:  # the request ends with a clear error, through the proxy
        assert isinstance(got, openai.APIStatusError) and got.status_code == 502, got
        assert "KV cache load failed" in str(got) and "policy='fail'" in str(got)
    # The read failed before anything moved; the prompt was recomputed.
    total = "kvferry_kv_connector_total"
    wait_for(
        lambda: metric(d_url, total, stat=f"{stat}_failed_reads") >= 1,
        what="the failed read in the decode instance's connector stats",
    )
    assert metric(d_url, total, stat=f"{stat}_reads") == 0
    # Nor do the prompt-token metrics count the failed read's tokens as transferred.
    wait_for(
        lambda: metric(d_url, "vllm:prompt_tokens_total") == 290,
        what="both prompts (200 + 90 tokens) in the decode instance's metrics",
    )
    by_source = "vllm:prompt_tokens_by_source_total"
    assert metric(d_url, by_source, source="external_kv_transfer") == 0
    assert metric(d_url, by_source, source="local_compute") == 290
    log = pd["decode"].log.read_text()
    assert "the prefill instance's KV cache layout is HND, this instance's is NHD" in log
    assert '"enable_permute_local_kv": true' in log
    # Never claimed, the prefill instance's blocks go back when the lease runs out.
    wait_prefill_pool_empty(p_url)
    assert metric(d_url, "vllm:kv_cache_usage_perc") == 0
