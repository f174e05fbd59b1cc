"""Prefill/decode disaggregation end to end over Mooncake's transfer engine: two ``kvferry
serve`` instances with MooncakeConnector (TCP on loopback) behind ``kvferry proxy``, driven by
the official ``openai`` client. The tests are the NIXL end-to-end tests
(``test_pd_nixl_e2e.py``: token-identical greedy answers for a prompt shorter than a block,
exactly a block multiple and 3000 tokens, streaming and not, the prefill pool empty after
each; forged params refused with a 400), run on this module's Mooncake pair."""

from __future__ import annotations

import pytest

from tests.e2e import test_pd_nixl_e2e as nixl_e2e
from tests.helpers.servers import pd_serving

pytest.importorskip("mooncake.engine", reason="needs Mooncake's transfer engine (extra 'mooncake')")

offline = nixl_e2e.offline
test_pd_is_token_identical_and_frees_prefill_blocks = (
    nixl_e2e.test_pd_is_token_identical_and_frees_prefill_blocks
)
test_forged_kv_transfer_params_get_400_and_hold_nothing = (
    nixl_e2e.test_forged_kv_transfer_params_get_400_and_hold_nothing
)


def _mooncake() -> dict:
    return {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"side_channel_port": 0, "kv_lease_duration": 60.0},
    }


@pytest.fixture(scope="module")
def pd(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-mooncake")
    model = tiny_model_factory("llama")
    with pd_serving(model, logs, _mooncake(), _mooncake(), *nixl_e2e.LONG) as procs:
        yield procs
