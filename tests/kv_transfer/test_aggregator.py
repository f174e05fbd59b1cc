"""KVOutputAggregator: one KVConnectorOutput per step out of several workers' outputs."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.kv_transfer.aggregator import KVOutputAggregator
from kvferry.kv_transfer.base import KVConnectorStats, KVConnectorWorkerMetadata
from kvferry.step_types.kv_connector_output import KVConnectorOutput


@dataclass
class CountMeta(KVConnectorWorkerMetadata):
    counts: dict[str, int]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CountMeta)
        merged = dict(self.counts)
        for key, n in other.counts.items():
            merged[key] = merged.get(key, 0) + n
        return CountMeta(merged)


def test_finished_ids_need_every_worker_across_steps() -> None:
    agg = KVOutputAggregator(expected_finished_count=3)
    out = agg.aggregate(
        [
            KVConnectorOutput(finished_sending={"s"}, finished_recving={"r"}),
            KVConnectorOutput(finished_recving={"r"}),
            None,  # a worker with nothing to say this step
        ]
    )
    assert out.finished_sending is None and out.finished_recving is None
    assert agg.pending() == {"s": {"sending": 2}, "r": {"recving": 1}}
    out = agg.aggregate([KVConnectorOutput(), KVConnectorOutput(finished_recving={"r"})])
    assert out.finished_recving == {"r"} and out.finished_sending is None
    out = agg.aggregate(
        [KVConnectorOutput(finished_sending={"s"}), KVConnectorOutput(finished_sending={"s"})]
    )
    assert out.finished_sending == {"s"} and agg.pending() == {}


def test_failed_recving_surfaces_with_the_completed_quorum() -> None:
    agg = KVOutputAggregator(expected_finished_count=2)
    out = agg.aggregate(
        [
            KVConnectorOutput(finished_recving={"a", "b"}, failed_recving={"b"}),
            KVConnectorOutput(finished_recving={"a"}),
        ]
    )
    assert out.finished_recving == {"a"} and out.failed_recving == set()
    out = agg.aggregate([KVConnectorOutput(), KVConnectorOutput(finished_recving={"b"})])
    assert out.finished_recving == {"b"} and out.failed_recving == {"b"}
    out = agg.aggregate([KVConnectorOutput(), KVConnectorOutput()])
    assert out.failed_recving == set() and agg.pending() == {}


def test_invalid_blocks_stats_events_and_worker_meta_are_merged() -> None:
    agg = KVOutputAggregator(expected_finished_count=2)
    out = agg.aggregate(
        [
            KVConnectorOutput(
                invalid_block_ids={1, 2},
                kv_connector_stats=KVConnectorStats({"bytes": 10, "lat": [1.0]}),
                kv_cache_events=["e0", "both"],
                kv_connector_worker_meta=CountMeta({"job": 1}),
            ),
            KVConnectorOutput(
                invalid_block_ids={2, 3},
                kv_connector_stats=KVConnectorStats({"bytes": 5, "lat": [3.0]}),
                kv_cache_events=["both", "e1"],
                kv_connector_worker_meta=CountMeta({"job": 1, "other": 1}),
            ),
        ]
    )
    assert out.invalid_block_ids == {1, 2, 3}
    assert out.kv_connector_stats is not None
    assert out.kv_connector_stats.data == {"bytes": 15, "lat": [1.0, 3.0]}
    assert out.kv_connector_stats.reduce() == {"bytes": 15, "lat_avg": 2.0, "lat_count": 2}
    assert out.kv_cache_events == ["both"]  # published once every worker reported it
    assert out.kv_connector_worker_meta == CountMeta({"job": 2, "other": 1})
    assert out.expected_finished_count == 2


def test_expected_count_change_applies_to_new_ids_only() -> None:
    agg = KVOutputAggregator(expected_finished_count=4)
    agg.aggregate([KVConnectorOutput(finished_sending={"old"})])
    out = agg.aggregate([KVConnectorOutput(finished_sending={"new"}, expected_finished_count=2)])
    assert out.expected_finished_count == 2 and out.finished_sending is None
    out = agg.aggregate([KVConnectorOutput(finished_sending={"new", "old"})])
    assert out.finished_sending == {"new"}  # "old" still waits for its original quorum
    assert agg.pending() == {"old": {"sending": 2}}
