"""The conformance kit on kvferry's own connectors (the report in docs/conformance.md), on a
connector that breaks its promises, and through ``kvferry conformance``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.entrypoints.cli import main
from kvferry.testing import (
    FAILED,
    NOT_EXERCISED,
    PASSED,
    SCENARIOS,
    Harness,
    builtin_configs,
    run_conformance,
)


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness("quick")
    yield h
    h.close()


# What each built-in connector must show: scenarios that pass, and ones it cannot be driven into.
# The multi-worker quorum runs on a TP=2 engine: passed where async loads finish through it;
# not exercised for synchronous loads and immediate frees (nothing to count).
EXPECTED = {
    "ExampleConnector": (
        {"sync hit", "restart and reuse"},
        {"async hit", "abort mid-load", "multi-worker quorum"},
    ),
    "SimpleCPUOffloadConnector": (
        {"async hit", "abort mid-load", "multi-worker quorum"},
        {"sync hit", "restart and reuse"},
    ),
    "OffloadingConnector": (
        {"async hit", "abort mid-load", "multi-worker quorum"},
        {"sync hit", "restart and reuse"},
    ),
    "OffloadingConnector (disk tier)": (
        {"async hit", "restart and reuse", "multi-worker quorum"},
        {"sync hit"},
    ),
    "MultiConnector": ({"sync hit", "restart and reuse"}, {"async hit", "multi-worker quorum"}),
}
ALWAYS = {"miss", "failed load, policy fail", "failed load, policy recompute",
          "preemption during a save"}  # fmt: skip


@pytest.mark.parametrize("label", sorted(EXPECTED))  # NixlConnector: test_conformance_nixl.py
def test_builtin_connectors_conform(harness: Harness, tmp_path: Path, label: str) -> None:
    report = run_conformance(builtin_configs(tmp_path)[label], harness=harness)
    status = {r.scenario: r for r in report.results}
    assert list(status) == list(SCENARIOS)
    assert report.ok, report.to_text()
    passed, not_exercised = EXPECTED[label]
    passed = passed | ALWAYS | {"full hit", "preemption during a load"}
    for name in passed:
        assert status[name].status == PASSED, report.to_text()
    for name in not_exercised:
        assert status[name].status == NOT_EXERCISED and status[name].reasons, report.to_text()
    quorum = status["multi-worker quorum"]
    if quorum.status == PASSED:
        assert "after reports from 2 of 2 ranks" in quorum.notes[1], report.to_text()
    else:
        assert "so no quorum was needed; TP=2: hits of" in quorum.reasons[0], report.to_text()


def test_a_connector_that_does_not_load_fails_token_identity(
    harness: Harness, tmp_path: Path
) -> None:
    kv = {"kv_connector": "NoLoadConnector", "kv_connector_module_path": "tests.testing.broken_connector",
          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip
    report = run_conformance(kv, scenarios=["miss", "sync hit"], harness=harness)
    miss, hit = report.results
    assert miss.status == PASSED
    assert hit.status == FAILED and not report.ok
    assert any("tokens differ from the run without the connector" in r for r in hit.reasons)


def test_cli_reports_json_and_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    rc = main(
        ["conformance", "--kv-transfer-config", json.dumps(kv), "--scenario", "miss", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] and out["results"][0]["status"] == PASSED
    broken = {**kv, "kv_connector": "NoLoadConnector",
              "kv_connector_module_path": "tests.testing.broken_connector"}  # fmt: skip
    rc = main(["conformance", "--kv-transfer-config", json.dumps(broken), "--scenario", "sync hit"])
    text = capsys.readouterr().out
    assert rc == 1 and "FAILED          sync hit: " in text
    assert main(["conformance", "--kv-transfer-config", '{"kv_connector": "Nope"}']) == 2
    assert "unknown KV connector 'Nope'" in capsys.readouterr().err


def test_cli_json_stays_parseable_when_native_code_prints(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    kv = {
        "kv_connector": "NoisyConnector",
        "kv_connector_module_path": "tests.testing.broken_connector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    rc = main(
        ["conformance", "--kv-transfer-config", json.dumps(kv), "--scenario", "miss", "--json"]
    )
    out, err = capfd.readouterr()
    assert rc == 0 and json.loads(out)["ok"]
    assert "a native log line" in err
