"""The engine requests behind one API request: one per prompt, their outputs merged.

:func:`start_requests` starts them and waits until every prompt has produced its first output
(so a prompt the engine rejects is a 400, not a broken stream); :func:`collect_finals` waits
for the final outputs of a non-streaming answer. Closing the merged outputs early (client gone)
aborts the engine requests still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvferry.engine.async_llm import AsyncLLM
from kvferry.entrypoints.openai.intake import TokenPrompt
from kvferry.outputs import RequestOutput
from kvferry.sampling_params import SamplingParams

# One output of one engine request, tagged with its prompt's index.
IndexedOutput = tuple[int, RequestOutput]


class RequestFailedError(RuntimeError):
    """The engine finished the request with an error (e.g. a failed KV load)."""


class MergedOutputs:
    """Several requests' output streams as one, tagged with the prompt index."""

    def __init__(self, gens: list[AsyncIterator[RequestOutput]]) -> None:
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = (
            asyncio.Queue()
        )
        self._open = len(gens)
        self._tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(gens)]

    async def _pump(self, index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                self._queue.put_nowait((index, out))
        except Exception as e:
            self._queue.put_nowait((index, e))
        self._queue.put_nowait((index, None))

    async def next(self) -> IndexedOutput | None:
        """The next output of any request; None when all are done; raises their errors."""
        while self._open:
            index, item = await self._queue.get()
            if item is None:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return index, item
        return None

    async def prime(self, n: int) -> list[IndexedOutput]:
        """Outputs until each of the ``n`` requests has produced one."""
        seen: set[int] = set()
        items: list[IndexedOutput] = []
        while len(seen) < n:
            item = await self.next()
            if item is None:
                break
            items.append(item)
            seen.add(item[0])
        return items

    async def close(self) -> None:
        """Cancel what still runs (which aborts those engine requests)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def start_requests(
    llm: AsyncLLM,
    prompts: list[TokenPrompt],
    params: SamplingParams,
    request_id: str,
    cache_salt: str | None,
    final_only: bool = False,
) -> tuple[MergedOutputs, list[IndexedOutput]]:
    """Engine request ``{request_id}-{i}`` per prompt; the merged outputs and each prompt's
    first output (and whatever came before it)."""
    gens = [
        llm.generate(p, params, f"{request_id}-{i}", cache_salt, final_only=final_only)
        for i, p in enumerate(prompts)
    ]
    merged = MergedOutputs(gens)
    try:
        return merged, await merged.prime(len(gens))
    except BaseException:
        await merged.close()
        raise


async def collect_finals(
    merged: MergedOutputs, primed: list[IndexedOutput], n: int
) -> list[RequestOutput]:
    """The final output of each of the ``n`` prompts, in prompt order."""
    finals: dict[int, RequestOutput] = {}
    try:
        for i, out in primed:
            if out.finished:
                finals[i] = out
        while (item := await merged.next()) is not None:
            if item[1].finished:
                finals[item[0]] = item[1]
    finally:
        await merged.close()
    outs = [finals[i] for i in range(n)]
    for out in outs:
        check_failed(out)
    return outs


def check_failed(out: RequestOutput) -> None:
    """Raise :class:`RequestFailedError` for a request the engine ended with an error."""
    if out.finished and out.outputs and out.outputs[0].finish_reason == "error":
        raise RequestFailedError(out.error or "the engine failed this request")


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """The ``usage`` object of an answer over these final outputs."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(
        o.metrics.num_local_cached_tokens + o.metrics.num_external_cached_tokens
        for o in outs
        if o.metrics is not None
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
