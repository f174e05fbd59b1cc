"""vLLM's metric names on ``/metrics``: every ``vllm:`` series kvferry exports exists in vLLM
0.32 (its ``vllm/v1/metrics/loggers.py`` from the published wheel) with the same type and
labels, per-step metrics (tokens per step, inter-token latency) come from the engine thread,
the KV event publisher's counters are exported, and every series vLLM's example Grafana
dashboard queries is on a real server's page after a few requests."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvferry.entrypoints.metrics import ServerMetrics
from kvferry.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tests.helpers import vllm_wheel
from tests.helpers.servers import serving

# Every series that examples/observability/prometheus_grafana/grafana.json (vLLM's example
# dashboard) queries, plus the headline panels of examples/observability/dashboards/grafana/
# vllm_kv_cache.json.
GRAFANA_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
    # vllm_kv_cache.json
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:num_preemptions_total",
    "vllm:num_requests_waiting_by_reason",
]
_TYPES = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}


def _vllm_series() -> dict[str, str]:
    """``{name: type}`` of the series vLLM's PrometheusStatLogger creates."""
    try:
        src = vllm_wheel.extract("vllm/v1/metrics/loggers.py") / "vllm/v1/metrics/loggers.py"
    except RuntimeError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    text = src.read_text()
    found = re.findall(
        r"self\.(_gauge_cls|_counter_cls|_histogram_cls)\(\s*name=\"(vllm:\w+)\"", text
    )
    assert len(found) > 30, "vLLM's loggers.py changed shape"
    return {name: _TYPES[cls] for cls, name in found}


def _output(rid: str, n_prompt: int, n_out: int, t0: float, **metrics) -> RequestOutput:
    m = RequestMetrics(
        arrival_time=t0,
        first_scheduled_time=t0 + 0.1,
        first_token_time=t0 + 0.3,
        finished_time=t0 + 1.3,
        num_prompt_tokens=n_prompt,
        max_tokens_param=n_out,
        **metrics,
    )
    done = CompletionOutput(0, "x", [7] * n_out, "length")
    return RequestOutput(rid, None, [1] * n_prompt, [done], True, metrics=m)


def _families(metrics: ServerMetrics) -> dict[str, tuple[str, set[str]]]:
    """``{name: (type, label names)}`` of the page."""
    out: dict[str, tuple[str, set[str]]] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        labels = {k for s in fam.samples for k in s.labels if k != "le" and k != "quantile"}
        if fam.samples:  # a labelled family shows only once a label set was used
            out[fam.name] = (fam.type, labels)
    return out


def _snapshot() -> SimpleNamespace:
    s = SimpleNamespace(
        num_running_reqs=2,
        num_waiting_reqs=3,
        num_waiting_for_remote_kvs=1,
        num_held_by_connector=0,
        kv_cache_usage=0.25,
        num_preemptions=4,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        prefix_cache_hit_rate=0.4,
        connector_prefix_cache_queries=60,
        connector_prefix_cache_hits=30,
    )
    return SimpleNamespace(scheduler=s, num_streams=5)


def test_vllm_series_match_vllm_names_types_and_labels() -> None:
    vllm = _vllm_series()
    metrics = ServerMetrics("m")
    metrics.attach(_snapshot, 4096.0)  # type: ignore[arg-type, return-value]
    metrics.record_finished(
        _output("a", 40, 5, 100.0, num_local_cached_tokens=16, num_external_cached_tokens=16)
    )
    families = _families(metrics)
    ours = {n: v for n, v in families.items() if n.startswith("vllm:")}
    assert len(ours) >= 30
    for name, (kind, labels) in ours.items():
        assert name in vllm, f"{name} is not a vLLM 0.32 series"
        assert kind == vllm[name], f"{name}: {kind}, vLLM has a {vllm[name]}"
        assert {"model_name", "engine"} <= labels, name
    for name, (_, labels) in families.items():
        assert name.startswith(("vllm:", "kvferry_")), name
        assert {"model_name", "engine"} <= labels, name
    # kvferry no longer duplicates what vLLM names.
    for name in families:
        assert f"vllm:{name.removeprefix('kvferry_')}" not in ours, name


def test_request_values_follow_vllm_definitions() -> None:
    metrics = ServerMetrics("m")
    metrics.record_finished(
        _output(
            "a",
            40,
            5,
            100.0,
            num_local_cached_tokens=16,
            num_external_cached_tokens=8,
            external_cache_hit_sources={"host": 8},
            num_preemptions=2,
        )
    )
    metrics.record_ended("abort")
    page = {
        (
            s.name,
            tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))),
        ): s.value
        for fam in text_string_to_metric_families(metrics.render().decode())
        for s in fam.samples
    }
    assert page[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert page[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1
    assert page[("vllm:prompt_tokens_total", ())] == 40
    by_source = "vllm:prompt_tokens_by_source_total"
    assert page[(by_source, (("source", "local_compute"),))] == 16
    assert page[(by_source, (("source", "local_cache_hit"),))] == 16
    assert page[(by_source, (("source", "external_kv_transfer"),))] == 8
    assert page[("vllm:prompt_tokens_cached_total", ())] == 24
    tiers = "vllm:prompt_tokens_cached_by_source_total"
    assert page[(tiers, (("source", "device"),))] == 16
    assert page[(tiers, (("source", "host"),))] == 8
    assert page[("vllm:request_queue_time_seconds_sum", ())] == pytest.approx(0.1)
    assert page[("vllm:request_prefill_time_seconds_sum", ())] == pytest.approx(0.2)
    assert page[("vllm:request_decode_time_seconds_sum", ())] == pytest.approx(1.0)
    assert page[("vllm:request_inference_time_seconds_sum", ())] == pytest.approx(1.2)
    assert page[("vllm:e2e_request_latency_seconds_sum", ())] == pytest.approx(1.3)
    assert page[("vllm:time_to_first_token_seconds_sum", ())] == pytest.approx(0.3)
    assert page[("vllm:request_time_per_output_token_seconds_sum", ())] == pytest.approx(0.25)
    assert page[("vllm:request_num_preemptions_sum", ())] == 2
    assert page[("vllm:request_prefill_kv_computed_tokens_sum", ())] == 16
    assert page[("vllm:request_params_max_tokens_sum", ())] == 5


def test_record_step_gives_iteration_tokens_and_inter_token_latency(monkeypatch) -> None:
    import kvferry.entrypoints.metrics as mod

    metrics = ServerMetrics("m")
    clock = iter([10.0, 10.5, 11.25, 12.0])
    monkeypatch.setattr(mod.time, "time", lambda: next(clock))

    def out(rid: str, n: int, finished: bool = False) -> RequestOutput:
        return RequestOutput(rid, None, [1], [CompletionOutput(0, "", [7] * n, None)], finished)

    metrics.record_step([out("a", 1)], 17, {"a"})  # prefill: the first token, no interval
    metrics.record_step([out("a", 2), out("b", 1)], 18, {"a", "b"})
    metrics.record_step([out("a", 3, finished=True)], 2, {"b"})
    metrics.record_step([out("b", 1)], 0, {"b"})  # no new token for b: no interval
    text = metrics.render().decode()
    assert 'vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 37.0' in text
    assert 'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 4.0' in text
    assert 'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 2.0' in text
    assert 'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1.25' in text
    assert set(metrics._last_token) == {"b"}  # finished requests are forgotten


def test_kv_event_publisher_counters() -> None:
    metrics = ServerMetrics("m")
    stats = SimpleNamespace(published=7, dropped=2, queued=1)
    metrics.attach(lambda: None, 0.0, lambda: stats)
    text = metrics.render().decode()
    assert 'kvferry_kv_events_published_batches_total{engine="0",model_name="m"} 7.0' in text
    assert 'kvferry_kv_events_dropped_batches_total{engine="0",model_name="m"} 2.0' in text
    assert 'kvferry_kv_events_queued_batches{engine="0",model_name="m"} 1.0' in text
    assert "kvferry_kv_events" not in ServerMetrics("m").render().decode()


def test_grafana_dashboard_series_exist(tiny_model_factory, tmp_path) -> None:
    with serving("vllm-metrics", tiny_model_factory("llama"), tmp_path) as inst:
        body = {"prompt": "The ferry crossed the river", "max_tokens": 6, "ignore_eos": True}
        for _ in range(3):
            assert (
                httpx.post(inst.url + "/v1/completions", json=body, timeout=60).status_code == 200
            )
        text = httpx.get(inst.url + "/metrics", timeout=10).text
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    missing = [n for n in GRAFANA_SERIES if n not in names]
    assert not missing, missing
    assert (
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 3.0'
        in text
    )
    assert "kvferry_num_requests_running" not in text  # renamed, not duplicated
