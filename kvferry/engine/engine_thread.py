"""EngineThread: the one thread that owns an LLMEngine, and how it fails.

The engine is not thread-safe, so one thread, ``kvferry-engine``, owns it: it builds, steps and
shuts it down. Other threads send commands (add, abort, call, stop) through a thread-safe queue
that the engine thread drains at the top of every iteration, before the next ``step()``;
outputs go back through each request's :class:`RequestStream`.

The thread steps while ``engine.has_unfinished_requests()`` (which includes blocks a KV
connector holds for finished requests); otherwise it sleeps on an event every command sets, so
an idle server uses no CPU. A step without any output (only transfers in flight) backs off
from 0.5 ms to 5 ms before the next; a command cuts the wait short.

A fault of one request inside a step (see ``LLMEngine.step``) ends only that request: its
stream gets a final output with finish reason ``error`` and ``RequestOutput.error``, and the
step counts as a good one. A step that raises is a fault of the engine: it fails the requests
in flight with :class:`EngineStepError` and aborts them; the thread keeps serving. After
``MAX_CONSECUTIVE_STEP_ERRORS`` failing steps with no step producing output in between (or a
failing abort) the engine is dead, ``dead_reason`` says why (``/health`` shows it), and
requests fail fast with :class:`EngineDeadError`.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvferry.config import ConfigError, EngineConfig
from kvferry.core import timeline
from kvferry.core.stats import SchedulerStats
from kvferry.engine.llm_engine import LLMEngine
from kvferry.engine.request_stream import RequestStream
from kvferry.logger import fmt_fields, init_logger
from kvferry.outputs import RequestOutput
from kvferry.sampling_params import SamplingParams
from kvferry.worker.multiproc_executor import WorkerFailedError

logger = init_logger(__name__)

PromptType = str | list[int] | dict[str, Any]
MAX_CONSECUTIVE_STEP_ERRORS = 3
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.0005, 0.005


class EngineStepError(RuntimeError):
    """The engine raised while running a step this request was part of."""


class EngineDeadError(RuntimeError):
    """The engine failed repeatedly (or was shut down) and accepts no more requests."""


class StatObserver(Protocol):
    """Told, on the engine thread, about every request that ends and about each step's
    KV-connector stats (``KVConnectorStats.data``: numbers, or lists of samples). An observer
    may also have ``record_step(outputs, num_scheduled_tokens, live_request_ids)``, called
    after every step that ran (per-step metrics: tokens per step, inter-token latency)."""

    def record_finished(self, output: RequestOutput) -> None: ...

    def record_ended(self, finish_reason: str) -> None: ...

    def record_kv_connector_stats(self, data: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class EngineSnapshot:
    """What ``/metrics`` shows; rebuilt by the engine thread after every step."""

    scheduler: SchedulerStats | None
    num_streams: int


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    cache_salt: str | None
    stream: RequestStream
    submitted: float = field(default_factory=time.time)  # for the timeline log


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


class _Stop:
    pass


_Command = _Add | _Abort | _Call | _Stop


class EngineThread:
    """The ``kvferry-engine`` thread and the state only it writes (streams, error count,
    ``dead_reason``, ``snapshot``). ``start()`` builds the engine on the thread and raises its
    error; the other public methods are safe from any thread."""

    def __init__(self, config: EngineConfig, observer: StatObserver | None) -> None:
        self.config = config
        self.observer = observer
        self._record_step = getattr(observer, "record_step", None)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._init_error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._awaiting_first: set[str] = set()  # timeline log only; engine thread only
        self._consecutive_errors = 0
        self.dead_reason: str | None = None
        self.snapshot = EngineSnapshot(None, 0)
        self.engine: LLMEngine | None = None
        self.thread = threading.Thread(target=self._main, name="kvferry-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self.thread.join()
            raise self._init_error

    # -- commands (any thread) ----------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        cache_salt: str | None,
        stream: RequestStream,
    ) -> None:
        self._submit(_Add(request_id, prompt, params, cache_salt, stream))

    def abort(self, request_ids: list[str]) -> None:
        self._submit(_Abort(request_ids))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future[Any]:
        cmd = _Call(fn)
        self._submit(cmd)
        return cmd.future

    def stop(self, timeout: float) -> None:
        if self.thread.is_alive():
            self._submit(_Stop())
            self.thread.join(timeout)

    def _submit(self, cmd: _Command) -> None:
        with self._lock:
            if self._closed:
                self._reject(cmd, EngineDeadError(self.dead_reason or "the engine is shut down"))
                return
            self._commands.put(cmd)
        self._wake.set()

    # -- the thread ---------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
        except BaseException as e:  # reported to the constructor's caller
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(self.engine)
        except BaseException as e:  # a bug in this module; make it visible, not silent
            self.dead_reason = f"the engine thread crashed: {type(e).__name__}: {e}"
            logger.exception("engine thread crashed")
        finally:
            self._stop(self.engine)

    def _loop(self, engine: LLMEngine) -> None:
        backoff = 0.0
        while True:
            self._wake.clear()
            if not self._drain_commands(engine):
                return
            if self.dead_reason is None and engine.has_unfinished_requests():
                produced = self._step(engine)
                self._publish(engine)
                if produced:
                    backoff = 0.0
                else:
                    backoff = min(max(2 * backoff, _BACKOFF_MIN_S), _BACKOFF_MAX_S)
                    self._wake.wait(backoff)
                continue
            backoff = 0.0
            self._publish(engine)
            self._wake.wait()

    def _drain_commands(self, engine: LLMEngine) -> bool:
        """Apply every queued command; False once a stop command was seen."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._add(engine, cmd)
            elif isinstance(cmd, _Abort):
                self._abort(engine, cmd.request_ids)
            else:
                self._call(engine, cmd)

    def _add(self, engine: LLMEngine, cmd: _Add) -> None:
        if self.dead_reason is not None:
            cmd.stream.put(EngineDeadError(self.dead_reason))
            return
        if cmd.request_id in self._streams:
            cmd.stream.put(ConfigError(f"request id {cmd.request_id!r} is already in use"))
            return
        try:
            engine.add_request(cmd.prompt, cmd.params, cmd.request_id, cmd.cache_salt)
        except ConfigError as e:
            cmd.stream.put(e)
            return
        except Exception as e:  # an engine bug must not kill the thread
            logger.exception("add_request failed")
            cmd.stream.put(EngineStepError(f"the engine could not add the request: {e}"))
            return
        self._streams[cmd.request_id] = cmd.stream
        if timeline.enabled():
            self._awaiting_first.add(cmd.request_id)
            timeline.emit("added", id=cmd.request_id, submit=cmd.submitted, added=time.time())

    def _abort(self, engine: LLMEngine, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        self._awaiting_first.difference_update(request_ids)
        if not live:
            return
        try:
            engine.abort_request(live)
        except Exception as e:
            self._declare_dead(engine, f"aborting requests failed: {type(e).__name__}: {e}")
            return
        if self.observer is not None:
            for _ in live:
                self.observer.record_ended("abort")
        logger.debug(fmt_fields("aborted", requests=",".join(live)))

    @staticmethod
    def _call(engine: LLMEngine, cmd: _Call) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        try:
            cmd.future.set_result(cmd.fn(engine))
        except BaseException as e:
            cmd.future.set_exception(e)

    def _step(self, engine: LLMEngine) -> bool:
        t0 = time.time()
        try:
            outputs = engine.step()
        except Exception as e:
            self._consecutive_errors += 1
            error = f"{type(e).__name__}: {e}"
            if isinstance(e, WorkerFailedError):
                # A tensor-parallel worker is gone: no retry, and its message says it all.
                self._declare_dead(engine, f"the engine's workers failed: {e}")
                return False
            logger.exception("engine step failed (%d in a row)", self._consecutive_errors)
            if self._consecutive_errors >= MAX_CONSECUTIVE_STEP_ERRORS:
                n = self._consecutive_errors
                self._declare_dead(engine, f"the engine step failed {n} times in a row: {error}")
            else:
                self._fail_all(engine, EngineStepError(f"engine step failed: {error}"))
            return False
        # Only a step that produced output proves the engine works again: the empty step that
        # flushes the aborted requests' ids runs no forward and must not reset the count.
        if outputs:
            self._consecutive_errors = 0
        self._collect_kv_stats(engine)
        if self._record_step is not None:
            self._record_step(outputs, engine.last_step_num_scheduled_tokens, self._streams)
        if timeline.enabled():
            timeline.emit("step", t0=t0, t1=time.time(), outputs=len(outputs))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.request_id in self._awaiting_first and out.outputs[0].token_ids:
                self._awaiting_first.discard(out.request_id)
                timeline.emit("first", id=out.request_id, t=time.time())
            if out.finished:
                del self._streams[out.request_id]
                self._awaiting_first.discard(out.request_id)
                if self.observer is not None:
                    self.observer.record_finished(out)
            stream.put(out)
        return bool(outputs)

    def _fail_all(self, engine: LLMEngine, error: BaseException) -> None:
        """Fail every request in flight with ``error`` and abort them in the engine."""
        streams, self._streams = self._streams, {}
        self._awaiting_first.clear()
        try:
            engine.abort_request(list(streams))
        except Exception as e:
            if self.dead_reason is None:
                self.dead_reason = f"aborting failed requests failed: {type(e).__name__}: {e}"
                logger.error(self.dead_reason)
        for stream in streams.values():
            stream.put(error)
            if self.observer is not None:
                self.observer.record_ended("error")

    def _declare_dead(self, engine: LLMEngine, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error(fmt_fields("engine is dead; failing all requests", reason=reason))
        self._fail_all(engine, EngineDeadError(self.dead_reason))

    def _collect_kv_stats(self, engine: LLMEngine) -> None:
        # Hand each step's raw connector stats to the observer (it keeps sums).
        stats = engine.last_step_kv_connector_stats
        if stats is not None and self.observer is not None:
            self.observer.record_kv_connector_stats(stats.data)

    def _publish(self, engine: LLMEngine) -> None:
        self.snapshot = EngineSnapshot(engine.scheduler.make_stats(), len(self._streams))

    @staticmethod
    def _reject(cmd: _Command, error: BaseException) -> None:
        if isinstance(cmd, _Add):
            cmd.stream.put(error)
        elif isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
            cmd.future.set_exception(error)

    def _stop(self, engine: LLMEngine) -> None:
        error = EngineDeadError("the engine is shutting down")
        with self._lock:  # from now on _submit rejects; fail what is still queued
            self._closed = True
        while not self._commands.empty():
            self._reject(self._commands.get_nowait(), error)
        self._fail_all(engine, error)
        try:
            engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")
