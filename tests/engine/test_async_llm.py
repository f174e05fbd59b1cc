"""AsyncLLM: one engine thread behind asyncio. Outputs identical to offline LLM.generate,
cancellation aborts and frees, step errors fail only the requests in flight, an idle engine
thread sleeps, shutdown fails what is left."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from kvferry import LLM, EngineArgs, SamplingParams
from kvferry.config import ConfigError
from kvferry.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from kvferry.engine.llm_engine import LLMEngine
from kvferry.outputs import RequestOutput

KW = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 256}
PROMPTS = [[5, 6, 7, 8, 9] * 4, [100, 200, 300], list(range(40, 75))]


class Recorder:
    def __init__(self) -> None:
        self.finished: list[str] = []
        self.ended: list[str] = []

    def record_finished(self, output: RequestOutput) -> None:
        self.finished.append(output.outputs[0].finish_reason or "")

    def record_ended(self, finish_reason: str) -> None:
        self.ended.append(finish_reason)


def _make(model_dir, observer=None) -> AsyncLLM:
    return AsyncLLM(EngineArgs(model=str(model_dir), **KW).create_engine_config(), observer)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def llm(model_dir, recorder):
    engine = _make(model_dir, recorder)
    yield engine
    engine.shutdown()


async def _run(llm: AsyncLLM, prompt, params: SamplingParams) -> RequestOutput:
    last = None
    async for out in llm.generate({"prompt_token_ids": prompt}, params):
        last = out
    assert last is not None and last.finished
    return last


async def _idle_state(llm: AsyncLLM) -> tuple[int, int, int]:
    def probe(e: LLMEngine) -> tuple[int, int, int]:
        kvm = e.scheduler.kv_cache_manager
        return len(e.scheduler.requests), kvm.get_num_free_blocks(), e.kv_cache_config.num_blocks

    return await llm.call(probe)


async def _wait_idle(llm: AsyncLLM) -> None:
    for _ in range(200):
        n, free, total = await _idle_state(llm)
        if n == 0 and free == total:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {n} requests, {free}/{total} blocks free")


def test_concurrent_requests_match_offline(llm, model_dir) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = LLM(model=str(model_dir), **KW).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False
    )

    async def main() -> list[RequestOutput]:
        return await asyncio.gather(*(_run(llm, p, params) for p in PROMPTS))

    got = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(o.metrics is not None and o.metrics.ttft is not None for o in got)


def test_cancel_aborts_and_frees(llm, recorder) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        n = 0
        async for out in llm.generate(PROMPTS[2], params):
            n += 1
            if n == 3:
                assert not out.finished
                break
        await _wait_idle(llm)
        # Cancelling the consuming task aborts too.
        task = asyncio.create_task(_run(llm, PROMPTS[0], params))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_idle(llm)

    before = recorder.ended.count("abort")
    asyncio.run(main())
    assert recorder.ended.count("abort") == before + 2


def test_bad_prompt_is_config_error_and_duplicate_ids_refused(llm) -> None:
    async def main() -> None:
        with pytest.raises(ConfigError, match="max_model_len"):
            await _run(llm, [1] * 300, SamplingParams(max_tokens=1))
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        first = llm.generate(PROMPTS[1], params, request_id="same")
        await first.__anext__()
        with pytest.raises(ConfigError, match="already in use"):
            async for _ in llm.generate(PROMPTS[1], params, request_id="same"):
                pass
        await first.aclose()
        await _wait_idle(llm)
        with pytest.raises(ConfigError, match="without a KV connector"):
            await llm.release_kv_transfer({"do_remote_prefill": True})

    asyncio.run(main())


def test_idle_engine_thread_sleeps(llm) -> None:
    asyncio.run(_wait_idle(llm))
    thread = next(t for t in psutil.Process().threads() if t.id == llm._thread.native_id)
    time.sleep(0.5)
    after = next(t for t in psutil.Process().threads() if t.id == llm._thread.native_id)
    busy = (after.user_time + after.system_time) - (thread.user_time + thread.system_time)
    assert busy < 0.05, f"idle engine thread used {busy:.3f}s of CPU in 0.5s"


def test_step_errors_fail_requests_then_engine_dies_cleanly(model_dir) -> None:
    recorder = Recorder()
    llm = _make(model_dir, recorder)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    failures = [0]  # how many of the next steps raise

    def install(engine: LLMEngine) -> None:
        real = engine.step

        def step() -> list[RequestOutput]:
            if failures[0] > 0:
                failures[0] -= 1
                raise RuntimeError("boom")
            return real()

        engine.step = step  # type: ignore[method-assign]

    async def main() -> None:
        await llm.call(install)
        failures[0] = 1
        with pytest.raises(EngineStepError, match="boom"):
            await _run(llm, PROMPTS[0], params)
        await _wait_idle(llm)  # the failed request was aborted, its blocks freed
        ok = await _run(llm, PROMPTS[0], params)  # the engine still serves
        assert len(ok.outputs[0].token_ids) == 5
        failures[0] = 3  # three failing steps in a row: the engine is declared dead
        with pytest.raises(EngineStepError):
            await _run(llm, PROMPTS[1], params)
        for _ in range(100):
            if not llm.is_alive:
                break
            await asyncio.sleep(0.02)
        assert not llm.is_alive and "boom" in (llm.dead_reason or "")
        with pytest.raises(EngineDeadError, match="boom"):
            await _run(llm, PROMPTS[1], params)

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert recorder.ended.count("error") == 2 and recorder.finished == ["length"]


def test_shutdown_fails_requests_in_flight(model_dir) -> None:
    llm = _make(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        gen = llm.generate(PROMPTS[2], params)
        await gen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await _run(llm, PROMPTS[0], params)

    asyncio.run(main())
    assert not llm._thread.is_alive()
