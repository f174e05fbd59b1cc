"""RequestStream: one request's outputs, handed from the engine thread to the asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib

from kvferry.outputs import RequestOutput


class RequestStream:
    """One request's outputs, written by the engine thread, read by the asyncio loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe. Dropped silently when the loop is already closed (shutdown)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> RequestOutput | BaseException:
        """The next item; outputs are cumulative, so queued unfinished ones are skipped."""
        item = await self._queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        return item
