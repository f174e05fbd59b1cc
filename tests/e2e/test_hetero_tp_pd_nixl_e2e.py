"""P/D across tensor-parallel sizes: a prefill ``kvferry serve`` with TP=a and a decode one
with TP=b (1 -> 2 and 2 -> 1) with NixlConnector (real NIXL/UCX on loopback) behind
``kvferry proxy``. Each decode rank reads its KV heads from the prefill ranks that hold them
(head-sliced pieces); answers are token-identical to one offline TP=1 instance (fp32), and the
prefill instance's pool is empty again afterwards (with TP=1 -> 2 one prefill rank's hold
ends only once both decode ranks read it). Both KV layouts: with HND the pieces are whole
per-block head ranges."""

from __future__ import annotations

import pytest

from kvferry import LLM
from tests.helpers.pd_requests import check_pd_request, prompt_ids
from tests.helpers.servers import pd_serving

LONG = ["--max-model-len", "1024", "--max-num-batched-tokens", "512"]


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


@pytest.fixture(
    scope="module",
    # HND: both instances' pools heads-outside-tokens, so a head slice is one piece per block.
    params=[(1, 2, "NHD"), (2, 1, "NHD"), (1, 2, "HND"), (2, 1, "HND")],
    ids=["tp1-to-tp2", "tp2-to-tp1", "tp1-to-tp2-hnd", "tp2-to-tp1-hnd"],
)
def pd(request, tiny_model_factory, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("UCX_NET_DEVICES", "lo")
    a, b, layout = request.param
    monkeypatch_module.setenv("KVFERRY_KV_CACHE_LAYOUT", layout)  # the servers inherit it
    logs = tmp_path_factory.mktemp(f"pd-nixl-tp{a}-tp{b}-{layout}")
    model = tiny_model_factory("llama")
    tp = "--tensor-parallel-size"
    with pd_serving(
        model,
        logs,
        _nixl(15601),
        _nixl(15701),
        *LONG,
        prefill_extra=(tp, str(a)),
        decode_extra=(tp, str(b)),
    ) as procs:
        yield procs


@pytest.fixture(scope="module")
def offline(tiny_model_factory):
    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", max_model_len=1024)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize(("length", "stream"), [(64, True), (700, False)])
def test_pd_across_tp_sizes_is_token_identical(pd, offline, length, stream) -> None:
    check_pd_request(pd, offline, prompt_ids(length, length + 1), stream)
