"""The kit's checks for the scenarios no built-in connector reaches (``None`` deferral,
delayed free), driven by scripted connectors that do them right and wrong
(``tests/helpers/conformance_connectors.py``), and a vLLM-style connector loaded by module
path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry.testing import FAILED, NOT_EXERCISED, PASSED, Harness, run_conformance
from kvferry.testing import harness as harness_module

MODULE = "tests.helpers.conformance_connectors"


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness("quick")
    yield h
    h.close()


def _kv(name: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": name, "kv_connector_module_path": MODULE,
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path), **extra}}  # fmt: skip


def test_none_deferral_passes_for_a_connector_that_defers(harness: Harness, tmp_path: Path) -> None:
    kv = _kv("DeferringConnector", tmp_path, defer_lookups=3)
    report = run_conformance(kv, scenarios=["None deferral", "miss"], harness=harness)
    deferral, miss = report.results
    assert deferral.status == PASSED, report.to_text()
    assert "deferred, then scheduled" in deferral.notes[0]
    assert miss.status == PASSED, report.to_text()


def test_a_connector_that_defers_forever_fails_with_a_reason(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness_module, "DRAIN_TIMEOUT_S", 1.0)
    kv = _kv("DeferringConnector", tmp_path, defer_lookups=10**9)
    (result,) = run_conformance(kv, scenarios=["None deferral"], harness=harness).results
    assert result.status == FAILED
    assert "requests unfinished after" in result.reasons[0]


def test_delayed_free_passes_when_finished_sending_releases_the_blocks(
    harness: Harness, tmp_path: Path
) -> None:
    kv = _kv("DelayedFreeConnector", tmp_path, free_after_steps=3)
    report = run_conformance(kv, scenarios=["delayed free", "sync hit"], harness=harness)
    free, hit = report.results
    assert free.status == PASSED, report.to_text()
    assert "delayed free(s), all blocks returned" in free.notes[0]
    assert hit.status == PASSED, report.to_text()


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("never", "no get_finished reported them in finished_sending (they are never freed)"),
        ("early", "before request_finished kept their blocks (the free came early"),
    ],
)
def test_a_wrong_delayed_free_fails_with_a_reason(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, why: str
) -> None:
    monkeypatch.setattr(harness_module, "DRAIN_TIMEOUT_S", 1.0)
    kv = _kv("DelayedFreeConnector", tmp_path, mode=mode)
    (result,) = run_conformance(kv, scenarios=["delayed free"], harness=harness).results
    assert result.status == FAILED
    assert any(why in r for r in result.reasons), result.reasons
    assert any("did not drain" in r for r in result.reasons), result.reasons


def test_a_vllm_style_connector_by_module_path(harness: Harness) -> None:
    kv = {"kv_connector": "VllmAsyncConnector",
          "kv_connector_module_path": "tests.helpers.vllm_style.async_connector"}  # fmt: skip
    report = run_conformance(kv, harness=harness)
    status = {r.scenario: r.status for r in report.results}
    assert report.ok, report.to_text()
    for name in ("miss", "async hit", "full hit", "abort mid-load", "restart and reuse",
                 "preemption during a load", "preemption during a save"):  # fmt: skip
        assert status[name] == PASSED, report.to_text()
    assert status["sync hit"] == NOT_EXERCISED
    # Its store is a dict of the process: under TP the workers store in their own processes.
    assert status["multi-worker quorum"] == NOT_EXERCISED
