"""A connector that requires the HND KV layout gets it: the pool is allocated heads-outside-
tokens inside each block and handed out with the logical shape, greedy outputs are
token-identical to an NHD engine and to no connector (native kernels and the torch path
alike), and hits from its files are too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.config import ConfigError
from kvferry.kv_layout import KVCacheLayout, layout_of
from tests.helpers.scheduler import assert_no_leaks

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MODULE = "tests.helpers.layout_connector"


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 512, (50,), generator=g).tolist()
    return [system + torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 21)] + [
        torch.randint(3, 512, (37,), generator=g).tolist()
    ]


PROMPTS = _prompts()


def _kv(name: str, path: Path, module: str | None = MODULE) -> dict:
    kv = {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }
    if module is not None:
        kv["kv_connector_module_path"] = module
    return kv


def _llm(model_dir: Path, kv: dict | None = None) -> LLM:
    args: dict = {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 128}
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model_dir), **args)


def _run(llm: LLM) -> tuple[list[list[int]], int]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    hits = sum(o.metrics.num_external_cached_tokens for o in outs)
    return [o.outputs[0].token_ids for o in outs], hits


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    """Greedy tokens of an engine without a connector, whose pool is NHD."""
    plain = _llm(model_dir)
    assert plain.engine.kv_cache_config.layout is KVCacheLayout.NHD
    tokens = _run(plain)[0]
    assert_no_leaks(plain.engine.scheduler)
    return tokens


@pytest.mark.parametrize("native", ["1", "0"])
def test_hnd_connector_outputs_and_hits_match_nhd(
    model_dir, reference, tmp_path, monkeypatch, native
):
    monkeypatch.setenv("KVFERRY_NATIVE_KERNELS", native)
    first = _llm(model_dir, _kv("HNDExampleConnector", tmp_path / "kv"))
    worker = first.engine.executor.worker
    runner = worker.model_runner
    # The kernels serve the HND pool where they are on; the torch path where they are off.
    kernels = (runner.attn_workspace.decode_kernel, runner.attn_workspace.prefill_kernel)
    assert all(k is not None for k in kernels) == (native == "1")
    assert all(k is None for k in kernels) == (native == "0")
    assert first.engine.kv_cache_config.layout is KVCacheLayout.HND
    registered = worker.kv_connector.registered
    assert registered is not None and registered.keys() == runner.kv_caches.keys()
    g = first.engine.kv_cache_config.groups[0]
    nb, bs, h, d = first.engine.kv_cache_config.num_blocks, g.block_size, g.num_kv_heads, g.head_dim
    assert h > 1  # with one head the two layouts are the same memory
    for name, t in registered.items():
        assert t is runner.kv_caches[name]  # the very tensors attention reads and writes
        assert tuple(t.shape) == (2, nb, bs, h, d)
        assert t.stride() == (nb * bs * h * d, bs * h * d, d, bs * d, 1)
        assert layout_of(t) is KVCacheLayout.HND
        for k in kernels:
            assert k is None or k.supports(t, torch.zeros(1, 2 * h, d))
    tokens, hits = _run(first)
    assert tokens == reference and hits == 0
    assert_no_leaks(first.engine.scheduler)
    first.engine.shutdown()

    # A fresh HND engine, and an NHD one, load the stored prefixes: files hold token rows.
    for name, module in (("HNDExampleConnector", MODULE), ("ExampleConnector", None)):
        again = _llm(model_dir, _kv(name, tmp_path / "kv", module))
        tokens, hits = _run(again)
        assert tokens == reference and hits > 0, name
        assert_no_leaks(again.engine.scheduler)
        again.engine.shutdown()


def test_layout_override_by_environment(model_dir, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFERRY_KV_CACHE_LAYOUT", "hnd")
    llm = _llm(model_dir)
    assert llm.engine.kv_cache_config.layout is KVCacheLayout.HND
    assert layout_of(next(iter(llm.engine.executor.worker.kv_caches.values()))) is (
        KVCacheLayout.HND
    )
    assert _run(llm)[0] == reference
    assert_no_leaks(llm.engine.scheduler)

    monkeypatch.setenv("KVFERRY_KV_CACHE_LAYOUT", "NHD")
    with pytest.raises(ConfigError, match="KVFERRY_KV_CACHE_LAYOUT='NHD'.*requires the 'HND'"):
        _llm(model_dir, _kv("HNDExampleConnector", tmp_path / "kv"))
    monkeypatch.setenv("KVFERRY_KV_CACHE_LAYOUT", "sideways")
    with pytest.raises(ConfigError, match="'sideways' is not a KV cache layout.*'NHD' or 'HND'"):
        _llm(model_dir)


def test_unknown_and_disagreeing_layouts_are_refused(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="OddLayoutConnector requires the 'BLHNC'.*does not"):
        _llm(model_dir, _kv("OddLayoutConnector", tmp_path / "a"))
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                _kv("HNDExampleConnector", tmp_path / "a"),
                _kv("NHDExampleConnector", tmp_path / "b"),
            ]
        },
    }
    with pytest.raises(ConfigError, match="MultiConnector children require different KV layouts"):
        _llm(model_dir, multi)
