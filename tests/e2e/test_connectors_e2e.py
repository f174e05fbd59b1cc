"""End to end with a tiny model: every connector's greedy outputs are token-identical to a run
without a connector, hits really come from the connector, and nothing leaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.config import ConfigError

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]
WORKER_ORDER = [
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "layers",
    "finish_forward",
    "wait_for_save",
    "get_finished",
    "get_failed_recving",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "clear_connector_metadata",
]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    system = torch.randint(3, 512, (80,), generator=g).tolist()
    tails = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 30)]
    lone = torch.randint(3, 512, (45,), generator=g).tolist()
    return [system + t for t in tails] + [lone]


PROMPTS = _prompts()


def _llm(model_dir: Path, kv: dict | None = None, **kw) -> LLM:
    args = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 256}
    args.update(kw)
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model_dir), **args)


def _run(llm: LLM, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def _assert_clean(llm: LLM) -> None:
    sched = llm.engine.scheduler
    sched.kv_cache_manager.check_integrity()
    assert sched.kv_cache_manager.get_num_free_blocks() == llm.engine.kv_cache_config.num_blocks
    assert not sched.has_unfinished_requests()
    assert not sched.requests


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    llm = _llm(model_dir)
    tokens, _ = _run(llm)
    _assert_clean(llm)
    return tokens


def _example(path: Path, **extra) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path), **extra},
    }


def test_example_connector_restart_reuses_stored_prefixes(model_dir, reference, tmp_path):
    kv = _example(tmp_path / "kv")
    first = _llm(model_dir, kv)
    tokens, outs = _run(first)
    assert tokens == reference
    assert all(o.metrics.num_external_cached_tokens == 0 for o in outs)
    _assert_clean(first)
    first.engine.shutdown()
    stored = list((tmp_path / "kv").rglob("meta.json"))
    assert len(stored) == len(PROMPTS)

    # A fresh engine (empty local prefix cache) on the same folder loads from the connector.
    second = _llm(model_dir, kv)
    tokens, outs = _run(second)
    assert tokens == reference
    for prompt, out in zip(PROMPTS, outs, strict=True):
        expected = (len(prompt) - 1) // 16 * 16
        local = out.metrics.num_local_cached_tokens
        assert local + out.metrics.num_external_cached_tokens == expected
    assert sum(o.metrics.num_external_cached_tokens for o in outs) > 0
    _assert_clean(second)


def test_multi_connector_over_two_example_folders(model_dir, reference, tmp_path):
    kv = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                _example(tmp_path / "a"),
                _example(tmp_path / "b"),
            ]
        },
    }
    first = _llm(model_dir, kv)
    assert _run(first)[0] == reference
    _assert_clean(first)
    # Both children saved every prompt.
    assert len(list((tmp_path / "a").rglob("meta.json"))) == len(PROMPTS)
    assert len(list((tmp_path / "b").rglob("meta.json"))) == len(PROMPTS)
    # Without the first child's files, the second child serves the loads.
    import shutil

    shutil.rmtree(tmp_path / "a")
    second = _llm(model_dir, kv)
    tokens, outs = _run(second)
    assert tokens == reference
    assert sum(o.metrics.num_external_cached_tokens for o in outs) > 0
    _assert_clean(second)


def _faulty(path: Path, policy: str, mode: str, fail_loads: list[int]) -> dict:
    return {
        "kv_connector": "FaultyExampleConnector",
        "kv_connector_module_path": "tests.helpers.fault_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "shared_storage_path": str(path),
            "fail_loads": fail_loads,
            "mode": mode,
        },
    }


@pytest.fixture()
def filled_store(model_dir, tmp_path) -> Path:
    llm = _llm(model_dir, _example(tmp_path / "kv"))
    _run(llm)
    llm.engine.shutdown()
    return tmp_path / "kv"


@pytest.mark.parametrize("mode", ["error", "corrupt"])
def test_failed_loads_recompute_to_identical_outputs(model_dir, reference, filled_store, mode):
    llm = _llm(model_dir, _faulty(filled_store, "recompute", mode, [0, 2]))
    tokens, outs = _run(llm)
    assert tokens == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    worker = llm.engine.executor.worker.kv_connector
    assert len(worker.sabotaged_req_ids) == 2
    _assert_clean(llm)


@pytest.mark.parametrize("mode", ["error", "corrupt"])
def test_failed_loads_fail_exactly_the_affected_requests(model_dir, reference, filled_store, mode):
    llm = _llm(model_dir, _faulty(filled_store, "fail", mode, [1]))
    tokens, outs = _run(llm)
    worker = llm.engine.executor.worker.kv_connector
    (bad,) = worker.sabotaged_req_ids
    for out, ref in zip(outs, reference, strict=True):
        if out.request_id == bad:
            assert out.outputs[0].finish_reason == "error"
            assert out.error
        else:
            assert out.outputs[0].finish_reason == "length"
            assert out.outputs[0].token_ids == ref
    _assert_clean(llm)


def test_corrupt_stored_file_is_a_load_error_not_garbage(model_dir, reference, filled_store):
    victim = next(filled_store.rglob("*.safetensors"))
    victim.write_bytes(b"\x00garbage")
    llm = _llm(model_dir, {**_example(filled_store), "kv_load_failure_policy": "recompute"})
    assert _run(llm)[0] == reference
    _assert_clean(llm)


def test_readme_example_connector_by_module_path(model_dir, reference):
    sys.path.insert(0, str(ROOT))
    try:
        kv = {
            "kv_connector": "HostPrefixConnector",
            "kv_connector_module_path": "examples.host_prefix_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"max_blocks": 64},
        }
        # No local prefix cache, so every shared prefix must come back through the connector.
        llm = _llm(model_dir, kv, enable_prefix_caching=False)
        tokens, _ = _run(llm)
        assert tokens == reference
        tokens, outs = _run(llm)
        assert tokens == reference
        assert all(o.metrics.num_external_cached_tokens > 0 for o in outs)
        _assert_clean(llm)
    finally:
        sys.path.remove(str(ROOT))


def test_decode_bench_connector_skips_prefill(model_dir):
    llm = _llm(model_dir, {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_consumer"})
    _, outs = _run(llm)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        # Prompts sharing a prefix hit the blocks filled for an earlier one locally first.
        m = out.metrics
        assert m.num_external_cached_tokens > 0
        assert m.num_local_cached_tokens + m.num_external_cached_tokens == len(prompt) - 1
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    _assert_clean(llm)


@pytest.mark.parametrize(
    ("kv", "match"),
    [
        ({"kv_connector": "ExampleConnector"}, "kv_role is required"),
        ({"kv_connector": "Nope", "kv_role": "kv_both"}, "unknown KV connector"),
        (
            {"kv_connector": "X", "kv_role": "kv_both", "kv_connector_module_path": "no.such.mod"},
            "cannot import",
        ),
        (
            {
                "kv_connector": "Missing",
                "kv_role": "kv_both",
                "kv_connector_module_path": "tests.helpers.fault_connector",
            },
            "has no class",
        ),
        (
            {"kv_connector": "Any", "kv_role": "kv_both", "kv_connector_module_path": "typing"},
            "not a KV connector",
        ),
        (
            {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_pth": "/tmp"},
            },
            "valid options",
        ),
        (
            {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "ignore",
            },
            "kv_load_failure_policy",
        ),
        ({"kv_connectr": "ExampleConnector"}, "valid keys"),
    ],
)
def test_bad_connector_configs(model_dir, kv, match):
    with pytest.raises(ConfigError, match=match):
        _llm(model_dir, kv)


def test_trace_renders_a_real_run(model_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    kv = json.dumps(_example(tmp_path / "kv"))
    env = {
        "KVFERRY_TRACE_CONNECTOR": "1",
        "KVFERRY_TRACE_FILE": str(trace),
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [
        sys.executable,
        "-m",
        "kvferry",
        "generate",
        "--model",
        str(model_dir),
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
        "--max-tokens",
        "4",
        "--json",
        "--kv-transfer-config",
        kv,
        "--prompt",
        "a b c d e f g h i j k l m n o p q r s t u v",
    ]
    for _ in range(2):  # the second run hits what the first stored
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=300)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    methods = {r["method"] for r in records}
    assert {
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "start_load_kv",
        "save_kv_layer",
        "wait_for_save",
        "get_finished",
        "request_finished",
    } <= methods
    out = subprocess.run(
        [sys.executable, "-m", "kvferry", "trace", str(trace)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    ).stdout
    assert out.startswith("sequenceDiagram")
    assert "S->>C: get_num_new_matched_tokens" in out
    assert "A->>W: wait_for_layer_load / save_kv_layer" in out
    # vLLM's order on every step: start_load_kv before the layers (also on steps without
    # sync loads), finish_forward after them, then wait_for_save and get_finished.
    assert "finish_forward" in methods
    for block in out.split("Note over S,A: step")[1:]:
        calls = [
            line.split(": ", 1)[1].split("(")[0]
            for line in block.splitlines()
            if "->>" in line and "-->>" not in line
        ]
        worker = [c for c in calls if c in WORKER_ORDER or c.startswith("wait_for_layer_load")]
        if not worker:
            continue
        ranks = [
            WORKER_ORDER.index("layers" if c.startswith("wait_for_layer_load") else c)
            for c in worker
        ]
        assert ranks == sorted(ranks), worker
        assert "start_load_kv" in worker and "get_finished" in worker


def test_example_connector_hits_block_aligned_prompts(model_dir, tmp_path):
    prompt = list(range(10, 10 + 64))  # exactly four blocks
    kv = _example(tmp_path / "kv")
    ref, _ = _run(_llm(model_dir), [prompt])
    _run(_llm(model_dir, kv), [prompt])
    tokens, outs = _run(_llm(model_dir, kv), [prompt])
    assert tokens == ref
    assert outs[0].metrics.num_external_cached_tokens == 48
