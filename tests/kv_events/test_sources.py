"""Where KV cache events come from, driven through the real scheduler step by step: the engine's
prefix cache (GPU: cached, evicted, reset), the connectors' tiers (host CPU, disk STORAGE,
ExampleConnector's files), the workers' events through the connector, one batch per step,
nothing at all when events are off; and a real ``LLM`` publishing over ZMQ to a subscriber.

A subscriber that keeps, per medium, the set of hashes it was told about must end up with
exactly what the engine holds: :class:`HashIndex` replays the events and checks that
nothing is announced twice or withdrawn without having been announced.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvferry.config import EngineConfig, KVEventsConfig, KVTransferConfig
from kvferry.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CommonKVEvents,
    KVConnectorKVEvents,
    external_block_hash,
)
from kvferry.kv_transfer.aggregator import KVOutputAggregator
from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)
from kvferry.request import Request
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from tests.helpers.kv_events import RecordingPublisher, events_on
from tests.helpers.offload_harness import OffloadHarness
from tests.helpers.scheduler import (
    BLOCK_SIZE,
    FakeWorker,
    assert_no_leaks,
    create_request,
    create_scheduler,
    make_kv_cache_config,
    make_runner_output,
    run_until_done,
    step,
    table,
)
from tests.helpers.scripted_connector import ScriptedConnector

BS = BLOCK_SIZE


def ext(request: Request, *blocks: int) -> list[int | bytes]:
    return [external_block_hash(request.block_hashes[i]) for i in blocks]


def stored(request: Request, start: int, end: int, medium: str = MEDIUM_GPU) -> BlockStored:
    """The BlockStored a source must emit for blocks [start, end) of ``request``."""
    return BlockStored(
        block_hashes=ext(request, *range(start, end)),
        parent_block_hash=ext(request, start - 1)[0] if start else None,
        token_ids=request.all_token_ids[start * BS : end * BS],
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=[None] * (end - start),
        group_idx=0,
    )


class HashIndex:
    """What a set-keeping subscriber knows: hashes per medium, checked as events arrive."""

    def __init__(self) -> None:
        self.held: dict[str | None, set[Any]] = {}

    def apply(self, events: list[Any]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                held = self.held.setdefault(e.medium, set())
                assert not held & set(e.block_hashes), f"announced twice: {e}"
                if e.medium == MEDIUM_GPU and e.parent_block_hash is not None:
                    assert e.parent_block_hash in held, "a parent the pool never announced"
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
                held |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                held = self.held.setdefault(e.medium, set())
                assert set(e.block_hashes) <= held, f"withdrawn unannounced: {e}"
                held -= set(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.held.pop(MEDIUM_GPU, None)

    def of(self, medium: str) -> set[Any]:
        return self.held.get(medium, set())


def gpu_hashes(s: Any) -> set[Any]:
    return {external_block_hash(h) for h in s.kv_cache_manager.block_pool.cached_blocks}


def events_scheduler(**kw: Any) -> tuple[Any, RecordingPublisher]:
    pub = RecordingPublisher()
    return create_scheduler(kv_events_config=events_on(), kv_event_publisher=pub, **kw), pub


# -- the engine's prefix cache ------------------------------------------------------------


def test_cached_blocks_are_announced_per_step_with_hashes_parents_and_tokens() -> None:
    s, pub = events_scheduler(max_num_batched_tokens=32)
    a = create_request(48, max_tokens=1)
    s.add_request(a)
    step(s)  # 32 prompt tokens: blocks 0 and 1 cached at allocation
    assert pub.take() == [stored(a, 0, 2)]
    step(s)  # the last 16: block 2, whose parent is block 1
    assert pub.take() == [stored(a, 2, 3)]
    assert pub.batches[0].data_parallel_rank == 0 and pub.batches[0].ts > 0
    run_until_done(s)
    assert len(pub.batches) == 2  # steps without events publish nothing
    s.shutdown()
    assert pub.closed == 1
    assert_no_leaks(s)


def test_a_salted_request_names_its_salt_on_its_first_block() -> None:
    s, pub = events_scheduler()
    a = create_request(40, max_tokens=1, cache_salt="tenant-a")
    s.add_request(a)
    run_until_done(s)
    (event,) = pub.take()
    assert event.extra_keys == [("tenant-a",), None]  # vLLM's untagged extra keys
    assert event.block_hashes == ext(a, 0, 1)
    assert_no_leaks(s)


def test_a_hash_is_announced_once_and_withdrawn_with_its_last_copy() -> None:
    s, pub = events_scheduler(num_blocks=8, max_model_len=128)
    index = HashIndex()
    prompt = list(range(500, 532))
    a = create_request(prompt_token_ids=prompt, max_tokens=1)
    b = create_request(prompt_token_ids=prompt, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()  # b hits a's block 0 and computes its own copy of block 1
    ta, tb = table(s, a), table(s, b)
    assert ta[0] == tb[0] and ta[1] != tb[1]
    s.update_from_output(so, make_runner_output(s, so))
    events = pub.take()
    assert events == [stored(a, 0, 2)]  # b's copy of block 1 is not news
    index.apply(events)
    s.kv_cache_manager.evict_blocks([tb[1]])  # a's copy still holds the hash
    s.kv_cache_manager.evict_blocks([ta[1]])
    step(s)  # the finished ids' step carries the removal
    events = pub.take()
    assert events == [BlockRemoved(block_hashes=ext(a, 1), medium=MEDIUM_GPU, group_idx=0)]
    index.apply(events)
    # A request needing every block evicts the rest (LRU), then announces its own blocks.
    c = create_request(120, max_tokens=1)
    s.add_request(c)
    step(s)
    events = pub.take()
    assert events == [
        BlockRemoved(block_hashes=ext(a, 0), medium=MEDIUM_GPU, group_idx=0),
        stored(c, 0, 7),
    ]
    index.apply(events)
    run_until_done(s)
    assert index.of(MEDIUM_GPU) == gpu_hashes(s)
    assert_no_leaks(s)


def test_reset_prefix_cache_publishes_all_blocks_cleared_at_once() -> None:
    s, pub = events_scheduler(max_num_batched_tokens=32)
    a = create_request(64, max_tokens=1)
    s.add_request(a)
    step(s)
    pub.take()
    assert not s.reset_prefix_cache()  # a holds blocks: refused, nothing published
    assert pub.take() == []
    run_until_done(s)
    pub.take()
    assert s.reset_prefix_cache()
    assert pub.take() == [AllBlocksCleared()]  # between steps, not with the next request
    assert gpu_hashes(s) == set()
    assert_no_leaks(s)


def test_one_batch_per_step_and_the_index_matches_the_pool() -> None:
    s, pub = events_scheduler(num_blocks=24, max_num_batched_tokens=64, max_model_len=128)
    worker = FakeWorker(s)
    index = HashIndex()
    system = list(range(7000, 7040))
    for i in range(10):
        tail = list(range(100 * i, 100 * i + 10 + 7 * i))
        s.add_request(create_request(prompt_token_ids=system + tail, max_tokens=12))
    steps = 0
    while s.has_requests():
        before = len(pub.batches)
        step(s, worker)
        steps += 1
        assert len(pub.batches) - before <= 1
        index.apply(pub.take())
        assert index.of(MEDIUM_GPU) == gpu_hashes(s)
    assert s.num_preemptions > 0  # the pool was tight: evictions and preemptions happened
    assert 0 < len(pub.batches) <= steps
    assert_no_leaks(s)


class _Draining(ScriptedConnector):
    def __init__(self) -> None:
        super().__init__()
        self.drained = 0

    def take_events(self) -> list[Any]:
        self.drained += 1
        return ["connector-event"]


@pytest.mark.parametrize(
    "config",
    [None, KVEventsConfig(), KVEventsConfig(enable_kv_cache_events=True, publisher="null")],
)
def test_nothing_is_recorded_or_published_when_events_are_off(
    config: KVEventsConfig | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any) -> None:
        raise AssertionError("an event was built with events off")

    monkeypatch.setattr("kvferry.core.block_pool.blocks_stored", never)
    monkeypatch.setattr("kvferry.core.block_pool.blocks_removed", never)
    pub = RecordingPublisher()
    conn = _Draining()
    s = create_scheduler(
        num_blocks=8,
        max_model_len=128,
        connector=conn,
        kv_events_config=config,
        kv_event_publisher=pub,
    )
    assert s.kv_event_publisher is None
    prompt = list(range(32))
    for _ in range(3):
        s.add_request(create_request(prompt_token_ids=prompt, max_tokens=1))
    s.add_request(create_request(120, max_tokens=1))  # evicts the shared prefix
    result = run_until_done(s)
    assert s.reset_prefix_cache()
    assert pub.batches == [] and s.kv_cache_manager.block_pool.kv_event_queue == []
    # The connector's queue is still drained every step, so it cannot grow.
    assert conn.drained == result.num_steps + 1
    s.shutdown()
    assert pub.closed == 0
    assert_no_leaks(s)


# -- the workers' events, through the connector ------------------------------------------


class _Relay(ScriptedConnector):
    """Takes the workers' merged events in update_connector_output, as vLLM's LMCache
    connector does, and hands them out from take_events."""

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[Any] = []

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        events = connector_output.kv_cache_events
        if isinstance(events, KVConnectorKVEvents):
            self._pending += events.aggregate().get_all_events()
            events.clear_events()

    def take_events(self) -> list[Any]:
        out, self._pending = self._pending, []
        return out


def test_worker_events_reach_the_batch_through_the_connector() -> None:
    pub = RecordingPublisher()
    conn = _Relay()
    s = create_scheduler(connector=conn, kv_events_config=events_on(), kv_event_publisher=pub)
    worker = FakeWorker(s)
    a = create_request(40, max_tokens=1)
    both = BlockStored([11, 12], None, list(range(2 * BS)), BS, None, MEDIUM_CPU, None)
    one = BlockRemoved([99], MEDIUM_CPU)
    aggregator = KVOutputAggregator(2)
    merged = aggregator.aggregate(
        [
            KVConnectorOutput(kv_cache_events=CommonKVEvents([both, one])),
            KVConnectorOutput(kv_cache_events=CommonKVEvents([both])),
        ]
    )
    s.add_request(a)
    step(s, worker, kv_output=merged)
    # One batch: the prefix cache's events first, then what every worker reported.
    assert [b.events for b in pub.batches] == [[stored(a, 0, 2), both]]
    assert conn.outputs[-1] is merged
    run_until_done(s, worker)
    assert len(pub.batches) == 1
    assert_no_leaks(s)


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
