"""The ``kvferry.timeline`` debug lines: each request's hand-over, the steps that ran its
prefill chunks and its first token, in order, readable by ``benchmarks/ttft_breakdown.py``;
nothing logged while the logger is off."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from benchmarks.ttft_breakdown import parse_log
from kvferry import EngineArgs, SamplingParams
from kvferry.engine.async_llm import AsyncLLM

# A budget below the long prompt's length, so that its prefill takes two chunks.
KW = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 64}
PROMPTS = [list(range(10, 110)), [5, 6, 7]]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        # The server's log format puts "] " before the message.
        self.lines.append(f"DEBUG 00:00:00 {record.name}] {record.getMessage()}")


@pytest.fixture
def timeline_lines() -> Iterator[_Lines]:
    logger = logging.getLogger("kvferry.timeline")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _serve(model_dir, ids: list[str]) -> None:
    llm = AsyncLLM(EngineArgs(model=str(model_dir), **KW).create_engine_config())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def one(rid: str, prompt: list[int]) -> None:
        async for _ in llm.generate({"prompt_token_ids": prompt}, params, rid):
            pass

    async def main() -> None:
        await asyncio.gather(*(one(r, p) for r, p in zip(ids, PROMPTS, strict=True)))

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


def test_timeline_orders_each_requests_events(tiny_model_factory, timeline_lines) -> None:
    logging.getLogger("kvferry.timeline").setLevel(logging.DEBUG)
    ids = ["long", "short"]
    _serve(tiny_model_factory("llama"), ids)
    trace = parse_log("\n".join(timeline_lines.lines))
    assert set(trace.added) == set(trace.first) == set(ids)
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        submit, added = trace.added[rid]
        chunks = [s for s in trace.steps if rid in s.prefill]
        # Every prompt token is planned exactly once, within the step budget.
        assert sum(s.prefill[rid] for s in chunks) == len(prompt)
        assert all(s.tokens <= KW["max_num_batched_tokens"] for s in chunks)
        assert submit <= added <= chunks[0].sched <= chunks[0].t1 <= chunks[-1].t1
        assert chunks[-1].t1 <= trace.first[rid]
    assert len([s for s in trace.steps if "long" in s.prefill]) == 2
    # Steps are logged in order and never overlap.
    assert all(a.t1 <= b.t0 for a, b in zip(trace.steps, trace.steps[1:], strict=False))


def test_no_timeline_lines_when_off(tiny_model_factory, timeline_lines) -> None:
    logging.getLogger("kvferry.timeline").setLevel(logging.INFO)
    _serve(tiny_model_factory("llama"), ["a", "b"])
    assert timeline_lines.lines == []
