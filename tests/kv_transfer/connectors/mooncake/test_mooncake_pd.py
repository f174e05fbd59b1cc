"""Prefill/decode disaggregation with the MooncakeConnector across real process boundaries:
the NIXL harness tests (``tests/kv_transfer/connectors/nixl/test_nixl_pd.py``) run on a
cluster whose instances use Mooncake's transfer engine (TCP on loopback) instead of NIXL.

The same P (producer), D1 (``kv_load_failure_policy="fail"``) and D2 (``recompute``)
harness processes; the tests that say nothing transport-specific are imported as they are
(token-identical outputs and prefill blocks freed for short, block-multiple and long
prompts; a local prefix hit; lease expiry when decode never comes; release; forged params;
an incompatible or impostor peer), and the prefill-killed test is restated with Mooncake's
failure messages.
"""

from __future__ import annotations

import pytest

from tests.helpers.mooncake_pd import mooncake_kv
from tests.helpers.nixl_instance import MAX_TOKENS, Instance, assert_all_free, submit_decode

pytest.importorskip("mooncake.engine", reason="needs Mooncake's transfer engine (extra 'mooncake')")

from tests.kv_transfer.connectors.nixl import test_nixl_pd as nixl_pd  # noqa: E402

# Fixtures and tests shared with the NIXL module, in its order (pytest runs them in the order
# they are bound here, and the later tests rely on what the earlier ones left cached).
model_dir = nixl_pd.model_dir
prompts = nixl_pd.prompts
reference = nixl_pd.reference
submit_prefill = nixl_pd.submit_prefill
test_pd_is_token_identical_and_frees_prefill_blocks = (
    nixl_pd.test_pd_is_token_identical_and_frees_prefill_blocks
)
test_decode_with_local_prefix_hit_reads_only_the_rest = (
    nixl_pd.test_decode_with_local_prefix_hit_reads_only_the_rest
)
test_lease_frees_blocks_when_decode_never_comes = (
    nixl_pd.test_lease_frees_blocks_when_decode_never_comes
)
test_release_frees_at_once_and_twice_is_harmless = (
    nixl_pd.test_release_frees_at_once_and_twice_is_harmless
)
test_forged_params_fail_clearly_and_hold_nothing = (
    nixl_pd.test_forged_params_fail_clearly_and_hold_nothing
)
test_incompatible_or_impostor_peer_is_refused = (
    nixl_pd.test_incompatible_or_impostor_peer_is_refused
)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("mooncake-logs")
    specs = {
        "P": mooncake_kv("kv_producer"),
        "D1": mooncake_kv("kv_consumer", "fail"),
        "D2": mooncake_kv("kv_consumer", "recompute"),
    }
    procs = {
        name: Instance(name, model_dir, kv, logs / f"{name}.log") for name, kv in specs.items()
    }
    try:
        for inst in procs.values():
            inst.ready = inst.wait("ready", 120)  # type: ignore[attr-defined]
            assert "transport=mooncake" in inst.ready["compat"]  # type: ignore[attr-defined]
        yield procs
    finally:
        for inst in procs.values():
            inst.close()


def test_params_have_vllm_mooncake_fields(cluster, prompts, reference):
    p, d = cluster["P"], cluster["D1"]
    cid = p.submit(
        "generate",
        prompt=prompts["short"],
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "xfer-42"},
    )
    params = p.wait(cid)["kv_transfer_params"]
    assert params["transfer_id"] == "xfer-42"
    assert params["remote_bootstrap_addr"] == f"tcp://127.0.0.1:{params['remote_port']}"
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    out = d.wait(submit_decode(d, prompts["short"], params))
    assert out["tokens"] == reference["short"]
    assert_all_free(p, within=10)


def test_prefill_killed_mid_transfer(cluster, prompts, reference):
    """As the NIXL test: P dies right after granting D2's claim; D2 recomputes (policy
    recompute), D1 then asks the dead P for another request and fails (policy fail)."""
    p, d1, d2 = cluster["P"], cluster["D1"], cluster["D2"]
    a = p.wait(submit_prefill(p, prompts["kill_a"]))["kv_transfer_params"]
    b = p.wait(submit_prefill(p, prompts["kill_b"]))["kv_transfer_params"]
    d2.call("slow_post", engine_id=a["remote_engine_id"], delay=0.5)
    p.call("die_after_claim")
    out = d2.wait(submit_decode(d2, prompts["kill_a"], a))
    assert p.proc.wait(10) == -9
    assert out["finish_reason"] == "length" and out["tokens"] == reference["kill_a"], out
    assert "Mooncake reports the READ failed" in d2.log()
    out = d1.wait(submit_decode(d1, prompts["kill_b"], b))
    assert out["finish_reason"] == "error", out
    assert "no answer from the Mooncake side channel" in d1.log()
    for d in (d1, d2):
        out = d.wait(d.submit("generate", prompt=prompts["short"], max_tokens=MAX_TOKENS))
        assert out["tokens"] == reference["short"]
        assert_all_free(d, within=5)
