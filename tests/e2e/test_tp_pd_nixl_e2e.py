"""P/D disaggregation between tensor-parallel instances: a TP=2 prefill and a TP=2 decode
``kvferry serve`` with NixlConnector (real NIXL/UCX on loopback) behind ``kvferry proxy``.
Decode rank r reads prefill rank r's KV heads (found through rank 0's side channel); answers
are token-identical to one offline TP=1 instance, and the prefill instance frees its blocks
only once every rank's KV was read."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry import LLM
from tests.helpers.pd_auth import SECRET
from tests.helpers.pd_requests import check_pd_request, prompt_ids
from tests.helpers.servers import pd_serving

LONG = ["--max-model-len", "1024", "--max-num-batched-tokens", "512", "--tensor-parallel-size", "2"]


def _nixl(port: int, secret: Path | None) -> dict:
    extra: dict = {"side_channel_port": 0, "kv_lease_duration": 60.0}
    if secret is not None:  # signed params (their tp_size included) and side channel
        extra["secret_file"] = str(secret)
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_port": port,
        "kv_connector_extra_config": extra,
    }


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module", params=["open", pytest.param("secret", marks=pytest.mark.slow)])
def pd(request, tiny_model_factory, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("UCX_NET_DEVICES", "lo")
    logs = tmp_path_factory.mktemp("pd-nixl-tp2")
    secret = None
    if request.param == "secret":
        secret = logs / "secret"
        secret.write_bytes(SECRET.value)
    model = tiny_model_factory("llama")
    with pd_serving(model, logs, _nixl(15401, secret), _nixl(15501, secret), *LONG) as procs:
        yield procs


@pytest.fixture(scope="module")
def offline(tiny_model_factory):
    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", max_model_len=1024)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize(("length", "stream"), [(7, False), (64, True), (700, False)])
def test_tp2_pd_is_token_identical_and_frees_prefill_blocks(pd, offline, length, stream) -> None:
    check_pd_request(pd, offline, prompt_ids(length, length), stream)
