"""BoundedReader: file reads that give up after a time bound instead of hanging their caller.

A read of a regular file can still block for a long time, or forever: a hung network mount, a
dying disk, a FUSE server that stopped answering. Such a read cannot be interrupted, so it runs
on a helper thread and the caller waits at most ``timeout_s`` for it. A read that overruns is
abandoned: its thread (and whatever memory the read function owns) is left to it, never reused,
and the caller gets :class:`ReadTimeout`. The next read starts on a fresh thread, so one stuck
read occupies one thread and nothing else; once ``max_stuck`` reads are stuck, reads fail at
once until one of them returns.

The read function must write only into memory it owns (a buffer it allocated or was handed for
this read alone): an abandoned read may still write after its caller has moved on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ReadTimeout(Exception):
    """A read did not finish within its bound (it was abandoned), or too many are stuck."""


class _Task(Generic[T]):
    __slots__ = ("fn", "done", "result", "error", "abandoned")

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None
        self.abandoned = False


class BoundedReader:
    def __init__(self, timeout_s: float, name: str = "kv-read", max_stuck: int = 4) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the read bound must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.name = name
        self.max_stuck = max_stuck
        self._lock = threading.Lock()
        self._serial = threading.Lock()  # one read at a time per reader
        self._idle: queue.Queue[_Task | None] | None = None
        self._stuck = 0
        self._closed = False

    @property
    def num_stuck(self) -> int:
        with self._lock:
            return self._stuck

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the reader's thread; its result, its exception, or ReadTimeout."""
        with self._serial:
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"{self.name}: the reader is shut down")
                if self._stuck >= self.max_stuck:
                    raise ReadTimeout(
                        f"{self._stuck} earlier reads are still stuck; not starting another"
                    )
                if self._idle is None:
                    self._idle = self._start_thread()
                inbox = self._idle
            task: _Task[T] = _Task(fn)
            inbox.put(task)
            if not task.done.wait(self.timeout_s):
                with self._lock:
                    if not task.done.is_set():
                        task.abandoned = True
                        self._stuck += 1
                        self._idle = None  # that thread is the stuck read's until it returns
                        raise ReadTimeout(
                            f"the read did not finish within {self.timeout_s:g} s and was abandoned"
                        )
            if task.error is not None:
                raise task.error
            return task.result  # type: ignore[return-value]

    def _start_thread(self) -> queue.Queue[_Task | None]:
        inbox: queue.Queue[_Task | None] = queue.Queue()
        threading.Thread(target=self._loop, args=(inbox,), name=self.name, daemon=True).start()
        return inbox

    def _loop(self, inbox: queue.Queue[_Task | None]) -> None:
        while True:
            task = inbox.get()
            if task is None:
                return
            try:
                task.result = task.fn()
            except BaseException as e:  # handed to the caller, whatever it is
                task.error = e
            with self._lock:
                task.done.set()
                if task.abandoned:
                    self._stuck -= 1
                    return  # a fresh thread took over; this one retires

    def shutdown(self) -> None:
        """Stop the idle thread; stuck ones end when their reads return (they are daemons)."""
        with self._lock:
            self._closed = True
            inbox, self._idle = self._idle, None
        if inbox is not None:
            inbox.put(None)
