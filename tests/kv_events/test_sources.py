"""Where KV cache events come from, driven through the real scheduler step by step: the engine's
prefix cache (GPU: cached, evicted, reset), one batch per step, nothing at all when events are
off, and the workers' events through the connector. The connectors' tiers are in
test_tier_sources.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvferry.config import KVEventsConfig
from kvferry.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CommonKVEvents,
    KVConnectorKVEvents,
)
from kvferry.kv_transfer.aggregator import KVOutputAggregator
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from tests.helpers.kv_events import RecordingPublisher, events_on
from tests.helpers.scheduler import (
    FakeWorker,
    assert_no_leaks,
    create_request,
    create_scheduler,
    make_runner_output,
    run_until_done,
    step,
    table,
)
from tests.helpers.scripted_connector import ScriptedConnector
from tests.kv_events.source_helpers import BS, HashIndex, events_scheduler, ext, gpu_hashes, stored

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
