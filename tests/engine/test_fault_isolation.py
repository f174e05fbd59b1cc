"""Fault isolation in the engine step: a fault of one request (a connector hook raising for it,
sampling values that slipped past intake, a detokenizer failure) ends only that request with
finish reason ``error`` and a message; the other requests of the step produce exactly the tokens
of a clean run, no block leaks, and the engine stays alive. A fault of the step itself (the
forward raising) fails the step, keeps its blocks out of the prefix cache, and three in a row
mark the engine dead, which ``/health`` reports."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from kvferry import EngineArgs, SamplingParams
from kvferry.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from kvferry.engine.llm_engine import LLMEngine
from kvferry.entrypoints.metrics import ServerMetrics
from kvferry.entrypoints.openai.api_server import build_app
from kvferry.outputs import RequestOutput
from kvferry.request import RequestStatus

KW = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 256}
# "bad" fills two blocks, so its admission publishes blocks to the prefix cache.
PROMPTS = {"a": [5, 6, 7, 8, 9] * 4, "bad": list(range(40, 75)), "c": [100, 200, 300]}
MAX_TOKENS = 16


def _greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _random(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)


def _engine(model_dir: Path, kv: dict | None = None) -> LLMEngine:
    args: dict[str, Any] = dict(KW)
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=str(model_dir), **args))


StepHook = Callable[[LLMEngine, int], None]


def _drive(
    engine: LLMEngine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    before_step: StepHook | None = None,
) -> dict[str, RequestOutput]:
    """Add ``requests`` (id -> prompt, params), step until the engine is idle; final outputs."""
    for rid, (prompt, params) in requests.items():
        engine.add_request({"prompt_token_ids": prompt}, params, rid)
    finals: dict[str, RequestOutput] = {}
    for n in range(200):
        if not engine.has_unfinished_requests():
            return finals
        if before_step is not None:
            before_step(engine, n)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("the engine did not go idle")


def _assert_clean(engine: LLMEngine) -> None:
    s = engine.scheduler
    s.check_integrity()
    assert s.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_config.num_blocks
    assert not s.requests and not s.has_requests()
    assert not engine.output_processor.states
    runner = engine.executor.worker.model_runner
    assert not runner.requests and not runner.unservable


def _tokens(out: RequestOutput) -> list[int]:
    return out.outputs[0].token_ids


def _assert_failed(out: RequestOutput, match: str) -> None:
    assert out.outputs[0].finish_reason == "error"
    assert out.error is not None and re.search(match, out.error), out.error


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return _engine(model_dir)


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    """Greedy tokens of each prompt from a clean run (MAX_TOKENS of them)."""
    finals = _drive(engine, {f"ref-{k}": (p, _greedy(MAX_TOKENS)) for k, p in PROMPTS.items()})
    _assert_clean(engine)
    return {k: _tokens(finals[f"ref-{k}"]) for k in PROMPTS}


def _mixed(tag: str, bad: SamplingParams) -> dict[str, tuple[list[int], SamplingParams]]:
    reqs = {f"{tag}-{k}": (p, _greedy()) for k, p in PROMPTS.items()}
    reqs[f"{tag}-bad"] = (PROMPTS["bad"], bad)
    return reqs


def _assert_others_clean(finals: dict[str, RequestOutput], tag: str, reference: dict) -> None:
    for k in ("a", "c"):
        out = finals[f"{tag}-{k}"]
        assert out.outputs[0].finish_reason == "length" and out.error is None
        assert _tokens(out) == reference[k][:8]


@pytest.mark.parametrize(
    ("field", "value", "at_step", "match"),
    [
        ("temperature", math.nan, 2, r"sampling failed \(temperature=nan"),
        ("top_p", 0.0, 2, r"sampling failed \(.*top_p=0\.0"),
        ("seed", 2**70, 0, r"seed 1180591620717411303424 cannot seed a generator"),
    ],
)
def test_bad_sampling_value_after_intake_fails_only_its_request(
    engine, reference, field, value, at_step, match
) -> None:
    tag = f"sp-{field}"

    def poison(eng: LLMEngine, n: int) -> None:
        if n == at_step:
            request = eng.scheduler.get_request(f"{tag}-bad")
            assert request is not None and not request.is_finished()
            setattr(request.sampling_params, field, value)

    finals = _drive(engine, _mixed(tag, _random()), poison)
    _assert_failed(finals[f"{tag}-bad"], match)
    assert len(_tokens(finals[f"{tag}-bad"])) == at_step  # what it had before the fault
    _assert_others_clean(finals, tag, reference)
    _assert_clean(engine)
    # The engine still serves.
    again = _drive(engine, {f"{tag}-again": (PROMPTS["bad"], _greedy())})
    assert _tokens(again[f"{tag}-again"]) == reference["bad"][:8]
    _assert_clean(engine)


def test_detokenizer_fault_fails_only_its_request(engine, reference) -> None:
    tag = "detok"

    def poison(eng: LLMEngine, n: int) -> None:
        if n == 1:
            state = eng.output_processor.states[f"{tag}-bad"]

            def add(token_ids: list[int]) -> str:
                raise ValueError("undecodable token")

            state.detok.add = add  # type: ignore[method-assign]

    finals = _drive(engine, _mixed(tag, _greedy()), poison)
    _assert_failed(finals[f"{tag}-bad"], "processing the output failed: ValueError: undecodable")
    _assert_others_clean(finals, tag, reference)
    _assert_clean(engine)


def _hook_kv(path: Path, hook: str, fail_ids: list[str]) -> dict:
    return {
        "kv_connector": "HookFaultConnector",
        "kv_connector_module_path": "tests.helpers.fault_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "shared_storage_path": str(path),
            "fail_hook": hook,
            "fail_request_ids": fail_ids,
        },
    }


@pytest.mark.parametrize(
    "hook", ["get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"]
)
def test_connector_hook_fault_fails_only_its_request(model_dir, reference, tmp_path, hook) -> None:
    engine = _engine(model_dir, _hook_kv(tmp_path, hook, ["hook-bad"]))
    try:
        finals = _drive(engine, _mixed("hook", _greedy()))
        _assert_failed(finals["hook-bad"], f"KV connector's {hook} failed.*injected fault")
        if hook == "request_finished":  # it ran to the end; only its end failed
            assert _tokens(finals["hook-bad"]) == reference["bad"][:8]
        _assert_others_clean(finals, "hook", reference)
        _assert_clean(engine)
        # Blocks the failed admission published held no KV: the same prompt must not hit them.
        again = _drive(engine, {"again": (PROMPTS["bad"], _greedy())})["again"]
        assert _tokens(again) == reference["bad"][:8]
        if hook == "update_state_after_alloc":
            assert again.metrics is not None and again.metrics.num_local_cached_tokens == 0
        _assert_clean(engine)
    finally:
        engine.shutdown()


def test_step_wide_hook_fault_fails_the_step_and_publishes_no_unwritten_block(
    model_dir, reference, tmp_path
) -> None:
    engine = _engine(model_dir, _hook_kv(tmp_path, "build_connector_meta", ["meta-bad"]))
    try:
        engine.add_request({"prompt_token_ids": PROMPTS["bad"]}, _greedy(), "meta-bad")
        with pytest.raises(RuntimeError, match="injected fault in build_connector_meta"):
            engine.step()
        engine.abort_request("meta-bad")  # what AsyncLLM does after a failed step
        again = _drive(engine, {"again": (PROMPTS["bad"], _greedy())})["again"]
        assert _tokens(again) == reference["bad"][:8]
        assert again.metrics is not None and again.metrics.num_local_cached_tokens == 0
        _assert_clean(engine)
    finally:
        engine.shutdown()


# -- through AsyncLLM and the HTTP server -----------------------------------------------------


def _async_llm(model_dir: Path, metrics: ServerMetrics) -> AsyncLLM:
    return AsyncLLM(EngineArgs(model=str(model_dir), **KW).create_engine_config(), metrics)


async def _run(llm: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str) -> RequestOutput:
    last = None
    async for out in llm.generate({"prompt_token_ids": prompt}, params, rid):
        last = out
    assert last is not None and last.finished
    return last


async def _wait_idle(llm: AsyncLLM) -> None:
    def probe(e: LLMEngine) -> bool:
        s = e.scheduler
        return (
            not s.requests
            and s.kv_cache_manager.get_num_free_blocks() == s.kv_cache_manager.num_blocks
        )

    for _ in range(200):
        if await llm.call(probe):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the engine did not go idle with every block free")


def _finished_count(metrics: ServerMetrics, reason: str) -> float:
    text = metrics.render().decode()
    pattern = rf'vllm:request_success_total\{{[^}}]*finished_reason="{reason}"[^}}]*\}} (\S+)'
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


def test_four_bad_requests_in_consecutive_steps_do_not_kill_the_engine(model_dir, reference):
    metrics = ServerMetrics("tiny")
    llm = _async_llm(model_dir, metrics)
    bad = [f"bad{i}" for i in range(4)]
    poisoned_at: list[int] = []

    def install(engine: LLMEngine) -> None:
        real, steps = engine.step, [0]

        def step() -> list[RequestOutput]:
            s = engine.scheduler
            everyone = [*bad, "good"]
            running = all(
                (r := s.get_request(rid)) is not None and r.status == RequestStatus.RUNNING
                for rid in everyone
            )
            if len(poisoned_at) < len(bad) and (poisoned_at or running):
                request = s.get_request(bad[len(poisoned_at)])
                assert request is not None
                request.sampling_params.temperature = math.nan
                poisoned_at.append(steps[0])
            steps[0] += 1
            return real()

        engine.step = step  # type: ignore[method-assign]

    async def main() -> list[RequestOutput]:
        await llm.call(install)
        runs = [_run(llm, PROMPTS["bad"], _random(MAX_TOKENS), rid) for rid in bad]
        runs.append(_run(llm, PROMPTS["a"], _greedy(MAX_TOKENS), "good"))
        outs = await asyncio.gather(*runs)
        await _wait_idle(llm)
        return outs

    try:
        *bad_outs, good = asyncio.run(main())
        assert poisoned_at == list(range(poisoned_at[0], poisoned_at[0] + 4))
        for out in bad_outs:
            _assert_failed(out, "sampling failed")
        assert _tokens(good) == reference["a"] and good.outputs[0].finish_reason == "length"
        assert llm.is_alive and llm.dead_reason is None
        assert _finished_count(metrics, "error") == 4
        assert _finished_count(metrics, "length") == 1
    finally:
        llm.shutdown()


def test_forward_fault_fails_the_step_and_three_in_a_row_kill_the_engine(model_dir, reference):
    metrics = ServerMetrics("tiny")
    llm = _async_llm(model_dir, metrics)
    client = TestClient(build_app(llm, "tiny", metrics))
    fault = [False]

    def install(engine: LLMEngine) -> None:
        model = engine.executor.worker.model_runner.model
        real = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if fault[0]:
                raise RuntimeError("the forward exploded")
            return real(*args, **kwargs)

        model.forward = forward

    async def main() -> None:
        await llm.call(install)
        fault[0] = True
        with pytest.raises(EngineStepError, match="the forward exploded"):
            await _run(llm, PROMPTS["bad"], _greedy(), "f0")
        await _wait_idle(llm)
        assert llm.is_alive
        fault[0] = False
        # The failed step's blocks were published before its forward and never written: the
        # same prompt must compute its KV again rather than hit them.
        again = await _run(llm, PROMPTS["bad"], _greedy(), "f1")
        assert _tokens(again) == reference["bad"][:8]
        assert again.metrics is not None and again.metrics.num_local_cached_tokens == 0
        fault[0] = True
        for i in range(3):
            with pytest.raises((EngineStepError, EngineDeadError), match="forward exploded"):
                await _run(llm, PROMPTS["a"], _greedy(), f"f{i + 2}")
        with pytest.raises(EngineDeadError, match="3 times in a row"):
            await _run(llm, PROMPTS["a"], _greedy(), "f5")

    try:
        ok = client.get("/health")
        assert ok.status_code == 200 and ok.json() == {"status": "ok"}
        asyncio.run(main())
        assert not llm.is_alive
        dead = client.get("/health")
        assert dead.status_code == 503
        error = dead.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == 503
        assert "3 times in a row" in error["message"]
        assert "RuntimeError: the forward exploded" in error["message"]
    finally:
        llm.shutdown()
