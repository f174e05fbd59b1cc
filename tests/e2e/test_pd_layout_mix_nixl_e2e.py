"""P/D between instances whose KV pools have different layouts (NHD prefill with HND decode,
and the reverse), two ``kvferry serve`` with NixlConnector behind ``kvferry proxy``.

With ``enable_permute_local_kv`` on the decode side the blocks are read whole and permuted
into its layout: greedy answers are token-identical to one offline instance and the prompt's
KV came from the prefill instance. Without it the handshake is refused naming the two
layouts and the flag; the read fails and ``kv_load_failure_policy`` applies: ``recompute``
recomputes the prompt (still token-identical), ``fail`` ends the request with a clear
error. A request served meanwhile is untouched either way."""

from __future__ import annotations

from typing import Any

import pytest

from kvferry import LLM
from tests.helpers.pd_requests import check_pd_request, check_refused_read, prompt_ids
from tests.helpers.servers import metric, pd_serving

LONG = ["--max-model-len", "1024", "--max-num-batched-tokens", "1024"]


def _nixl(port: int, **top: Any) -> dict:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_port": port,
        "kv_connector_extra_config": {"side_channel_port": 0, "kv_lease_duration": 4.0},
        **top,
    }


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
        max_model_len=1024,
        max_num_batched_tokens=1024,
    )


def _serve(tiny_model_factory, tmp_path_factory, monkeypatch_module, p: str, d: str, **dkv: Any):
    monkeypatch_module.setenv("UCX_NET_DEVICES", "lo")
    logs = tmp_path_factory.mktemp(f"pd-layout-{p}-{d}")
    return pd_serving(
        tiny_model_factory("llama"),
        logs,
        _nixl(15801),
        _nixl(15901, **dkv),
        *LONG,
        prefill_env={"KVFERRY_KV_CACHE_LAYOUT": p},
        decode_env={"KVFERRY_KV_CACHE_LAYOUT": d},
    )


@pytest.fixture(scope="module", params=[("NHD", "HND"), ("HND", "NHD")], ids=str)
def permuting(request, tiny_model_factory, tmp_path_factory, monkeypatch_module):
    p, d = request.param
    with _serve(
        tiny_model_factory, tmp_path_factory, monkeypatch_module, p, d, enable_permute_local_kv=True
    ) as procs:
        yield procs


@pytest.mark.parametrize(("length", "stream"), [(40, False), (300, True)])
def test_decode_permutes_the_other_layout_token_identically(permuting, offline, length, stream):
    check_pd_request(permuting, offline, prompt_ids(length, length), stream)
    d_url = permuting["decode"].url
    # The KV was read (not recomputed after a failed read) and permuted.
    assert metric(d_url, "kvferry_kv_connector_total", stat="nixl_reads") >= 1
    assert metric(d_url, "kvferry_kv_connector_total", stat="nixl_failed_reads") == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_without_permute_the_read_is_refused(
    tiny_model_factory, tmp_path_factory, monkeypatch_module, offline, policy
):
    with _serve(
        tiny_model_factory,
        tmp_path_factory,
        monkeypatch_module,
        "HND",
        "NHD",
        kv_load_failure_policy=policy,
    ) as pd:
        check_refused_read(pd, offline, policy, "nixl")
