"""The conformance kit on the P/D connectors: a prefill and a decode engine in this process,
the KV read over NIXL (UCX on loopback) or Mooncake's transfer engine (TCP on loopback), and
the params handed over as a proxy would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.testing import (
    NOT_EXERCISED,
    PASSED,
    Harness,
    builtin_configs,
    run_conformance,
)

pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")

PASSES = {"miss", "async hit", "full hit", "preemption during a load", "preemption during a save",
          "abort mid-load", "delayed free", "failed load, policy fail",
          "failed load, policy recompute", "multi-worker quorum"}  # fmt: skip
NOT_REACHED = {"sync hit", "None deferral", "restart and reuse"}


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness("quick")
    yield h
    h.close()


@pytest.mark.parametrize("name", ["NixlConnector", "MooncakeConnector"])
def test_pd_connector_scenarios(harness: Harness, tmp_path: Path, name: str) -> None:
    if name == "MooncakeConnector":
        pytest.importorskip("mooncake.engine", reason="needs Mooncake (extra 'mooncake')")
    report = run_conformance(builtin_configs(tmp_path)[name], harness=harness)
    status = {r.scenario: r for r in report.results}
    assert report.ok, report.to_text()
    for name in PASSES:
        assert status[name].status == PASSED, report.to_text()
    for name in NOT_REACHED:
        assert status[name].status == NOT_EXERCISED and status[name].reasons, report.to_text()
    # TP=2 prefill and decode engines: the prefill's frees and the decode's loads counted.
    assert "finished_sending of 2 request(s) after reports from 2 of 2 ranks" in " ".join(
        status["multi-worker quorum"].notes
    ), report.to_text()
    assert "read [" in status["async hit"].notes[0]
    assert "until the decode engine read them" in status["delayed free"].notes[0]
    assert "the prefill engine freed its blocks" in status["abort mid-load"].notes[0]


def test_without_pd_the_hits_are_not_exercised(harness: Harness, tmp_path: Path) -> None:
    kv = builtin_configs(tmp_path)["NixlConnector"]
    report = run_conformance(kv, scenarios=["async hit", "delayed free"], harness=harness, pd=False)
    assert [r.status for r in report.results] == [NOT_EXERCISED, NOT_EXERCISED], report.to_text()
