"""LMCacheMPConnector end to end: kvferry engines in separate processes share prompt KV
through one real LMCache multi-process server. A long prompt computed by the first engine
is an external hit on the second, and on an engine started after the first two have exited
(the server keeps the KV); greedy outputs are token-identical to an engine without a
connector; nothing leaks. Under tensor parallelism each rank is its own LMCache worker: a
second TP=2 engine hits what the first stored (every rank's piece of each chunk), and the
conformance kit's multi-worker quorum passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kv_transfer.connectors.lmcache_mp.harness import (
    CHUNK,
    FAST,
    generate,
    kv_config,
    lmcache_fixture,  # noqa: F401 - the `lmcache` fixture
    make_llm,
    prompts,
    run_engine_process,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


def test_two_engine_processes_share_kv_through_one_lmcache_server(
    model_dir: Path, lmcache, tmp_path: Path
) -> None:
    long_prompt, other = prompts(11, (300, 40))
    reference = generate(make_llm(model_dir), [long_prompt, other])
    kv = kv_config(lmcache)

    first = run_engine_process(model_dir, kv, [long_prompt, other], tmp_path, "first")
    assert [o["tokens"] for o in first["outputs"]] == [r["tokens"] for r in reference]
    assert all(o["external"] == 0 for o in first["outputs"])  # nothing on the server yet
    assert first["stats"]["store_tokens"] == 288 + 32  # every complete prompt chunk

    second = run_engine_process(model_dir, kv, [long_prompt], tmp_path, "second")
    hit = (300 - 1) // CHUNK * CHUNK  # the last prompt token is always computed
    assert second["outputs"][0]["tokens"] == reference[0]["tokens"]
    assert second["outputs"][0]["external"] == hit == second["outputs"][0]["cached"]
    assert second["stats"]["load_tokens"] == hit
    assert second["stats"].get("store_tokens", 0) == 0  # already on the server

    # A restarted engine (a new process; both earlier ones have exited) keeps the hits.
    again = run_engine_process(model_dir, kv, [long_prompt, other], tmp_path, "restarted")
    assert [o["tokens"] for o in again["outputs"]] == [r["tokens"] for r in reference]
    assert [o["external"] for o in again["outputs"]] == [hit, 32]


def test_two_tp2_engines_share_kv_each_rank_its_own_lmcache_worker(
    model_dir: Path, lmcache, tmp_path: Path
) -> None:
    long_prompt, other = prompts(12, (300, 40))
    reference = generate(make_llm(model_dir), [long_prompt, other])  # one TP=1 engine, fp32
    kv = kv_config(lmcache)

    first = run_engine_process(model_dir, kv, [long_prompt, other], tmp_path, "tp2-a", tp=2)
    assert [o["tokens"] for o in first["outputs"]] == [r["tokens"] for r in reference]
    assert all(o["external"] == 0 for o in first["outputs"])
    # Connector stats add up over the ranks: each stores its own piece of every chunk.
    assert first["stats"]["store_tokens"] == 2 * (288 + 32)

    second = run_engine_process(model_dir, kv, [long_prompt, other], tmp_path, "tp2-b", tp=2)
    hit = (300 - 1) // CHUNK * CHUNK
    assert [o["tokens"] for o in second["outputs"]] == [r["tokens"] for r in reference]
    assert [o["external"] for o in second["outputs"]] == [hit, 32]
    assert second["stats"]["lookup_hit_tokens"] == hit + 32
    assert second["stats"]["load_tokens"] == 2 * (hit + 32)  # both ranks read their pieces
    assert second["stats"].get("store_tokens", 0) == 0  # every piece already on the server


def test_the_conformance_kits_multi_worker_quorum_passes(lmcache) -> None:
    from kvferry.testing import PASSED, run_conformance

    kv = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": lmcache.extra_config(**FAST)}  # fmt: skip
    (result,) = run_conformance(kv, scenarios=["multi-worker quorum"]).results
    assert result.status == PASSED, result.reasons
    assert "from 2 of 2 ranks" in " ".join(result.notes), result.notes
