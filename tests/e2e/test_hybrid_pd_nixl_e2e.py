"""P/D of a hybrid model (Qwen3 with sliding-window layers) over NIXL: two ``kvferry serve``
instances with NixlConnector (real NIXL/UCX on loopback) behind ``kvferry proxy``.

Greedy answers are token-identical to one offline instance for prompts shorter than the
window, longer than it (the sliding group sends only its window's blocks), one whose
recomputed last token's window starts a block earlier than the next token's (95 tokens,
window 32, blocks of 16), and several hundred tokens; the prefill pool is empty afterwards."""

from __future__ import annotations

import pytest

from kvferry import LLM
from tests.e2e.test_pd_nixl_e2e import _nixl, monkeypatch_module  # noqa: F401 (fixture)
from tests.helpers.pd_requests import check_pd_request, prompt_ids
from tests.helpers.servers import pd_serving

WINDOW = 32
ARGS = ["--max-model-len", "1024", "--max-num-batched-tokens", "128"]  # chunked prefill


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("qwen3", layers=4, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def pd(model, tmp_path_factory, monkeypatch_module):  # noqa: F811
    monkeypatch_module.setenv("UCX_NET_DEVICES", "lo")
    logs = tmp_path_factory.mktemp("pd-nixl-hybrid")
    with pd_serving(model, logs, _nixl(15201), _nixl(15301), *ARGS) as instances:
        yield instances


@pytest.fixture(scope="module")
def offline(model) -> LLM:
    return LLM(model=str(model), dtype="float32", max_model_len=1024)


@pytest.mark.parametrize(("length", "stream"), [(20, False), (95, True), (400, False)])
def test_hybrid_pd_is_token_identical_and_frees_prefill_blocks(pd, offline, length, stream):
    check_pd_request(pd, offline, prompt_ids(length, length), stream)
