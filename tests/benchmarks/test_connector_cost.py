"""The connector benchmark's noise-resistant measures: hook timing and paired intervals."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from benchmarks.harness.connector_cost import (
    PROTOCOL_METHODS,
    HookTimer,
    bootstrap_median,
    paired_summary,
    side_cpu_delta,
    side_thread_cpu,
)
from benchmarks.harness.noop_connector import NoOpConnector
from kvferry.kv_transfer.base import KVConnectorRole


class _Nested(NoOpConnector):
    def wait_for_save(self) -> None:
        time.sleep(0.01)
        self.get_finished(set())  # a hook calling another: counted once, as the outer call


def _llm(scheduler: Any, worker: Any) -> Any:
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(connector=scheduler),
        executor=SimpleNamespace(worker=SimpleNamespace(kv_connector=worker)),
    )
    return SimpleNamespace(engine=engine)


def _connector(cls: type[NoOpConnector], role: KVConnectorRole) -> NoOpConnector:
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
    return cls(config, role, None)  # type: ignore[arg-type]


def test_protocol_methods_cover_both_roles_and_layer_hooks():
    for name in ("build_connector_meta", "start_load_kv", "save_kv_layer", "wait_for_save"):
        assert name in PROTOCOL_METHODS
    assert "role" not in PROTOCOL_METHODS  # a property, not a call


def test_hook_timer_counts_outer_calls_of_both_roles_once():
    sched = _connector(NoOpConnector, KVConnectorRole.SCHEDULER)
    worker = _connector(_Nested, KVConnectorRole.WORKER)
    timer = HookTimer(_llm(sched, worker))
    sched.build_connector_meta(None)
    worker.save_kv_layer("layer.0", None, None)
    worker.wait_for_save()
    assert timer.calls == {"build_connector_meta": 1, "save_kv_layer": 1, "wait_for_save": 1}
    assert 0.01 <= timer.seconds["wait_for_save"] <= timer.total


def test_hook_timer_without_connector_times_nothing():
    assert HookTimer(_llm(None, None)).total == 0.0


def test_bootstrap_interval_brackets_the_median():
    losses = [0.01, 0.03, -0.02, 0.02, 0.0, 0.015, 0.05, -0.01]
    s = paired_summary(losses)
    lo, hi = s["ci95"]
    assert lo <= s["median"] <= hi
    assert min(losses) <= lo and hi <= max(losses)
    assert bootstrap_median([0.5]) == (0.5, 0.5)


def test_side_thread_cpu_sees_a_busy_thread():
    before = side_thread_cpu()
    seen: dict[int, float] = {}

    def spin() -> None:
        while time.thread_time() < 0.03:  # CPU, not wall, time: safe on a loaded machine
            pass
        seen.update(side_thread_cpu())  # read while alive: the thread's own clock

    t = threading.Thread(target=spin)
    t.start()
    t.join()
    assert side_cpu_delta(before, seen) >= 0.02
