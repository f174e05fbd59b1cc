"""vLLM 0.33's hooks through kvferry's wrapping connectors: a MultiConnector and a
FaultInjectionConnector over vLLM-style children that override only the new names
(:mod:`.new_names_connector`, loaded by module path) reach every child with vLLM's
aggregation semantics. Scheduler-side tests drive the real scheduler and end with a leak
check."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvferry.config import EngineConfig, KVTransferConfig
from kvferry.entrypoints.metrics import _bound_to
from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvferry.kv_transfer.base import KVConnectorRole, KVConnectorStats
from kvferry.kv_transfer.connectors.fault_injection import FaultInjectionConnector
from kvferry.kv_transfer.connectors.multi_connector import MultiConnector
from kvferry.kv_transfer.connectors.multi_stats import MultiKVConnectorStats
from kvferry.kv_transfer.factory import KVConnectorFactory
from tests.helpers.scheduler import FakeWorker, assert_no_leaks, create_request, create_scheduler

MODULE = "tests.kv_transfer.connectors.new_names_connector"


def _child(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "NewNamesConnector",
        "kv_connector_module_path": MODULE,
        "kv_connector_extra_config": {"name": name, **extra},
    }


def _config(kv_connector: str, extra: dict[str, Any]) -> EngineConfig:
    kvt = KVTransferConfig(
        kv_connector=kv_connector, kv_role="kv_both", kv_connector_extra_config=extra
    )
    # What the vLLM config view wraps; the children read only kv_transfer_config.
    parts = {n: SimpleNamespace(max_len=256) for n in _PARTS}
    return cast(EngineConfig, SimpleNamespace(kv_transfer_config=kvt, **parts))


_PARTS = ("model_config", "cache_config", "parallel_config", "scheduler_config", "device_config")


def _kv_cache_config() -> KVCacheConfig:
    return KVCacheConfig(
        64, (KVCacheGroupSpec(("model.layers.0.self_attn",), 16, 1, 8, torch.float32),)
    )


def _multi(role: KVConnectorRole, *children: dict[str, Any]) -> MultiConnector:
    config = _config("MultiConnector", {"connectors": list(children)})
    conn = KVConnectorFactory.create_connector(config, role, _kv_cache_config())
    assert isinstance(conn, MultiConnector)
    return conn


def _faulty(role: KVConnectorRole, inner: dict[str, Any]) -> FaultInjectionConnector:
    conn = KVConnectorFactory.create_connector(
        _config("FaultInjectionConnector", {"inner": inner}), role, _kv_cache_config()
    )
    assert isinstance(conn, FaultInjectionConnector)
    return conn


@pytest.fixture
def calls() -> Any:
    # Loading it by module path first puts kvferry's vllm surface in place.
    KVConnectorFactory.get_connector_class(
        KVTransferConfig.from_dict({"kv_role": "kv_both", **_child("a")})
    )
    from tests.kv_transfer.connectors import new_names_connector as mod  # noqa: PLC0415

    mod.CALLS.clear()
    mod.OBSERVED.clear()
    return mod


def _of(calls: Any, hook: str) -> list[tuple[str, Any]]:
    return [(name, arg) for name, h, arg in calls.CALLS if h == hook]


def _run(conn: Any, hit_tokens: int) -> tuple[Any, dict[str, Any]]:
    s = create_scheduler(connector=conn, log_stats=True)
    worker = FakeWorker(s)
    r = create_request(60, max_tokens=2)
    s.add_request(r)
    outs: dict[str, Any] = {}
    for _ in range(20):
        if not s.has_requests():
            break
        so = s.schedule()
        outs.update(
            {o.request_id: o for o in s.update_from_output(so, worker.execute(so)) if o.finished}
        )
    assert outs[r.request_id].num_external_cached_tokens == hit_tokens
    return s, outs[r.request_id].external_cache_hit_sources


def test_multi_asks_the_serving_child_and_tells_all(calls: Any) -> None:
    conn = _multi(
        KVConnectorRole.SCHEDULER,
        _child("a"),
        _child("b", hit=48, source="disk"),
        _child("c", hit=32),
    )
    s, sources = _run(conn, 48)
    assert sources == {"disk": 48}  # the serving child's tier, not the first child's
    assert [n for n, _ in _of(calls, "on_new_request")] == ["a", "b", "c"]
    assert [n for n, _ in _of(calls, "get_loaded_kv_cache_group_ids")] == ["b"]
    assert _of(calls, "get_external_cache_hit_sources") == [("b", 48)]
    assert _of(calls, "update_state_after_alloc") == [("a", 0), ("b", 48), ("c", 0)]
    assert [n for n, _ in _of(calls, "bind_gpu_block_pool")] == ["a", "b", "c"]
    stats = s.make_stats()
    assert stats is not None and stats.connector_prefix_cache_hits_by_source == {"disk": 48}
    assert not conn._chosen  # forgotten when the request ended
    assert_no_leaks(s)


def test_fault_injection_passes_the_new_hooks_through(calls: Any) -> None:
    conn = _faulty(KVConnectorRole.SCHEDULER, _child("a", hit=32, source="p2p"))
    s, sources = _run(conn, 32)
    assert sources == {"p2p": 32}
    assert [n for n, _ in _of(calls, "on_new_request")] == ["a"]
    assert [n for n, _ in _of(calls, "get_loaded_kv_cache_group_ids")] == ["a"]
    assert [n for n, _ in _of(calls, "bind_gpu_block_pool")] == ["a"]
    assert_no_leaks(s)


def test_any_of_and_handshake_hooks(calls: Any) -> None:
    quiet = _multi(KVConnectorRole.SCHEDULER, _child("a"), _child("b"))
    busy = _multi(KVConnectorRole.SCHEDULER, _child("a"), _child("b", pending=True, delivery=True))
    assert not quiet.has_pending_push_work() and not quiet.has_pending_work()
    assert busy.has_pending_push_work() and busy.has_pending_work()  # older name too
    assert not quiet.requires_kv_delivery and busy.requires_kv_delivery
    r = create_request(20)
    assert busy.register_finished_partial_tail(r, ([1],), [(1, 0, 4)])  # "b" takes it
    busy.set_xfer_handshake_metadata_pp_aware({(0, 0): None, (0, 1): None})  # type: ignore[dict-item]
    assert _of(calls, "set_xfer_handshake_metadata_pp_aware")[-2:] == [
        ("a", [(0, 0), (0, 1)]),
        ("b", [(0, 0), (0, 1)]),
    ]
    faulty = _faulty(KVConnectorRole.SCHEDULER, _child("a", pending=True, delivery=True))
    assert faulty.has_pending_push_work() and faulty.has_pending_work()
    assert faulty.requires_kv_delivery
    assert (
        MultiConnector.get_required_kvcache_layout(
            _config("MultiConnector", {"connectors": [_child("a")]})
        )
        == "NHD"
    )


def _worker_step(conn: Any) -> Any:
    conn.bind_connector_metadata(
        conn.build_connector_meta(SimpleNamespace()) if False else _meta(conn)
    )
    conn.start_load_kv(SimpleNamespace())
    conn.finish_forward()
    conn.wait_for_save()
    results = conn.get_transfer_results(set())
    conn.clear_connector_metadata()
    return results


def _meta(conn: Any) -> Any:
    from kvferry.kv_transfer.base import KVConnectorMetadata  # noqa: PLC0415
    from kvferry.kv_transfer.connectors.fault_injection import FaultInjectionMetadata  # noqa: PLC0415
    from kvferry.kv_transfer.connectors.multi_connector import MultiKVConnectorMetadata  # noqa: PLC0415

    if isinstance(conn, MultiConnector):
        return MultiKVConnectorMetadata(tuple(KVConnectorMetadata() for _ in conn.children))
    return FaultInjectionMetadata(KVConnectorMetadata())


def test_worker_hooks_reach_every_child_and_results_merge(calls: Any) -> None:
    conn = _multi(
        KVConnectorRole.WORKER,
        _child("a", results={"recving": ["r1", "r2"], "failed": ["r2"]}),
        _child("b", results={"sending": ["s1"]}),
    )
    results = _worker_step(conn)
    assert results.finished_recving == {"r1", "r2"} and results.failed_recving == {"r2"}
    assert results.finished_sending == {"s1"}
    assert [n for n, _ in _of(calls, "finish_forward")] == ["a", "b"]
    assert [h for n, h, _ in calls.CALLS if n == "a"] == [
        "start_load_kv", "finish_forward", "wait_for_save", "get_transfer_results",
    ]  # fmt: skip
    faulty = _faulty(
        KVConnectorRole.WORKER, _child("f", results={"recving": ["r3"], "failed": ["r3"]})
    )
    results = _worker_step(faulty)
    assert results.finished_recving == {"r3"} and results.failed_recving == {"r3"}
    assert [n for n, _ in _of(calls, "finish_forward")][-1] == "f"


def test_async_saves_of_several_children_finish_once(calls: Any) -> None:
    sched = _multi(KVConnectorRole.SCHEDULER, _child("a"), _child("b"))
    sched.children[0].request_finished = lambda r, b: (True, None)  # type: ignore[method-assign]
    sched.children[1].request_finished = lambda r, b: (True, None)  # type: ignore[method-assign]
    r = create_request(20)
    assert sched.request_finished(r, [1]) == (True, None)
    worker = _multi(KVConnectorRole.WORKER, _child("a"), _child("b"))
    meta = sched.build_connector_meta(SimpleNamespace())  # type: ignore[arg-type]
    worker.bind_connector_metadata(meta)
    cast(Any, worker.children[0]).results = {"sending": [r.request_id]}
    assert worker.get_transfer_results(set()).finished_sending == set()
    worker.clear_connector_metadata()
    cast(Any, worker.children[1]).results = {"sending": [r.request_id]}
    assert worker.get_transfer_results(set()).finished_sending == {r.request_id}


def test_stats_and_prometheus_per_child(calls: Any) -> None:
    config = _config("MultiConnector", {"connectors": [_child("a"), _child("b")]})
    conn = _multi(KVConnectorRole.WORKER, _child("a"), _child("b"))
    stats = conn.get_kv_connector_stats()
    assert isinstance(stats, MultiKVConnectorStats)
    assert stats.data == {"0.NewNamesConnector.calls": 1, "1.NewNamesConnector.calls": 1}
    # Each child's stats keep their own class's aggregation (max here, not sum).
    again = conn.get_kv_connector_stats()
    assert again is not None
    stats.aggregate(again)
    assert stats.data == {"0.NewNamesConnector.calls": 1, "1.NewNamesConnector.calls": 1}
    assert (
        stats.aggregate(KVConnectorStats({"0.NewNamesConnector.calls": 5})).data[
            "0.NewNamesConnector.calls"
        ]
        == 5
    )
    # Prometheus: each child's part of the flat stats reaches the metrics its class built.
    registry = CollectorRegistry()
    types = {c: _bound_to(c, registry) for c in (Gauge, Counter, Histogram)}
    prom = MultiConnector.build_prom_metrics(
        config, types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    assert prom is not None
    prom.observe({"0.NewNamesConnector.calls": 2, "1.NewNamesConnector.calls": 3}, 0)
    assert calls.OBSERVED == [{"calls": 2}, {"calls": 3}]
    faulty_prom = FaultInjectionConnector.build_prom_metrics(
        _config("FaultInjectionConnector", {"inner": _child("a")}),
        types,
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    assert type(faulty_prom).__name__ == "NewNamesProm"


def test_stats_rebuilt_from_plain_data_by_each_childs_class(
    calls: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        KVConnectorFactory._registry, "NewNamesConnector", (MODULE, "NewNamesConnector")
    )
    built = MultiConnector.build_kv_connector_stats(
        {"0.NewNamesConnector.calls": 1, "1.Unknown.x": [1.0]}
    )
    assert isinstance(built, MultiKVConnectorStats)
    assert type(built.by_child["0.NewNamesConnector"]).__name__ == "NewNamesStats"
    assert type(built.by_child["1.Unknown"]) is KVConnectorStats
    assert built.data == {"0.NewNamesConnector.calls": 1, "1.Unknown.x": [1.0]}
