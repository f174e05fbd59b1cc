"""P/D across tensor-parallel sizes *and* KV layouts: a prefill ``kvferry serve`` with TP=a in
one layout and a decode one with TP=b in the other, behind ``kvferry proxy``, over real NIXL
(UCX on loopback) and, marked slow, MooncakeConnector.

With ``enable_permute_local_kv`` on the decode side each decode rank reads its KV heads from
the prefill ranks that hold them, in the prefill pool's order, and permutes the blocks once
every leg is in: greedy answers are token-identical to one offline TP=1 instance (fp32), the
prompt's KV came from the prefill instance (no failed read, tokens counted as transferred),
and the prefill pool is empty again afterwards. Without the flag the handshake is refused
across TP sizes too, naming the layouts and the flag (slow; ``recompute`` keeps the answer)."""

from __future__ import annotations

import importlib.util

import pytest

from kvferry import LLM
from tests.helpers.pd_requests import ask, check_pd_request, greedy_tokens, prompt_ids
from tests.helpers.servers import metric, pd_serving, wait_for

LONG = ["--max-model-len", "1024", "--max-num-batched-tokens", "512"]

_NO_MOONCAKE = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None,
    reason="needs Mooncake's transfer engine (extra 'mooncake')",
)


def _kv(connector: str, port: int, **top: object) -> dict:
    return {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_port": port,  # NIXL's; Mooncake's engine picks its own RPC port
        "kv_connector_extra_config": {"side_channel_port": 0, "kv_lease_duration": 60.0},
        **top,
    }


# (connector, prefill TP, prefill layout, decode TP, decode layout): vLLM's direction (an HND
# prefill into an NHD decode) one decode rank per prefill rank's half, and the reverse with
# one decode rank reading two prefill ranks.
CASES = [
    pytest.param(("NixlConnector", 1, "HND", 2, "NHD"), id="nixl-tp1-hnd-to-tp2-nhd"),
    pytest.param(("NixlConnector", 2, "NHD", 1, "HND"), id="nixl-tp2-nhd-to-tp1-hnd"),
    pytest.param(
        ("MooncakeConnector", 2, "HND", 1, "NHD"),
        id="mooncake-tp2-hnd-to-tp1-nhd",
        marks=(pytest.mark.slow, _NO_MOONCAKE),
    ),
]


@pytest.fixture(scope="module")
def offline(tiny_model_factory):
    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", max_model_len=1024)
    yield llm
    llm.shutdown()


def _serve(tiny_model_factory, tmp_path_factory, case, port, **dkv: object):
    connector, a, p_layout, b, d_layout = case
    logs = tmp_path_factory.mktemp(f"pd-{connector}-tp{a}{p_layout}-tp{b}{d_layout}")
    tp = "--tensor-parallel-size"
    return pd_serving(
        tiny_model_factory("llama"),
        logs,
        _kv(connector, port),
        _kv(connector, port + 100, **dkv),
        *LONG,
        prefill_extra=(tp, str(a)),
        decode_extra=(tp, str(b)),
        prefill_env={"KVFERRY_KV_CACHE_LAYOUT": p_layout, "UCX_NET_DEVICES": "lo"},
        decode_env={"KVFERRY_KV_CACHE_LAYOUT": d_layout, "UCX_NET_DEVICES": "lo"},
    )


@pytest.fixture(scope="module", params=CASES)
def permuting(request, tiny_model_factory, tmp_path_factory):
    with _serve(
        tiny_model_factory,
        tmp_path_factory,
        request.param,
        16111,
        enable_permute_local_kv=True,
    ) as procs:
        yield procs, request.param[0]


def _stat(url: str, connector: str, name: str) -> float:
    prefix = "nixl" if connector == "NixlConnector" else "mooncake"
    return metric(url, "kvferry_kv_connector_total", stat=f"{prefix}_{name}")


@pytest.mark.parametrize(("length", "stream"), [(300, False), (700, True)])
def test_pd_across_tp_sizes_and_layouts_is_token_identical(permuting, offline, length, stream):
    pd, connector = permuting
    check_pd_request(pd, offline, prompt_ids(length, length + 3), stream)
    d_url = pd["decode"].url
    # The KV was read (not recomputed after a failed read), then permuted.
    assert _stat(d_url, connector, "reads") >= 1
    assert _stat(d_url, connector, "failed_reads") == 0


@pytest.mark.slow
def test_without_the_flag_across_tp_sizes_the_read_is_refused(
    tiny_model_factory, tmp_path_factory, offline
):
    case = ("NixlConnector", 1, "HND", 2, "NHD")
    with _serve(
        tiny_model_factory,
        tmp_path_factory,
        case,
        16311,  # the permuting fixture's servers may still run
        kv_load_failure_policy="recompute",
    ) as pd:
        prompt = prompt_ids(200, 5)
        assert ask(pd["proxy"].url, prompt) == greedy_tokens(offline, prompt)  # recomputed
        d_url = pd["decode"].url
        wait_for(
            lambda: _stat(d_url, "NixlConnector", "failed_reads") >= 1,
            what="the failed read in the decode instance's connector stats",
        )
        assert _stat(d_url, "NixlConnector", "reads") == 0
        log = pd["decode"].log.read_text()
        assert "the prefill instance's KV cache layout is HND, this instance's is NHD" in log
        assert '"enable_permute_local_kv": true' in log
