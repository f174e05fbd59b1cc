"""FaultInjectionConnector around ExampleConnector and OffloadingConnector, end to end with a
tiny model: failed loads follow kv_load_failure_policy ("fail" ends exactly the affected
requests with finish reason error, "recompute" gives token-identical outputs), corrupt loads
recompute to identical outputs, delays change nothing but time, lost stores make later loads
fail and recompute, and no block leaks anywhere."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvferry import LLM, SamplingParams
from kvferry.config import ConfigError, EngineConfig, KVTransferConfig
from kvferry.entrypoints.metrics import ServerMetrics
from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.fault_injection import (
    FaultInjectionConnector,
    InjectedFault,
)
from kvferry.kv_transfer.factory import KVConnectorFactory
from tests.helpers.scheduler import create_request

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FAULT = "FaultInjectionConnector"


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    system = torch.randint(3, 512, (48,), generator=g).tolist()
    tails = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 20)]
    lone = [torch.randint(3, 512, (40,), generator=g).tolist() for _ in range(2)]
    return [system + t for t in tails] + lone


PROMPTS = _prompts()


def _llm(model_dir: Path, kv: dict | None = None, **kw: Any) -> LLM:
    args: dict[str, Any] = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 24}
    args.update(kw)
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model_dir), **args)


def _run(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def _drain_and_check(llm: LLM) -> dict[str, Any]:
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    sched = engine.scheduler
    sched.kv_cache_manager.check_integrity()
    assert sched.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_config.num_blocks
    assert not sched.requests
    connector = sched.connector
    inner = getattr(connector, "inner", None)
    if inner is not None and hasattr(inner, "check_offload_integrity"):
        inner.check_offload_integrity(idle=True)
    stats = dict(engine.kv_connector_totals.as_dict())
    engine.shutdown()
    return stats


def _inner(kind: str, folder: Path) -> dict[str, Any]:
    if kind == "example":
        extra: dict[str, Any] = {"shared_storage_path": str(folder)}
        return {"kv_connector": "ExampleConnector", "kv_connector_extra_config": extra}
    extra = {"num_cpu_chunks": 8, "disk_path": str(folder)}
    return {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}


def _faulty(inner: dict[str, Any], policy: str, **faults: Any) -> dict[str, Any]:
    return {
        "kv_connector": FAULT,
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"inner": inner, **faults},
    }


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in _run(_llm(model_dir))]


@pytest.fixture(scope="module")
def stores(model_dir, tmp_path_factory) -> dict[str, Path]:
    """A folder of each inner connector filled by a clean run (through the wrapper, no
    faults), so a fresh engine on it loads every prompt's prefix from the connector."""
    out = {}
    for kind in ("example", "offload"):
        folder = tmp_path_factory.mktemp(kind)
        llm = _llm(model_dir, _faulty(_inner(kind, folder), "fail"))
        _run(llm)
        _drain_and_check(llm)
        out[kind] = folder
    return out


def _prompt_tokens_by_source(outs: list[Any]) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source`` as the server would publish it for ``outs``."""
    metrics = ServerMetrics("tiny")
    for out in outs:
        metrics.record_finished(out)
    (family,) = [
        f
        for f in text_string_to_metric_families(metrics.render().decode())
        if f.name == "vllm:prompt_tokens_by_source"
    ]
    return {s.labels["source"]: s.value for s in family.samples if s.name.endswith("_total")}


def _worker(llm: LLM) -> FaultInjectionConnector:
    connector = llm.engine.executor.worker.kv_connector
    assert isinstance(connector, FaultInjectionConnector)
    return connector


@pytest.mark.parametrize("kind", ["example", "offload"])
@pytest.mark.parametrize("fault", ["fail_loads", "corrupt_loads"])
def test_bad_loads_recompute_to_identical_outputs(model_dir, reference, stores, kind, fault):
    llm = _llm(model_dir, _faulty(_inner(kind, stores[kind]), "recompute", **{fault: [0, 2]}))
    outs = _run(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    sabotaged = _worker(llm).sabotaged_req_ids
    assert len(sabotaged) == 2
    # The sabotaged loads' tokens were computed here: no request counts them as transferred.
    for o in outs:
        if o.request_id in sabotaged:
            assert o.metrics.num_external_cached_tokens == 0 and o.num_cached_tokens == 0
    by_source = _prompt_tokens_by_source(outs)
    external = sum(o.metrics.num_external_cached_tokens for o in outs)
    assert 0 < by_source["external_kv_transfer"] == external
    assert sum(by_source.values()) == sum(len(p) for p in PROMPTS)
    stats = _drain_and_check(llm)
    assert stats[f"injected_{'failed' if fault == 'fail_loads' else 'corrupted'}_loads"] == 2


@pytest.mark.parametrize("kind", ["example", "offload"])
@pytest.mark.parametrize("fault", ["fail_loads", "corrupt_loads"])
def test_bad_loads_fail_exactly_the_affected_requests(model_dir, reference, stores, kind, fault):
    llm = _llm(model_dir, _faulty(_inner(kind, stores[kind]), "fail", **{fault: [1]}))
    outs = _run(llm)
    (bad,) = _worker(llm).sabotaged_req_ids
    for out, ref in zip(outs, reference, strict=True):
        if out.request_id == bad:
            assert out.outputs[0].finish_reason == "error" and out.error
        else:
            assert out.outputs[0].finish_reason == "length"
            assert list(out.outputs[0].token_ids) == ref
    _drain_and_check(llm)


@pytest.mark.parametrize("kind", ["example", "offload"])
def test_delayed_loads_and_stores_change_only_the_time(model_dir, reference, stores, kind):
    kv = _faulty(
        _inner(kind, stores[kind]),
        "fail",
        delay_loads_s=0.15,
        delay_loads=[0],
        delay_stores_s=0.05,
        delay_stores=[0],
    )
    llm = _llm(model_dir, kv)
    t0 = time.monotonic()
    outs = _run(llm)
    assert time.monotonic() - t0 >= 0.15
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    stats = _drain_and_check(llm)
    external = sum(o.metrics.num_external_cached_tokens for o in outs)
    assert external > 0
    assert stats.get("injected_delayed_loads", 0) >= 1


@pytest.mark.slow
def test_lost_stores_make_later_loads_fail_and_recompute(model_dir, reference, tmp_path):
    """Every store is lost: the later loads of this engine (from the host tier, the pool being
    too small to keep the prefixes) all fail, and recompute to identical outputs."""
    inner = {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"num_cpu_chunks": 64},
    }
    llm = _llm(model_dir, _faulty(inner, "recompute", fail_store_rate=1.0), num_kv_blocks=10)
    for _ in range(2):
        for prompt, ref in zip(PROMPTS, reference, strict=True):
            (out,) = _run(llm, [prompt])
            assert list(out.outputs[0].token_ids) == ref
    assert len(_worker(llm).sabotaged_req_ids) > 0
    stats = _drain_and_check(llm)
    assert stats["injected_failed_loads"] == len(_worker(llm).sabotaged_req_ids)


# -- options and hooks ----------------------------------------------------------------------


def _connector(role: KVConnectorRole, tmp_path: Path, **extra: Any) -> FaultInjectionConnector:
    kvt = KVTransferConfig(
        kv_connector=FAULT,
        kv_role="kv_both",
        kv_connector_extra_config={"inner": _inner("example", tmp_path), **extra},
    )
    config = cast(EngineConfig, SimpleNamespace(kv_transfer_config=kvt))
    group = KVCacheGroupSpec(("l0",), 16, 1, 4, torch.float32)
    conn = KVConnectorFactory.create_connector(config, role, KVCacheConfig(8, (group,)))
    assert isinstance(conn, FaultInjectionConnector)
    return conn


def test_raise_in_raises_from_the_chosen_calls(tmp_path: Path) -> None:
    conn = _connector(
        KVConnectorRole.SCHEDULER,
        tmp_path,
        raise_in="get_num_new_matched_tokens",
        raise_calls=[1],
    )
    r = create_request(40)
    assert conn.get_num_new_matched_tokens(r, 0) == (0, False)
    with pytest.raises(InjectedFault, match="get_num_new_matched_tokens"):
        conn.get_num_new_matched_tokens(r, 0)
    assert conn.get_num_new_matched_tokens(r, 0) == (0, False)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"inner": None}, "set inner"),
        ({"fail_loads": [-1]}, "indexes >= 0"),
        ({"fail_load_rate": 2.0}, "between 0 and 1"),
        ({"raise_in": "nope"}, "raise_in must be one of"),
        ({"fail_load": [1]}, "valid options"),
        ({"inner": {"kv_connector": "Nope"}}, "unknown KV connector"),
    ],
)
def test_bad_options_are_clear_errors(tmp_path: Path, extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _connector(KVConnectorRole.SCHEDULER, tmp_path, **extra)


def test_registered_and_wraps_by_name(tmp_path: Path) -> None:
    assert FAULT in KVConnectorFactory.registered_names()
    kvt = KVTransferConfig(
        kv_connector=FAULT,
        kv_role="kv_both",
        kv_connector_extra_config={"inner": "DecodeBenchConnector"},
    )
    config = cast(EngineConfig, SimpleNamespace(kv_transfer_config=kvt))
    group = KVCacheGroupSpec(("l0",), 16, 1, 4, torch.float32)
    conn = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, KVCacheConfig(8, (group,))
    )
    assert type(conn.inner).__name__ == "DecodeBenchConnector"  # type: ignore[attr-defined]
