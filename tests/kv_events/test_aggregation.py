"""Cross-worker merge of KV cache events: vLLM's aggregator semantics and the executor's merge
(an event is published once every worker of the step reported it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvferry.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CommonKVEvents,
    KVConnectorKVEvents,
    KVEventAggregator,
    UnionKVEvents,
    external_block_hash,
    merge_worker_events,
)
from kvferry.kv_transfer.aggregator import KVOutputAggregator
from kvferry.step_types.kv_connector_output import KVConnectorOutput


def stored(n: int, medium: str = MEDIUM_CPU) -> BlockStored:
    h = external_block_hash(n.to_bytes(32, "big"))
    return BlockStored([h], None, list(range(n, n + 4)), 4, None, medium, None)


def removed(n: int, medium: str = MEDIUM_CPU) -> BlockRemoved:
    return BlockRemoved([external_block_hash(n.to_bytes(32, "big"))], medium)


# -- KVEventAggregator (vLLM's methods) ----------------------------------------------------


def test_aggregator_keeps_common_events_and_counts_workers() -> None:
    agg = KVEventAggregator(2)
    agg.add_events([stored(1), removed(2)])
    agg.add_events([stored(1)])
    assert agg.get_common_events() == [stored(1)]
    assert sorted(map(repr, agg.get_all_events())) == sorted(
        map(repr, [stored(1), removed(2), stored(1)])
    )
    agg.increment_workers(1)
    assert agg.get_number_of_workers() == 3 and agg.get_common_events() == []
    agg.reset_workers()
    assert agg.get_number_of_workers() == 1
    agg.clear_events()
    assert agg.get_all_events() == [] and agg.get_common_events() == []
    assert "workers=1" in repr(agg)


def test_aggregator_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        KVEventAggregator(0)
    agg = KVEventAggregator(1)
    with pytest.raises(TypeError):
        agg.add_events((stored(1),))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        agg.increment_workers(0)


def test_common_events_keep_order_and_repeats() -> None:
    # Stored, evicted and stored again within one step: the block ends up stored.
    seq = [stored(1), removed(1), stored(1)]
    agg = KVEventAggregator(2)
    agg.add_events(list(seq))
    agg.add_events(list(seq))
    assert agg.get_common_events() == seq
    one = KVEventAggregator(1)
    one.add_events(list(seq))
    assert one.get_common_events() == seq


def test_unhashable_connector_events_are_counted_by_value() -> None:
    agg = KVEventAggregator(2)
    agg.add_events([{"k": [1]}, {"k": [2]}])
    agg.add_events([{"k": [1]}])
    assert agg.get_common_events() == [{"k": [1]}]


# -- KVConnectorKVEvents -------------------------------------------------------------------


def test_abstract_base_has_vllm_methods() -> None:
    with pytest.raises(TypeError):
        KVConnectorKVEvents()  # type: ignore[abstract]
    for name in (
        "add_events",
        "aggregate",
        "increment_workers",
        "get_all_events",
        "get_number_of_workers",
        "clear_events",
        "merge",
    ):
        assert callable(getattr(KVConnectorKVEvents, name))


def test_common_events_merge_aggregate_and_clear() -> None:
    w0, w1 = CommonKVEvents([stored(1), stored(2)]), CommonKVEvents([stored(1)])
    assert w0.merge(w1) is w0
    assert w0.get_number_of_workers() == 1  # merge adds events; the caller counts workers
    w0.increment_workers(w1.get_number_of_workers())
    assert w0.aggregate() is w0
    assert w0.get_all_events() == [stored(1)] and w0.get_number_of_workers() == 1
    w0.aggregate()  # idempotent
    assert w0.get_all_events() == [stored(1)]
    w0.increment_workers(2)
    w0.clear_events()
    assert w0.get_all_events() == [] and w0.get_number_of_workers() == 1


def test_union_events_keep_what_any_worker_stored() -> None:
    w0 = UnionKVEvents([stored(1, MEDIUM_STORAGE), stored(3, MEDIUM_STORAGE)])
    w1 = UnionKVEvents([stored(2, MEDIUM_STORAGE), stored(3, MEDIUM_STORAGE)])
    w0.merge(w1)
    w0.increment_workers(1)
    w0.aggregate()
    assert w0.get_all_events() == [
        stored(1, MEDIUM_STORAGE),
        stored(3, MEDIUM_STORAGE),
        stored(2, MEDIUM_STORAGE),
    ]


# -- the executor's merge, with fake workers -----------------------------------------------


@dataclass
class FakeWorker:
    """Reports, step by step, the events a script gives it (a list, an object, or None)."""

    script: Callable[[int], Any]
    steps: list[int] = field(default_factory=list)

    def output(self, step: int) -> KVConnectorOutput | None:
        self.steps.append(step)
        events = self.script(step)
        if events == "no-output":
            return None
        return KVConnectorOutput(kv_cache_events=events)


def run_steps(workers: list[FakeWorker], steps: int) -> tuple[list[Any], KVOutputAggregator]:
    agg = KVOutputAggregator(expected_finished_count=len(workers))
    published = []
    for k in range(steps):
        out = agg.aggregate([w.output(k) for w in workers])
        events = out.kv_cache_events
        if isinstance(events, KVConnectorKVEvents):
            events = events.get_all_events()
        published.append(events)
    return published, agg


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_events_every_worker_reported_are_published(num_workers: int) -> None:
    workers = [FakeWorker(lambda k: [stored(k), removed(100 + k)]) for _ in range(num_workers)]
    published, agg = run_steps(workers, 3)
    assert published == [[stored(k), removed(100 + k)] for k in range(3)]
    assert agg.pending() == {}


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_connector_event_objects_are_merged_and_aggregated(num_workers: int) -> None:
    workers = [FakeWorker(lambda k: CommonKVEvents([stored(k)])) for _ in range(num_workers)]
    agg = KVOutputAggregator(expected_finished_count=num_workers)
    out = agg.aggregate([w.output(0) for w in workers])
    # The connector's own class reaches its update_connector_output, ready to publish.
    assert isinstance(out.kv_cache_events, CommonKVEvents)
    assert out.kv_cache_events.get_all_events() == [stored(0)]
    assert out.kv_cache_events.get_number_of_workers() == 1


def test_partial_reports_are_not_published() -> None:
    def third(k: int) -> Any:
        return [stored(0)] if k == 0 else "no-output" if k == 1 else None

    workers = [
        FakeWorker(lambda k: [stored(k), AllBlocksCleared()]),
        FakeWorker(lambda k: [stored(k)]),
        FakeWorker(third),
    ]
    published, agg = run_steps(workers, 3)
    # Step 0: only stored(0) came from all three; steps 1-2: the third reported nothing.
    assert published == [[stored(0)], None, None]
    assert agg.pending() == {}


def test_partial_reports_of_connector_objects_are_not_published() -> None:
    reports: list[Any] = [CommonKVEvents([stored(1), stored(2)]), None, [stored(1)]]
    merged = merge_worker_events(reports)
    assert isinstance(merged, CommonKVEvents) and merged.get_all_events() == []
    reports = [CommonKVEvents([stored(1), stored(2)]), [stored(2)], CommonKVEvents([stored(2)])]
    merged = merge_worker_events(reports)
    assert isinstance(merged, CommonKVEvents) and merged.get_all_events() == [stored(2)]


def test_sharded_writes_publish_the_union_across_workers() -> None:
    workers = [FakeWorker(lambda k, r=r: UnionKVEvents([stored(10 * k + r)])) for r in range(3)]
    published, _ = run_steps(workers, 2)
    assert published == [[stored(0), stored(1), stored(2)], [stored(10), stored(11), stored(12)]]


def test_no_reports_give_no_events() -> None:
    assert merge_worker_events([None, None]) is None
    assert merge_worker_events([[], None]) is None
    assert merge_worker_events([[stored(1)]]) == [stored(1)]


def test_vllm_style_consumer_reads_the_merged_object() -> None:
    """A connector written like vLLM's LMCache one keeps the object in update_connector_output
    and aggregates again in take_events: it publishes exactly what the executor kept."""
    held: CommonKVEvents | None = None
    agg = KVOutputAggregator(expected_finished_count=2)
    out = agg.aggregate(
        [
            KVConnectorOutput(kv_cache_events=CommonKVEvents([stored(1), stored(2)])),
            KVConnectorOutput(kv_cache_events=CommonKVEvents([stored(2)])),
        ]
    )
    if isinstance(out.kv_cache_events, CommonKVEvents):
        held = out.kv_cache_events
    assert held is not None
    held.aggregate()
    assert held.get_all_events() == [stored(2)]
