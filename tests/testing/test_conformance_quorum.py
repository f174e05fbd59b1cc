"""The kit's multi-worker quorum scenario: connectors on a tensor-parallel engine (2 worker
processes), their finished_sending / finished_recving reports through the executor's quorum,
and the per-rank protocol trace."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry.testing import FAILED, NOT_EXERCISED, PASSED, Harness, quorum, run_conformance
from kvferry.testing import harness as harness_module
from kvferry.testing.order import check_order
from kvferry.testing.quorum import QUORUM_TP
from kvferry.testing.subject import Subject, close_run

SCENARIO = ["multi-worker quorum"]


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness("quick")
    yield h
    h.close()


def _kv(name: str, module: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": name, "kv_connector_module_path": module,
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path), **extra}}  # fmt: skip


def test_delayed_frees_of_every_rank_make_the_quorum(harness: Harness, tmp_path: Path) -> None:
    kv = _kv("DelayedFreeConnector", "tests.helpers.conformance_connectors", tmp_path)
    (result,) = run_conformance(kv, scenarios=SCENARIO, harness=harness).results
    assert result.status == PASSED, result
    assert "finished_sending of 4 request(s) after reports from 2 of 2 ranks" in result.notes[1]


def test_a_finished_count_of_one_is_honoured(harness: Harness, tmp_path: Path) -> None:
    kv = _kv("RankZeroFreeConnector", "tests.testing.quorum_connectors", tmp_path,
             finished_count=1)  # fmt: skip
    (result,) = run_conformance(kv, scenarios=SCENARIO, harness=harness).results
    assert result.status == PASSED, result
    assert "after reports from 1 of 2 ranks" in result.notes[1]
    assert "get_finished_count() 1 of 2 ranks honoured" in result.notes[2]


@pytest.mark.parametrize(
    ("twice", "why"),
    [
        (False, "was reported by rank(s) [0] of 2 only; its quorum of 2"),
        (True, "rank 0 reported finished_sending of "),
    ],
)
def test_a_rank_that_never_reports_fails_the_quorum(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, twice: bool, why: str
) -> None:
    monkeypatch.setattr(harness_module, "DRAIN_TIMEOUT_S", 1.0)
    kv = _kv("RankZeroFreeConnector", "tests.testing.quorum_connectors", tmp_path,
             report_twice=twice)  # fmt: skip
    (result,) = run_conformance(kv, scenarios=SCENARIO, harness=harness).results
    assert result.status == FAILED
    assert any(why in r for r in result.reasons), result.reasons
    if not twice:  # the blocks of the requests whose free never completed are held
        assert any("did not drain" in r for r in result.reasons), result.reasons


def test_unadapted_connectors_are_not_exercised(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No built-in is unadapted today: mark one so, as a connector not adapted would be.
    monkeypatch.setitem(quorum.NOT_ON_TP, "ExampleConnector", "not adapted to tensor parallelism")
    kv = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {}}]}}  # fmt: skip
    (result,) = run_conformance(kv, scenarios=SCENARIO, harness=harness).results
    assert result.status == NOT_EXERCISED
    assert "not adapted to tensor parallelism" in result.reasons[0]


def test_the_trace_is_told_apart_per_rank(harness: Harness, tmp_path: Path) -> None:
    s = Subject(harness, _kv("ExampleConnector", "", tmp_path))
    s.kv.pop("kv_connector_module_path")
    run = harness.engine(s.kv, tensor_parallel_size=QUORUM_TP)
    pids = run.engine.executor.worker_pids
    prompts = s.prompts("rank", [40])
    run.run(prompts, harness.params)
    problems, records = close_run(run)
    assert problems == []
    per_rank = run.rank_records()
    assert sorted(per_rank) == [0, 1] and len(set(pids)) == 2
    for rank, recs in per_rank.items():
        workers = [r for r in recs if r["role"] == "worker"]
        assert workers and {r["rank"] for r in workers} == {rank}
        assert sum(r["method"] == "build_connector_meta" for r in recs) == sum(
            r["method"] == "bind_connector_metadata" for r in workers
        )
        assert check_order(recs) == []
    # Both ranks' steps in one list are not one worker's order: the kit must split them.
    assert check_order(records)
