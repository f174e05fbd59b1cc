"""LMCacheMPConnector against a real LMCache server that goes away: requests keep being
served (computed here) with greedy outputs token-identical to an engine without a
connector, no block leaks, the connector reports the outage; once a server is back on the
same address, LMCache's adapters reconnect (the worker registers its KV caches again) and
KV is shared again. Also: KV is stored once, hits skip the engine's own prefix."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from tests.kv_transfer.connectors.lmcache_mp.harness import (
    CHUNK,
    GREEDY,
    drain_and_check,
    generate,
    kv_config,
    lmcache_fixture,  # noqa: F401 - the `lmcache` fixture
    lmcache_server_mod,
    make_llm,
    prompts,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


def _tokens(outs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["tokens"] for o in outs]


def _wait_healthy(llm: Any, timeout: float = 20.0) -> None:
    engine = llm.engine
    adapters = [
        engine.scheduler.connector.scheduler_half.adapter,
        engine.executor.worker.kv_connector.worker_half.adapter,
    ]
    deadline = time.monotonic() + timeout
    while not all(a.is_healthy for a in adapters):
        assert time.monotonic() < deadline, "the LMCache adapters did not reconnect"
        time.sleep(0.1)


def test_hits_skip_the_local_prefix_and_nothing_is_stored_twice(model_dir, lmcache) -> None:
    shared, tail_a, tail_b = prompts(21, (100, 60, 60))
    batch = [shared + tail_a, shared + tail_b]
    reference = generate(make_llm(model_dir), batch)
    kv = kv_config(lmcache)
    writer = make_llm(model_dir, kv)
    assert _tokens(generate(writer, batch[:1]) + generate(writer, batch[1:])) == _tokens(reference)
    stats = drain_and_check(writer)
    # The shared 96 tokens (3 chunks) are stored once: the second request finds them.
    assert stats["store_tokens"] == 160 + (160 - 96)

    reader = make_llm(model_dir, kv)
    # The reader computes the first request's prefix itself (one block short of a chunk),
    # then loads the rest: a retrieve that starts inside a chunk skips what it holds.
    generate(reader, [shared[:48] + [7] * 5])
    outs = generate(reader, batch)
    assert _tokens(outs) == _tokens(reference)
    assert [o["cached"] for o in outs] == [(160 - 1) // CHUNK * CHUNK] * 2
    drain_and_check(reader)


def test_a_server_that_would_send_pickles_is_refused(model_dir, tmp_path) -> None:
    from kvferry.config import ConfigError

    server = lmcache_server_mod.start_lmcache_server(
        chunk_size=CHUNK, l1_size_gb=0.1, log_path=tmp_path / "lmcache.log", shared_memory=False
    )
    try:
        with pytest.raises(ConfigError, match="start the server with --shm-name"):
            make_llm(model_dir, kv_config(server))
    finally:
        server.kill()


@pytest.mark.slow
def test_server_killed_mid_run_then_back(model_dir, tmp_path, caplog) -> None:
    first, second, third, fourth = prompts(31, (200, 180, 150, 170))
    reference = generate(make_llm(model_dir), [first, second, third, fourth])
    ref = {i: r["tokens"] for i, r in enumerate(reference)}
    server = lmcache_server_mod.start_lmcache_server(
        chunk_size=CHUNK, l1_size_gb=0.25, log_path=tmp_path / "lmcache.log"
    )
    try:
        kv = kv_config(server)
        writer = make_llm(model_dir, kv)
        assert _tokens(generate(writer, [first, second])) == [ref[0], ref[1]]
        drain_and_check(writer)

        llm = make_llm(model_dir, kv)
        engine = llm.engine
        # Mid-run: requests with hits on the server are looking up / loading when it dies.
        for i, p in enumerate([first, second, third]):
            engine.add_request({"prompt_token_ids": p}, GREEDY, request_id=f"r{i}")
        engine.step()
        server.kill()
        with caplog.at_level(logging.WARNING, logger="kvferry.kv_transfer.connectors.lmcache_mp"):
            done: dict[str, list[int]] = {}
            deadline = time.monotonic() + 60
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = list(out.outputs[0].token_ids)
                assert time.monotonic() < deadline
            assert done == {"r0": ref[0], "r1": ref[1], "r2": ref[2]}
            # The outage is reported; later requests are served (computed here).
            assert _tokens(generate(llm, [fourth])) == [ref[3]]
        assert "does not answer" in caplog.text
        while engine.has_unfinished_requests():  # delayed frees come back
            engine.step()
        sched = engine.scheduler
        sched.check_integrity()
        assert sched.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_config.num_blocks

        # A server back on the same address: the adapters reconnect and store again.
        server = lmcache_server_mod.start_lmcache_server(
            chunk_size=CHUNK, l1_size_gb=0.25, port=server.port, log_path=tmp_path / "again.log"
        )
        _wait_healthy(llm)
        assert _tokens(generate(llm, [third])) == [ref[2]]
        assert drain_and_check(llm)["store_tokens"] >= 128
        fresh = make_llm(model_dir, kv)
        outs = generate(fresh, [third])
        assert outs[0]["tokens"] == ref[2] and outs[0]["external"] == 128
        drain_and_check(fresh)
    finally:
        server.kill()
