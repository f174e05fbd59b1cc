"""P/D across tensor-parallel sizes: a prefill ``kvferry serve`` with TP=a and a decode one
with TP=b (1 -> 2 and 2 -> 1) behind ``kvferry proxy``, over NixlConnector (real NIXL/UCX on
loopback) and over MooncakeConnector (Mooncake's transfer engine, TCP on loopback). Each
decode rank reads its KV heads from the prefill ranks that hold them (head-sliced pieces;
with Mooncake thousands of entries per READ, posted in batches its per-peer queue admits).
Answers are token-identical to one offline TP=1 instance (fp32), and the prefill instance's
pool is empty again afterwards (with TP=1 -> 2 one prefill rank's hold ends only once both
decode ranks read it). Both KV layouts: with HND the pieces are whole per-block head ranges."""

from __future__ import annotations

import importlib.util

import pytest

from kvferry import LLM
from tests.helpers.pd_requests import check_pd_request, prompt_ids
from tests.helpers.servers import pd_serving

LONG = ["--max-model-len", "1024", "--max-num-batched-tokens", "512"]


def _kv(connector: str, port: int) -> dict:
    return {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_port": port,  # NIXL's; Mooncake's engine picks its own RPC port
        "kv_connector_extra_config": {"side_channel_port": 0, "kv_lease_duration": 60.0},
    }


_NO_MOONCAKE = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None,
    reason="needs Mooncake's transfer engine (extra 'mooncake')",
)
_CONNECTORS = {"nixl": ("NixlConnector", ()), "mooncake": ("MooncakeConnector", (_NO_MOONCAKE,))}


def _cases() -> list:
    """Every connector x (1 -> 2, 2 -> 1) x layout. HND: both instances' pools hold heads
    outside tokens, so a head slice is one piece per block."""
    return [
        pytest.param(
            (name, a, b, layout),
            id=f"{short}-tp{a}-to-tp{b}" + ("-hnd" * (layout == "HND")),
            marks=marks,
        )
        for short, (name, marks) in _CONNECTORS.items()
        for layout in ("NHD", "HND")
        for a, b in ((1, 2), (2, 1))
    ]


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module", params=_cases())
def pd(request, tiny_model_factory, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("UCX_NET_DEVICES", "lo")
    connector, a, b, layout = request.param
    monkeypatch_module.setenv("KVFERRY_KV_CACHE_LAYOUT", layout)  # the servers inherit it
    logs = tmp_path_factory.mktemp(f"pd-{connector}-tp{a}-tp{b}-{layout}")
    model = tiny_model_factory("llama")
    tp = "--tensor-parallel-size"
    with pd_serving(
        model,
        logs,
        _kv(connector, 15601),
        _kv(connector, 15701),
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
