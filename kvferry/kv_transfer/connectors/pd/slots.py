"""Slots: the limit on side-channel calls in flight, one peer's or all peers' together."""

from __future__ import annotations

import asyncio
from collections import deque


class Slots:
    """A FIFO counting semaphore whose waiters give up after a timeout (loop thread only)."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._waiters: deque[asyncio.Future[bool]] = deque()

    async def take(self, timeout: float) -> bool:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        self._waiters.append(fut)
        timer = loop.call_later(timeout, _resolve, fut, False)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self.give()  # handed a slot just as we were cancelled: pass it on
            raise
        finally:
            timer.cancel()
            if not fut.done():
                fut.cancel()

    def give(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(True)
                return
        self.free += 1


def _resolve(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)
