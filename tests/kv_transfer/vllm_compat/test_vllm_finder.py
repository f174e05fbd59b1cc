"""The ``vllm`` meta-path finder: same module objects under both names, a clear error for
what is not covered, never shadowing a real vLLM, and vLLM views only for vLLM-style
connectors."""

from __future__ import annotations

import importlib
import sys

import pytest

from kvferry.kv_transfer import vllm_imports
from kvferry.kv_transfer.base import KVConnectorBase


def test_vllm_names_are_kvferry_modules():
    assert vllm_imports.install()
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    from kvferry.core.kv_cache_manager import KVCacheBlocks as Native

    assert vllm.__version__.startswith("0.33")
    assert base is importlib.import_module(
        "kvferry.vllm_compat.distributed.kv_transfer.kv_connector.v1.base"
    )
    assert KVConnectorBase_V1 is KVConnectorBase
    assert KVCacheBlocks is Native


def test_uncovered_module_is_a_clear_import_error():
    assert vllm_imports.install()
    with pytest.raises(ModuleNotFoundError, match="does not cover it") as err:
        importlib.import_module("vllm.model_executor.models")
    assert err.value.name == "vllm.model_executor"  # the first missing package


def test_a_real_vllm_is_never_shadowed(tmp_path, monkeypatch):
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    saved = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}
    vllm_imports.uninstall()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        assert vllm_imports.real_vllm_installed()
        assert not vllm_imports.install()
        import vllm

        assert vllm.REAL
    finally:
        for n in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[n]
        sys.modules.update(saved)
        monkeypatch.undo()
        importlib.invalidate_caches()
    assert vllm_imports.install()


def test_only_vllm_style_connectors_get_views():
    from kvferry.kv_transfer.connectors.example_connector import ExampleConnector

    assert vllm_imports.install()
    from tests.helpers.vllm_style.probe_connector import VllmProbeConnector

    assert vllm_imports.is_vllm_style(VllmProbeConnector)
    assert not vllm_imports.is_vllm_style(ExampleConnector)
    config, kv = object(), object()
    assert vllm_imports.connector_args(ExampleConnector, config, kv) == (config, kv)
