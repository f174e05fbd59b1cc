"""vLLM's layout helpers (``vllm.v1.attention.backends.utils``) answer the layout the engine
really allocated, as a connector loaded by ``kv_connector_module_path`` sees it in both
roles and at ``register_kv_caches``: the connector's requirement (vLLM 0.33's LBNHC / LBHNC
taken as NHD / HND), or the environment's; other vLLM 0.33 names are refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry import LLM
from kvferry import kv_layout as kv_layout_module
from kvferry.config import ConfigError
from kvferry.kv_layout import KVCacheLayout
from kvferry.kv_transfer import vllm_imports

MODULE = "tests.helpers.vllm_style.layout_connector"


def _llm(model_dir: Path, layout: str | None) -> LLM:
    extra = {} if layout is None else {"layout": layout}
    kv = {
        "kv_connector": "VllmLayoutConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": MODULE,
        "kv_connector_extra_config": extra,
    }
    return LLM(model=str(model_dir), dtype="float32", max_model_len=64, kv_transfer_config=kv)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture
def utils():
    vllm_imports.install()
    from vllm.v1.attention.backends import utils

    yield utils
    utils.set_kv_cache_layout(None)


@pytest.mark.parametrize(
    ("required", "env", "expected"),
    [
        (None, None, "NHD"),
        ("HND", None, "HND"),
        ("LBHNC", None, "HND"),
        ("LBNHC", None, "NHD"),
        (None, "hnd", "HND"),
        ("lbhnc", "HND", "HND"),  # the override agrees with the (aliased) requirement
    ],
)
def test_connector_sees_the_allocated_layout(model_dir, monkeypatch, required, env, expected):
    if env is None:
        monkeypatch.delenv("KVFERRY_KV_CACHE_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("KVFERRY_KV_CACHE_LAYOUT", env)
    vllm_imports.install()  # the connector module imports vllm.*
    from tests.helpers.vllm_style import layout_connector

    layout_connector.SEEN.clear()
    llm = _llm(model_dir, required)
    try:
        assert llm.engine.kv_cache_config.layout is KVCacheLayout(expected)
        seen = layout_connector.SEEN
        roles = sorted(str(s["role"]) for s in seen if s["hook"] == "init")
        assert len(roles) == 2 and roles[0] != roles[1]  # the scheduler and the worker side
        assert [s["layout"] for s in seen] == [expected] * 3
        (reg,) = [s for s in seen if s["hook"] == "register"]
        _, nb, bs, h, d = reg["shape"]
        # The strides the connector is handed are those of the layout it was told.
        heads_outer = (nb * bs * h * d, bs * h * d, d, bs * d, 1)
        tokens_outer = (nb * bs * h * d, bs * h * d, h * d, d, 1)
        assert reg["stride"] == (heads_outer if expected == "HND" else tokens_outer)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name", ["BLHNC", "BLNHC", "BHLNC", "LHBNC"])
def test_other_vllm_033_layouts_are_refused_with_what_is_supported(model_dir, name):
    with pytest.raises(
        ConfigError,
        match=rf"VllmLayoutConnector requires the '{name}' KV cache layout, which kvferry does "
        r"not allocate; it allocates 'NHD' or 'HND'; vLLM 0.33's LBNHC \(= NHD\), "
        r"LBHNC \(= HND\)",
    ):
        _llm(model_dir, name)


def test_set_kv_cache_layout_cannot_change_the_running_pool(model_dir, monkeypatch, utils):
    monkeypatch.delenv("KVFERRY_KV_CACHE_LAYOUT", raising=False)
    llm = _llm(model_dir, "HND")
    try:
        utils.set_kv_cache_layout("HND")  # what it is: accepted
        utils.set_kv_cache_layout("LBHNC")
        assert utils.get_kv_cache_layout() == "HND"
        with pytest.raises(ValueError, match="already allocated in 'HND'"):
            utils.set_kv_cache_layout("NHD")
        with pytest.raises(ValueError, match="'sideways' is not a KV cache layout"):
            utils.set_kv_cache_layout("sideways")
        assert utils.get_kv_cache_layout() == "HND"
    finally:
        llm.engine.shutdown()


def test_before_an_engine_starts(monkeypatch, utils):
    monkeypatch.setattr(kv_layout_module, "_engine_layout", None)
    monkeypatch.delenv("KVFERRY_KV_CACHE_LAYOUT", raising=False)
    assert utils.get_kv_cache_layout() == "NHD"
    monkeypatch.setenv("KVFERRY_KV_CACHE_LAYOUT", "HND")
    assert utils.get_kv_cache_layout() == "HND"  # the environment's choice
    utils.set_kv_cache_layout("LBNHC")
    assert utils.get_kv_cache_layout() == "NHD"  # pinned
    assert utils.is_valid_kv_cache_layout("HND") and not utils.is_valid_kv_cache_layout("hnd")
    assert not utils.is_valid_kv_cache_layout("LBHNC")
