"""KV cache events from the connectors' tiers (host CPU, disk STORAGE, ExampleConnector's
files), driven through the real scheduler; and a real ``LLM`` publishing over ZMQ to a
subscriber.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvferry.config import EngineConfig, KVTransferConfig
from kvferry.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    external_block_hash,
)
from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)
from kvferry.request import Request
from tests.helpers.kv_events import RecordingPublisher, events_on
from tests.helpers.offload_harness import OffloadHarness
from tests.helpers.scheduler import (
    assert_no_leaks,
    create_request,
    create_scheduler,
    make_kv_cache_config,
    make_runner_output,
)
from tests.kv_events.source_helpers import HashIndex, ext, stored

# -- the connectors' tiers ----------------------------------------------------------------

OFFLOAD = "OffloadingConnector"


def _prompt_req(i: int, n: int = 70) -> Request:
    return create_request(prompt_token_ids=list(range(1000 * i, 1000 * i + n)), max_tokens=4)


def _chunk_events(h: OffloadHarness, index: HashIndex, pub: RecordingPublisher) -> list[Any]:
    events = pub.take()
    index.apply(events)
    return [e for e in events if e.medium != MEDIUM_GPU]


def _tier_hashes(h: OffloadHarness, tier: str) -> set[Any]:
    """Every block hash of the chunks ``tier`` holds complete, from their descriptions."""
    sched = h.connector.scheduler_half
    index = sched.mgr.host if tier == "cpu" else sched.mgr.disk
    assert index is not None and sched.events is not None
    chunks = sched.events._chunks
    out: set[Any] = set()
    for key in index:
        if index.is_ready(key) and key in chunks:
            out |= set(chunks[key].stored.block_hashes)
    return out


def test_host_tier_announces_chunks_block_by_block_and_withdraws_evicted_ones() -> None:
    pub = RecordingPublisher()
    extra = {"num_cpu_chunks": 4, "blocks_per_chunk": 2}
    h = OffloadHarness(OFFLOAD, extra, num_blocks=12, kv_event_publisher=pub)
    index = HashIndex()
    a = _prompt_req(0)
    h.add(a)
    h.run()
    cpu = _chunk_events(h, index, pub)
    # 70 prompt tokens: 4 full blocks, 2 chunks of 2 blocks, each with its parent and tokens.
    assert cpu == [stored(a, 0, 2, MEDIUM_CPU), stored(a, 2, 4, MEDIUM_CPU)]
    # Two more prompts need 4 more chunks: a's chunks are evicted from the 4-chunk host tier.
    for i in (1, 2):
        h.add(_prompt_req(i))
    h.run()
    cpu = _chunk_events(h, index, pub)
    removed = [e for e in cpu if isinstance(e, BlockRemoved)]
    assert {tuple(e.block_hashes) for e in removed} == {tuple(ext(a, 0, 1)), tuple(ext(a, 2, 3))}
    assert all(e.medium == MEDIUM_CPU for e in cpu)
    assert index.of(MEDIUM_CPU) == _tier_hashes(h, "cpu") and len(index.of(MEDIUM_CPU)) == 8
    h.assert_clean()
    h.shutdown()


def test_disk_tier_announces_storage_and_a_restart_announces_what_requests_find(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVFERRY_KV_SECRET", raising=False)  # files unkeyed, whatever the env
    monkeypatch.delenv("KVFERRY_KV_SECRET_FILE", raising=False)
    extra = {"num_cpu_chunks": 2, "disk_path": str(tmp_path), "num_disk_chunks": 64}
    pub = RecordingPublisher()
    h = OffloadHarness(OFFLOAD, extra, num_blocks=12, kv_event_publisher=pub)
    index = HashIndex()
    reqs = [_prompt_req(i) for i in range(2)]
    for r in reqs:
        h.add(r)
    h.run()
    _chunk_events(h, index, pub)
    # Write-through: every chunk (one block each) is on disk; the 2-chunk host keeps two.
    want = {x for r in reqs for x in ext(r, 0, 1, 2, 3)}
    assert index.of(MEDIUM_STORAGE) == want == _tier_hashes(h, "disk")
    assert index.of(MEDIUM_CPU) == _tier_hashes(h, "cpu") and len(index.of(MEDIUM_CPU)) == 2
    h.assert_clean()
    h.shutdown()

    # A new engine on the folder: its files are unannounced until a request meets them (the
    # scheduler knows their tokens only then), and they are announced once they checked out.
    pub2 = RecordingPublisher()
    h2 = OffloadHarness(OFFLOAD, extra, num_blocks=12, kv_event_publisher=pub2)
    index2 = HashIndex()
    h2.step()
    assert pub2.take() == []
    a = _prompt_req(0)
    h2.add(a)
    h2.run()
    tiers = _chunk_events(h2, index2, pub2)
    assert stored(a, 0, 1, MEDIUM_STORAGE) in tiers and stored(a, 3, 4, MEDIUM_STORAGE) in tiers
    assert index2.of(MEDIUM_STORAGE) == set(ext(a, 0, 1, 2, 3))
    assert index2.of(MEDIUM_CPU) == _tier_hashes(h2, "cpu")
    h2.assert_clean()
    h2.shutdown()


def test_example_connector_announces_its_files_as_storage(tmp_path: Path) -> None:
    kvt = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    config = cast(
        EngineConfig, SimpleNamespace(kv_transfer_config=kvt, kv_events_config=events_on())
    )
    conn = ExampleConnector(config, KVConnectorRole.SCHEDULER, make_kv_cache_config(64))
    pub = RecordingPublisher()
    s = create_scheduler(connector=conn, kv_events_config=events_on(), kv_event_publisher=pub)
    index = HashIndex()
    shared = list(range(3000, 3040))
    a = create_request(prompt_token_ids=shared + [1, 2, 3], max_tokens=1)  # stores 32 tokens
    b = create_request(prompt_token_ids=shared + list(range(50, 70)), max_tokens=1)  # 48
    failed = create_request(60, max_tokens=1)
    for r in (a, b, failed):
        s.add_request(r)
        while s.has_requests():
            so = s.schedule()
            meta = so.kv_connector_metadata
            assert isinstance(meta, ExampleConnectorMetadata)
            for job in meta.stores:  # the worker's save; the third request's save fails
                if job.req_id != failed.request_id:
                    folder = conn.root / job.key
                    folder.mkdir(parents=True)
                    (folder / "meta.json").write_text(json.dumps({"num_tokens": job.num_tokens}))
            s.update_from_output(so, make_runner_output(s, so))
            index.apply(pub.take())
    events = [e for b_ in pub.batches for e in b_.events if e.medium == MEDIUM_STORAGE]
    # b shares a's first 2 blocks: only its third block is news, with a's second as parent.
    assert events == [stored(a, 0, 2, MEDIUM_STORAGE), stored(b, 2, 3, MEDIUM_STORAGE)]
    assert index.of(MEDIUM_STORAGE) == set(ext(b, 0, 1, 2))
    assert conn.take_events() == []
    assert_no_leaks(s)


# -- a real engine, publishing over ZMQ ---------------------------------------------------


def test_llm_publishes_its_prefix_cache_over_zmq(tiny_model_factory: Any, tmp_path: Path) -> None:
    from kvferry import LLM, SamplingParams
    from kvferry.core.block_hash import get_request_block_hasher
    from kvferry.kv_events import decode_batch
    from tests.helpers.ports import _dead_port
    from tests.kv_events.zmq_helpers import subscribe

    endpoint = f"tcp://127.0.0.1:{_dead_port()}"
    llm = LLM(
        model=str(tiny_model_factory()),
        dtype="float32",
        max_model_len=256,
        kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "kv"},
        kv_transfer_config={
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        },
    )
    sched = llm.engine.scheduler
    publisher = sched.kv_event_publisher
    assert publisher is not None
    sub, _ = subscribe(endpoint, "kv", publisher.publish)
    try:
        prompt = list(range(10, 10 + 3 * 16 + 5))
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)
        assert sched.reset_prefix_cache()
        llm.shutdown()
        llm.shutdown()  # idempotent
        received: list[Any] = []
        seqs: list[int] = []
        while sub.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            batch = decode_batch(payload)
            if batch.ts < 0:
                continue  # the subscription's warm-up markers
            assert topic == b"kv" and batch.data_parallel_rank == 0
            seqs.append(int.from_bytes(seq, "big"))
            received += batch.events
    finally:
        sub.close(linger=0)
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    bs = llm.engine.config.cache_config.block_size
    request = Request("x", prompt, params, block_hasher=get_request_block_hasher(bs))
    hashes = [external_block_hash(h) for h in request.block_hashes]
    gpu = [e for e in received if isinstance(e, BlockStored) and e.medium == MEDIUM_GPU]
    # The prompt's 3 full blocks once (the second request hit them), as one run.
    assert gpu[0].block_hashes == hashes[:3] and gpu[0].parent_block_hash is None
    assert gpu[0].token_ids == prompt[: 3 * bs] and gpu[0].block_size == bs
    assert all(not set(e.block_hashes) & set(hashes[:3]) for e in gpu[1:])
    storage = [e for e in received if isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE]
    assert [e.block_hashes for e in storage] == [hashes[:3]]  # ExampleConnector's one save
    assert isinstance(received[-1], AllBlocksCleared)
    assert sched.kv_event_publisher is None
