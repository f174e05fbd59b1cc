"""vLLM 0.33's connector base members on kvferry's base class: constructor styles the factory
accepts (and the 2-argument one it refuses), the KV layout request, defaults of the hooks
kvferry cannot apply, the transfer-results and handshake wrappers, the cache-manager binding,
``KVTransferConfig`` helpers, and connector Prometheus metrics on the server's registry."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import Counter

import kvferry
from kvferry.config import ConfigError, EngineConfig, KVTransferConfig
from kvferry.entrypoints.metrics import ServerMetrics
from kvferry.kv_transfer.base import (
    CacheHitSource,
    KVConnectorBase,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorPromMetrics,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorTransferResults,
)
from kvferry.kv_transfer.factory import KVConnectorFactory
from kvferry.outputs import RequestMetrics, RequestOutput
from tests.helpers.scheduler import make_kv_cache_config

_STUBS = """
from kvferry.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata


class _Stub(KVConnectorBase_V1):
    def start_load_kv(self, forward_context, **kwargs): pass
    def wait_for_layer_load(self, layer_name): pass
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): pass
    def wait_for_save(self): pass
    def get_num_new_matched_tokens(self, request, num_computed_tokens): return 0, False
    def update_state_after_alloc(self, request, blocks, num_external_tokens): pass
    def build_connector_meta(self, scheduler_output): return KVConnectorMetadata()
"""


def _config(name: str, module: Path | None = None) -> EngineConfig:
    kvt = KVTransferConfig(
        kv_connector=name,
        kv_role="kv_both",
        kv_connector_module_path=str(module) if module else None,
    )
    return cast(EngineConfig, SimpleNamespace(kv_transfer_config=kvt))


def _module(tmp_path: Path, body: str, name: str = "conn_mod") -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(_STUBS + textwrap.dedent(body))
    return path


def _create(config: EngineConfig) -> KVConnectorBase:
    return KVConnectorFactory.create_connector(
        config, KVConnectorRole.WORKER, make_kv_cache_config(8)
    )


@pytest.mark.parametrize(
    "body",
    [
        # vLLM's documented style, kv_cache_config optional
        """
        class C(_Stub):
            def __init__(self, vllm_config, role, kv_cache_config=None):
                super().__init__(vllm_config, role, kv_cache_config)
        """,
        # keywords all the way down
        """
        class C(_Stub):
            def __init__(self, vllm_config, role, kv_cache_config):
                super().__init__(vllm_config=vllm_config, role=role,
                                 kv_cache_config=kv_cache_config)
        """,
        # pass-through
        """
        class C(_Stub):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
        """,
        # no constructor at all
        """
        class C(_Stub):
            pass
        """,
    ],
    ids=["optional", "keywords", "pass-through", "inherited"],
)
def test_vllm_constructor_styles_are_accepted(tmp_path, body) -> None:
    config = _config("C", _module(tmp_path, body, f"m{abs(hash(body))}"))
    conn = _create(config)
    assert conn._vllm_config is config and conn._config is config
    assert conn._kv_transfer_config is config.kv_transfer_config
    assert conn._kv_cache_config is not None and conn.role == KVConnectorRole.WORKER


def test_kv_cache_config_is_optional_in_the_base() -> None:
    class Plain(KVConnectorBase):
        start_load_kv = wait_for_layer_load = save_kv_layer = wait_for_save = print  # type: ignore[assignment]
        get_num_new_matched_tokens = update_state_after_alloc = print  # type: ignore[assignment]
        build_connector_meta = print  # type: ignore[assignment]

    conn = Plain(_config("Plain"), KVConnectorRole.SCHEDULER)
    assert conn._kv_cache_config is None and conn.get_loaded_kv_cache_group_ids(None) == (0,)  # type: ignore[arg-type]


def test_the_two_argument_constructor_is_refused(tmp_path) -> None:
    body = """
    class Old(_Stub):
        def __init__(self, vllm_config, role):
            super().__init__(vllm_config, role)
    """
    with pytest.raises(ConfigError, match="deprecated 2-argument constructor.*kv_cache_config"):
        _create(_config("Old", _module(tmp_path, body, "old_mod")))


def test_required_kv_layout_is_honoured_or_refused(tmp_path) -> None:
    with pytest.raises(TypeError):
        KVConnectorBase.get_required_kvcache_layout(None)
    body = """
    class Nhd(_Stub):
        @classmethod
        def get_required_kvcache_layout(cls, vllm_config):
            return "NHD"

    class Hnd(_Stub):
        @classmethod
        def get_required_kvcache_layout(cls, vllm_config):
            return "HND"
    """
    path = _module(tmp_path, body, "layout_mod")
    assert _create(_config("Nhd", path)).get_required_kvcache_layout(None) == "NHD"
    with pytest.raises(ConfigError, match="requires the 'HND' KV cache layout.*'NHD'"):
        _create(_config("Hnd", path))


class _Rec(KVConnectorBase_V1):
    start_load_kv = wait_for_layer_load = save_kv_layer = wait_for_save = print  # type: ignore[assignment]
    get_num_new_matched_tokens = update_state_after_alloc = print  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__(_config("Rec"), KVConnectorRole.SCHEDULER, make_kv_cache_config(8))
        self.handshake: dict[int, Any] | None = None
        self.pool: Any = None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def get_finished(self, ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return {"s"} & ids, {"r", "f"}

    def get_failed_recving(self) -> set[str]:
        return {"f"}

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.handshake = metadata

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.pool = gpu_block_pool


def test_get_transfer_results_wraps_get_finished() -> None:
    assert _Rec().get_transfer_results({"s", "x"}) == KVConnectorTransferResults(
        finished_sending={"s"}, finished_recving={"r", "f"}, failed_recving={"f"}
    )


def test_pp_aware_handshake_unwraps_to_ranks() -> None:
    conn, meta = _Rec(), KVConnectorHandshakeMetadata()
    conn.set_xfer_handshake_metadata_pp_aware({(0, 0): meta, (0, 1): meta})
    assert conn.handshake == {0: meta, 1: meta}
    with pytest.raises(ValueError, match="pipeline rank"):
        conn.set_xfer_handshake_metadata_pp_aware({(1, 0): meta})


def test_binding_the_cache_manager_binds_the_block_pool() -> None:
    conn, manager = _Rec(), object()
    conn.bind_kv_cache_manager(manager)  # type: ignore[arg-type]
    assert conn._kv_cache_manager is manager and conn.pool is manager


def test_defaults_of_hooks_kvferry_does_not_apply() -> None:
    conn = _Rec()
    assert _Rec.supports_sleep_mode(conn._kv_transfer_config) is True
    assert conn.get_mem_pool_context() is None
    assert conn.register_finished_partial_tail(None, ([],), [(0, 0, 0)]) is False  # type: ignore[arg-type]
    assert conn.supports_divergent_local_hybrid_hits is False
    assert _Rec.requires_piecewise_for_cudagraph({}) is False
    assert _Rec.build_kv_connector_stats({"a": 1}) is None
    assert _Rec.build_prom_metrics(None, {}, [], {}) is None
    assert _Rec.get_required_kvcache_layout(None) is None
    conn.unregister_kv_caches(), conn.restore_kv_caches(), conn.reset_capture_state()
    conn.finish_forward(), conn.on_new_request(None)  # type: ignore[func-returns-value, arg-type]
    assert conn.get_external_cache_hit_sources(None, 0) == {}  # type: ignore[arg-type]
    assert conn.get_external_cache_hit_sources(None, 5) == {  # type: ignore[arg-type]
        CacheHitSource.EXTERNAL_UNSPECIFIED: 5
    }
    assert CacheHitSource.outermost([CacheHitSource.HOST, CacheHitSource.DISK]) is (
        CacheHitSource.DISK
    )
    assert KVConnectorStats({"x": 1}).to_dict() == {"x": 1}


def test_kv_transfer_config_helpers() -> None:
    assert kvferry.KVTransferConfig is KVTransferConfig
    multi = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "NixlConnector"},
                {
                    "kv_connector": "MultiConnector",
                    "kv_connector_extra_config": {
                        "connectors": [{"kv_connector": "OffloadingConnector"}]
                    },
                },
            ]
        },
    )
    assert multi.has_connector("MultiConnector") and multi.has_connector("NixlConnector")
    assert multi.has_connector("OffloadingConnector") and not multi.has_connector("Example")
    plain = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    assert plain.has_connector("ExampleConnector") and not plain.has_connector("Nixl")
    assert len(plain.compute_hash()) == 64 and plain.compute_hash() == multi.compute_hash()


def test_request_output_counts_cached_tokens() -> None:
    m = RequestMetrics(arrival_time=0.0, num_local_cached_tokens=16, num_external_cached_tokens=32)
    assert m.num_cached_tokens == 48
    assert RequestOutput("r", None, [1], [], False).num_cached_tokens is None


class _XferMetrics(KVConnectorPromMetrics):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        counter = self._counter_cls(
            name="vllm:test_connector_bytes",
            documentation="bytes moved",
            labelnames=self._labelnames,
        )
        self.bytes = {i: counter.labels(*v) for i, v in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.bytes[engine_idx].inc(transfer_stats_data.get("bytes", 0))


def test_connector_prom_metrics_land_on_the_server_registry(tmp_path, monkeypatch) -> None:
    body = """
    from tests.kv_transfer.test_base_v033 import _XferMetrics

    class WithProm(_Stub):
        @classmethod
        def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine):
            return _XferMetrics(vllm_config, metric_types, labelnames, per_engine)
    """
    config = _config("WithProm", _module(tmp_path, body, "prom_mod"))
    metrics = ServerMetrics("m", config)
    metrics.record_kv_connector_stats({"bytes": 5})
    metrics.record_kv_connector_stats({"bytes": 2})
    out = metrics.render().decode()
    assert 'vllm:test_connector_bytes_total{engine="0",model_name="m"} 7.0' in out
    # Two servers in one process keep their own series (no global registry).
    assert "test_connector_bytes" in ServerMetrics("n", config).render().decode()
    assert isinstance(metrics.connector_prom, _XferMetrics)
    assert Counter in metrics.connector_prom._counter_cls.__mro__


def test_cache_hit_sources_in_prometheus() -> None:
    metrics = ServerMetrics("m")
    m = RequestMetrics(
        arrival_time=0.0,
        num_local_cached_tokens=16,
        num_external_cached_tokens=32,
        external_cache_hit_sources={"host": 16, "disk": 16},
    )
    metrics.record_finished(RequestOutput("r", None, [1] * 60, [], True, metrics=m))
    out = metrics.render().decode()
    for source, n in (("device", 16), ("host", 16), ("disk", 16)):
        line = f'vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="m",source="{source}"}}'
        assert f"{line} {float(n)}" in out
