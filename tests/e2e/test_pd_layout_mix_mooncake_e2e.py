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

from typing import Any

import pytest

from kvferry import LLM
from tests.helpers.pd_requests import (
    ask,
    check_pd_request,
    check_refused_read,
    greedy_tokens,
    prompt_ids,
)
from tests.helpers.servers import metric, pd_serving, wait_for

pytest.importorskip("mooncake.engine", reason="needs Mooncake's transfer engine (extra 'mooncake')")

LONG = ["--max-model-len", "1024", "--max-num-batched-tokens", "1024"]
STAT = "kvferry_kv_connector_total"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
REFUSED = "the prefill instance's KV cache layout is"


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
    assert ask(d_url, shared + prompt_ids(40, 78)) == greedy_tokens(
        offline, shared + prompt_ids(40, 78)
    )
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


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_without_permute_the_read_is_refused(tiny_model_factory, tmp_path_factory, offline, policy):
    with _serve(
        tiny_model_factory, tmp_path_factory, "HND", "NHD", kv_load_failure_policy=policy
    ) as pd:
        check_refused_read(pd, offline, policy, "mooncake")
