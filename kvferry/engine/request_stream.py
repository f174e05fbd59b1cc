"""RequestStream: one request's outputs, handed from the engine thread to the asyncio loop.

Every output the stream lets through reaches the reader, in order: outputs are cumulative, so
the reader could skip to the newest, but a streamed answer sends one chunk per output it reads,
and skipping would merge tokens into bursts whenever the loop runs a little late.

``stream_interval`` (``kvferry serve --stream-interval``, vLLM's meaning) is how many new
tokens an output must add before it is passed on: the first output and the final output
always go through, so with 1 every output does (one chunk per token) and with N a
stream of T tokens hands over ``1 + ceil((T - 1) / N)`` outputs. Outputs held back this way
are never queued, which also spares the loop their wake-ups. A ``final_only`` stream (a
request whose caller wants only the answer, e.g. a non-streamed completion) passes only the
finished output.
"""

from __future__ import annotations

import asyncio
import contextlib

from kvferry.config import ConfigError
from kvferry.outputs import RequestOutput


def check_stream_interval(value: object) -> int:
    """``value`` if it is a positive int (not a bool), else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"stream_interval must be a positive integer, got {value!r}")
    return value


class RequestStream:
    """One request's outputs, written by the engine thread, read by the asyncio loop."""

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        stream_interval: int = 1,
        final_only: bool = False,
    ) -> None:
        self.request_id = request_id
        self.stream_interval = check_stream_interval(stream_interval)
        self.final_only = final_only
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._tokens_passed: int | None = None  # engine thread only; None: nothing passed yet

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe for errors; outputs come from the engine thread only. Dropped silently
        when the loop is already closed (shutdown)."""
        if isinstance(item, RequestOutput) and not self._due(item):
            return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _due(self, out: RequestOutput) -> bool:
        if self.final_only:
            return out.finished
        tokens = len(out.outputs[0].token_ids) if out.outputs else 0
        passed = self._tokens_passed
        if not (out.finished or passed is None or tokens - passed >= self.stream_interval):
            return False
        self._tokens_passed = tokens
        return True

    async def get(self) -> RequestOutput | BaseException:
        """The next item, in the order they were put."""
        return await self._queue.get()
