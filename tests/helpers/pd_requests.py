"""One P/D request through ``kvferry proxy`` with the ``openai`` client, checked the way every
P/D end-to-end test checks it: token-identical to an offline engine, KV read from the prefill
instance (when the prompt holds a full block), the prefill pool empty again afterwards."""

from __future__ import annotations

from typing import Any

import openai

from kvferry import LLM, SamplingParams
from tests.helpers.servers import metric, wait_for

EXTRA = {"ignore_eos": True, "return_token_ids": True}


def prompt_ids(n: int, seed: int) -> list[int]:
    return [5 + (seed * 7919 + i * 104729) % 500 for i in range(n)]


def check_pd_request(
    pd: dict[str, Any], offline: LLM, prompt: list[int], stream: bool, block_size: int = 16
) -> None:
    """``pd``: the running instances by name (``prefill``, ``decode``, ``proxy``)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    client = openai.OpenAI(base_url=pd["proxy"].url + "/v1", api_key="x", max_retries=0)
    kw: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
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
    if len(prompt) > block_size:  # a prompt shorter than one block has no full block to move
        assert metric(d_url, "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}") > 0
    wait_for(
        lambda: (
            metric(p_url, "kvferry_num_requests_held_by_connector") == 0
            and metric(p_url, "vllm:kv_cache_usage_perc") == 0
        ),
        timeout=30,
        what="the prefill instance's blocks to return to its free pool",
    )
