"""MooncakeStoreConnector end to end on a real ``mooncake_master``: engines in separate
processes share prompt KV (greedy outputs token-identical to an engine without connector),
hits survive an engine restart, a master killed mid-run costs only recomputation (no leak,
clear report, reconnection when it comes back), and corrupt or short values are misses."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest

from kvferry import LLM
from kvferry.kv_transfer.stores.chunk_codec import HEADER_BYTES
from kvferry.kv_transfer.stores.master import MooncakeMaster
from kvferry.kv_transfer.stores.mooncake_client import MooncakeStoreClient
from kvferry.kv_transfer.stores.mooncake_config import load_mooncake_config
from tests.helpers.mooncake_store import (
    drain,
    engine_args,
    generate,
    master_fixture,
    prompts,
    run_child,
    store_kv,
)

PROMPTS = prompts()
CHUNK_TOKENS = 32  # blocks_per_chunk 2 x block size 16
# Whole chunks before each prompt's last token: 150 tokens -> 4 chunks of 32.
FULL_HIT = len(PROMPTS) * (149 // CHUNK_TOKENS) * CHUNK_TOKENS


mooncake_master = pytest.fixture(master_fixture)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    llm = LLM(**engine_args(model_dir, None))
    outs, _ = generate(llm, PROMPTS)
    llm.engine.shutdown()
    return outs


def _scheduler(llm: LLM):
    return llm.engine.scheduler.connector.scheduler_half


def test_second_engine_hits_and_restart_keeps_hits(model_dir, reference, mooncake_master):
    kv = store_kv(mooncake_master)
    first = LLM(**engine_args(model_dir, kv))
    outs, hits = generate(first, PROMPTS)
    assert outs == reference and hits == 0
    stats = drain(first)
    assert stats["stored_chunks"] == 12 and stats["put_bytes"] > 0

    second = run_child(model_dir, kv, PROMPTS)  # another process, same master
    assert second["outputs"] == reference
    assert second["hits"] == FULL_HIT
    assert second["stats"]["hit_tokens"] == FULL_HIT and second["stats"]["get_chunks"] == 12

    restarted = run_child(model_dir, kv, PROMPTS)
    assert restarted["outputs"] == reference and restarted["hits"] == FULL_HIT


def _wait(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_master_killed_mid_run(model_dir, reference, mooncake_master, caplog):
    caplog.set_level(logging.WARNING, logger="kvferry")
    llm = LLM(**engine_args(model_dir, store_kv(mooncake_master)))
    outs, _ = generate(llm, PROMPTS[:1])
    assert outs == reference[:1]
    sched = _scheduler(llm)
    mooncake_master.kill()
    assert _wait(lambda: not sched.link.up)
    outs, hits = generate(llm, PROMPTS)  # served by recomputation, nothing stalls
    assert outs == reference and hits == 0
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert 1 <= len(unreachable) <= 2  # once per half, not per step

    puts_before = llm.engine.kv_connector_totals.as_dict().get("put_chunks", 0)
    mooncake_master.start()  # same ports, empty store
    assert _wait(lambda: sched.link.up)
    worker = llm.engine.executor.worker.kv_connector.worker_half  # type: ignore[union-attr]
    assert _wait(lambda: worker.link.up)
    outs, _ = generate(llm, prompts(1, seed=11))  # a new prompt, stored into the new master
    stats = drain(llm)
    assert stats.get("put_chunks", 0) > puts_before


def _corrupt(master: MooncakeMaster, keys: list[str]) -> None:
    """Overwrite each value: the first with a flipped payload byte, the others truncated."""
    client = MooncakeStoreClient(load_mooncake_config(master.config(0), environ={}))
    assert client.setup() is None
    buf = np.zeros(1 << 20, dtype=np.uint8)
    ptr = buf.ctypes.data
    assert client.register_buffer(ptr, buf.nbytes)
    for i, key in enumerate(keys):
        (n,) = client.get_into([key], [ptr], [buf.nbytes])
        assert n > HEADER_BYTES
        if i == 0:
            buf[HEADER_BYTES + 7] ^= 0xFF
        else:
            n = n // 2
        assert client.remove([key]) == [0]
        assert client.put_from([key], [ptr], [n]) == [0]
    client.close()


def test_corrupt_and_short_values_are_misses(model_dir, reference, mooncake_master):
    kv = store_kv(mooncake_master)
    first = LLM(**engine_args(model_dir, kv))
    generate(first, PROMPTS)
    keys = list(_scheduler(first).stored_keys)
    drain(first)
    # The first chunk of the first prompt (bit flip), and the first chunk of the second
    # prompt (truncated): both prompts must recompute from there.
    _corrupt(mooncake_master, [f"{keys[0]}/r0", f"{keys[4]}/r0"])
    second = run_child(model_dir, kv, PROMPTS)
    assert second["outputs"] == reference
    assert second["stats"]["corrupt_chunks"] == 2
    # Third prompt intact: still a full hit.
    assert second["stats"]["get_chunks"] >= 4


def test_events_announce_what_the_store_holds(model_dir, reference, mooncake_master):
    from kvferry.kv_events import BlockStored, external_block_hash
    from tests.helpers.kv_events import RecordingPublisher
    from tests.helpers.ports import _dead_port

    args = engine_args(model_dir, store_kv(mooncake_master))
    endpoint = f"tcp://127.0.0.1:{_dead_port()}"
    llm = LLM(**args, kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint})
    sched = llm.engine.scheduler
    sched.close_kv_event_publisher()  # the test reads the batches straight from the engine
    pub = RecordingPublisher()
    sched.kv_event_publisher = pub
    outputs, _ = generate(llm, PROMPTS)
    drain(llm)  # stores still in flight when generate() returns complete here
    keys = list(_scheduler(llm).stored_keys)
    assert outputs == reference
    events = pub.take()
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "cpu"]
    # One event per stored chunk, naming its blocks (with their tokens), once each.
    assert len(stored) == len(keys) == FULL_HIT // CHUNK_TOKENS
    announced = [h for e in stored for h in e.block_hashes]
    assert len(announced) == len(set(announced)) == len(keys) * 2
    assert all(len(e.token_ids) == 2 * 16 for e in stored)
    hashes = _scheduler(llm).stored_keys
    assert sorted(announced) == sorted(external_block_hash(h) for k in keys for h in hashes[k])


def test_tp2_engines_share_through_the_store(tiny_model_factory, mooncake_master):
    """Two TP=2 engines: each rank stores and loads its own heads under its own key; a chunk
    is a hit only once both ranks stored it, and outputs match a TP=2 run without it."""
    model_dir = tiny_model_factory("llama", heads=4, kv_heads=2)
    args = {**engine_args(model_dir, None), "tensor_parallel_size": 2}
    plain = LLM(**args)
    reference, _ = generate(plain, PROMPTS)
    plain.engine.shutdown()
    kv = store_kv(mooncake_master)
    first = LLM(**{**args, "kv_transfer_config": kv})
    outs, hits = generate(first, PROMPTS)
    assert outs == reference and hits == 0
    keys = list(_scheduler(first).stored_keys)
    stats = drain(first)
    assert stats["stored_chunks"] == 12 and stats["put_bytes"] > 0
    client = MooncakeStoreClient(load_mooncake_config(mooncake_master.config(0), environ={}))
    assert client.setup() is None
    try:
        for r in (0, 1):  # each rank's own value of every chunk
            assert client.exists([f"{k}/r{r}" for k in keys]) == [True] * len(keys)
    finally:
        client.close()
    second = LLM(**{**args, "kv_transfer_config": kv})
    outs, hits = generate(second, PROMPTS)
    assert outs == reference and hits == FULL_HIT
    drain(second)
