"""RequestStream: every output reaches the reader in order (none skipped when the loop runs
late), and ``stream_interval`` passes the first, every N-th new token's and the final output."""

from __future__ import annotations

import asyncio

import pytest

from kvferry.config import ConfigError
from kvferry.engine.async_llm import AsyncLLM
from kvferry.engine.request_stream import RequestStream, check_stream_interval
from kvferry.outputs import CompletionOutput, RequestOutput


def _out(n: int, finished: bool = False) -> RequestOutput:
    c = CompletionOutput(0, "x" * n, list(range(n)), "length" if finished else None)
    return RequestOutput("r", None, [1], [c], finished)


async def _drain(stream: RequestStream, outs: list[RequestOutput]) -> list[int]:
    # Everything is put before the loop runs once: the reader is as late as it can be.
    for out in outs:
        stream.put(out)
    seen: list[int] = []
    while True:
        item = await stream.get()
        assert isinstance(item, RequestOutput)
        seen.append(len(item.outputs[0].token_ids))
        if item.finished:
            return seen


def _run(interval: int, tokens: int) -> list[int]:
    async def main() -> list[int]:
        stream = RequestStream("r", asyncio.get_running_loop(), interval)
        outs = [_out(n, finished=n == tokens) for n in range(1, tokens + 1)]
        return await _drain(stream, outs)

    return asyncio.run(main())


def test_late_reader_gets_every_output_in_order() -> None:
    assert _run(1, 7) == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize(
    "interval,tokens,want",
    [(4, 10, [1, 5, 9, 10]), (4, 9, [1, 5, 9]), (3, 1, [1]), (100, 5, [1, 5])],
)
def test_stream_interval_passes_first_every_nth_and_final(interval, tokens, want) -> None:
    assert _run(interval, tokens) == want


def test_final_only_stream_passes_only_the_finished_output() -> None:
    async def main() -> list[int]:
        stream = RequestStream("r", asyncio.get_running_loop(), final_only=True)
        return await _drain(stream, [_out(n, finished=n == 5) for n in range(1, 6)])

    assert asyncio.run(main()) == [5]


def test_errors_always_pass() -> None:
    async def main() -> object:
        stream = RequestStream("r", asyncio.get_running_loop(), 8)
        stream.put(_out(1))
        stream.put(_out(2))
        stream.put(RuntimeError("boom"))
        assert len((await stream.get()).outputs[0].token_ids) == 1  # type: ignore[union-attr]
        return await stream.get()

    assert isinstance(asyncio.run(main()), RuntimeError)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_bad_stream_interval_is_a_config_error(bad) -> None:
    with pytest.raises(ConfigError, match="stream_interval must be a positive integer"):
        check_stream_interval(bad)
    # AsyncLLM checks it before it builds anything (so no config is needed to see it).
    with pytest.raises(ConfigError, match="stream_interval"):
        AsyncLLM(None, stream_interval=bad)  # type: ignore[arg-type]


def test_good_stream_interval() -> None:
    assert check_stream_interval(1) == 1 and check_stream_interval(16) == 16
