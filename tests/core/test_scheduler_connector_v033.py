"""vLLM 0.33's scheduler-side hooks, driven step by step through the real scheduler:
``on_new_request``, ``get_loaded_kv_cache_group_ids``, ``get_external_cache_hit_sources``,
``has_pending_push_work`` (and its older name), ``build_kv_connector_stats`` and
``requires_kv_delivery``. Every lifecycle test ends with a leak check."""

from __future__ import annotations

from typing import Any

import pytest

from kvferry.kv_transfer.base import CacheHitSource, KVConnectorBase, KVConnectorStats
from kvferry.request import Request
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from tests.helpers.scheduler import (
    FakeWorker,
    assert_no_leaks,
    create_request,
    create_scheduler,
    drive,
    step,
)
from tests.helpers.scripted_connector import ScriptedConnector
from tests.helpers.transfer_sim import TransferSim


class V033Connector(ScriptedConnector):
    """The scripted connector with vLLM 0.33's hooks recorded in one call log."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.loaded_groups: tuple[int, ...] | None = None
        self.sources: dict[Any, int] | None = None
        self.refuse: set[str] = set()
        self.stats_built: list[dict[str, Any]] = []

    def on_new_request(self, request: Request) -> None:
        self.calls.append(("on_new_request", request.request_id))
        if request.request_id in self.refuse:
            raise RuntimeError("no state for this one")

    def get_num_new_matched_tokens(self, request: Request, n: int) -> tuple[int | None, bool]:
        self.calls.append(("get_num_new_matched_tokens", request.request_id))
        return super().get_num_new_matched_tokens(request, n)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        self.calls.append(("get_loaded_kv_cache_group_ids", request.request_id))
        if self.loaded_groups is not None:
            return self.loaded_groups
        return super().get_loaded_kv_cache_group_ids(request)

    def update_state_after_alloc(self, request: Request, blocks: Any, n: int) -> None:
        self.calls.append(("update_state_after_alloc", request.request_id))
        super().update_state_after_alloc(request, blocks, n)

    def get_external_cache_hit_sources(self, request: Request, n: int) -> dict[Any, int]:
        self.calls.append(("get_external_cache_hit_sources", request.request_id))
        if self.sources is not None:
            return self.sources
        return super().get_external_cache_hit_sources(request, n)

    def build_kv_connector_stats(self, data: dict[str, Any] | None = None) -> KVConnectorStats:  # type: ignore[override]
        self.stats_built.append(dict(data or {}))
        return KVConnectorStats({f"rebuilt_{k}": v for k, v in (data or {}).items()})


def _setup() -> tuple[Any, V033Connector, FakeWorker]:
    conn = V033Connector()
    s = create_scheduler(connector=conn, log_stats=True)
    return s, conn, FakeWorker(s)


def test_on_new_request_comes_first_and_once() -> None:
    s, conn, worker = _setup()
    a = create_request(40, max_tokens=2)
    s.add_request(a)
    assert conn.calls == [("on_new_request", a.request_id)]
    drive(s, worker, TransferSim(conn))
    assert [c for c in conn.calls if c[0] == "on_new_request"] == [("on_new_request", a.request_id)]
    assert conn.calls.index(("on_new_request", a.request_id)) < conn.calls.index(
        ("get_num_new_matched_tokens", a.request_id)
    )
    assert_no_leaks(s)


def test_on_new_request_that_raises_refuses_the_request() -> None:
    s, conn, worker = _setup()
    a = create_request(40, max_tokens=2)
    conn.refuse.add(a.request_id)
    with pytest.raises(ValueError, match="on_new_request"):
        s.add_request(a)
    assert a.request_id not in s.requests and not s.has_requests()
    b = create_request(40, max_tokens=2)
    s.add_request(b)
    drive(s, worker, TransferSim(conn))
    assert_no_leaks(s)


def test_hit_sources_reach_the_output_and_the_stats() -> None:
    s, conn, worker = _setup()
    a, b = create_request(60, max_tokens=2), create_request(60, max_tokens=2)
    conn.external[a.request_id] = (48, False)
    s.add_request(a)
    outs = drive(s, worker, TransferSim(conn))
    order = [c[0] for c in conn.calls if c[1] == a.request_id]
    assert order.index("get_loaded_kv_cache_group_ids") < order.index("update_state_after_alloc")
    assert order.index("update_state_after_alloc") < order.index("get_external_cache_hit_sources")
    assert outs[a.request_id].external_cache_hit_sources == {"host": 48}
    # A split that does not add up is counted as unspecified.
    conn.external[b.request_id] = (48, False)
    conn.sources = {CacheHitSource.HOST: 16, CacheHitSource.DISK: 16}
    s.add_request(b)
    outs = drive(s, worker, TransferSim(conn))
    assert outs[b.request_id].external_cache_hit_sources == {"external_unspecified": 48}
    stats = s.make_stats()
    assert stats is not None
    assert stats.connector_prefix_cache_hits_by_source == {"host": 48, "external_unspecified": 48}
    assert_no_leaks(s)


def test_no_hit_sources_asked_without_external_tokens() -> None:
    s, conn, worker = _setup()
    a = create_request(40, max_tokens=2)
    s.add_request(a)
    outs = drive(s, worker, TransferSim(conn))
    assert "get_external_cache_hit_sources" not in {c[0] for c in conn.calls}
    assert "get_loaded_kv_cache_group_ids" not in {c[0] for c in conn.calls}
    assert outs[a.request_id].external_cache_hit_sources == {}
    assert_no_leaks(s)


def test_a_load_that_skips_a_kv_group_is_not_used() -> None:
    s, conn, worker = _setup()
    a = create_request(60, max_tokens=2)
    conn.external[a.request_id] = (48, True)
    conn.loaded_groups = ()
    s.add_request(a)
    outs = drive(s, worker, TransferSim(conn))
    assert conn.allocs[0][2] == 0 and not conn.async_started
    assert outs[a.request_id].num_external_cached_tokens == 0
    assert_no_leaks(s)


class _PushOnly(ScriptedConnector):
    def has_pending_push_work(self) -> bool:
        return self.pending_work


def test_has_pending_push_work_keeps_the_engine_stepping() -> None:
    conn = _PushOnly()
    s = create_scheduler(connector=conn)
    assert not s.has_unfinished_requests()
    conn.pending_work = True
    assert s.has_unfinished_requests()
    assert conn.has_pending_work()  # the older name answers through the override
    conn.pending_work = False
    assert not s.has_unfinished_requests()
    assert_no_leaks(s)


def test_has_pending_work_override_is_called_under_the_vllm_name() -> None:
    conn = ScriptedConnector()  # overrides the older name only
    s = create_scheduler(connector=conn)
    conn.pending_work = True
    assert conn.has_pending_push_work() and s.has_unfinished_requests()
    conn.pending_work = False
    assert not s.has_unfinished_requests()


class _SuperCaller(ScriptedConnector):
    def has_pending_work(self) -> bool:
        return super(ScriptedConnector, self).has_pending_work() or self.pending_work


def test_alias_defaults_do_not_recurse() -> None:
    conn = _SuperCaller()
    assert not conn.has_pending_push_work() and not conn.has_pending_work()
    conn.pending_work = True
    assert conn.has_pending_push_work()


def test_stats_sent_as_plain_data_are_rebuilt_by_the_connector_class() -> None:
    s, conn, worker = _setup()
    step(s, worker, kv_output=KVConnectorOutput(kv_connector_stats={"bytes": 7}))
    assert conn.stats_built == [{"bytes": 7}]
    stats = s.take_kv_connector_stats()
    assert stats is not None and stats.data == {"rebuilt_bytes": 7}
    assert_no_leaks(s)


def test_requires_kv_delivery_follows_the_producer_role() -> None:
    s, conn, _ = _setup()
    assert conn.requires_kv_delivery and s.requires_kv_delivery  # kv_both produces
    consumer = ScriptedConnector()
    consumer._kv_transfer_config.kv_role = "kv_consumer"
    assert not consumer.requires_kv_delivery
    assert not create_scheduler(connector=consumer).requires_kv_delivery
    assert isinstance(conn, KVConnectorBase)


class _CountsOnUpdate(ScriptedConnector):
    """Counts, in ``update_connector_output``, what the step's output reports (as a store
    connector counts the stores its workers finished)."""

    def __init__(self) -> None:
        super().__init__()
        self.counted = 0

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        self.counted += 1

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        counted, self.counted = self.counted, 0
        return KVConnectorStats(data={"counted": counted}) if counted else None


def test_what_the_output_update_counts_is_in_the_same_steps_stats() -> None:
    # The last step of a run may be the one whose output reports the work done: its count
    # must not wait for a further step, which an idle engine never takes.
    conn = _CountsOnUpdate()
    s = create_scheduler(connector=conn)
    worker = FakeWorker(s)
    step(s, worker, kv_output=KVConnectorOutput())
    stats = s.take_kv_connector_stats()
    assert stats is not None and stats.data == {"counted": 1}
    assert_no_leaks(s)
