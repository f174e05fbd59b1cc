"""AsyncLLM: the LLMEngine behind an asyncio front end (the OpenAI-compatible server).

The engine runs on its own thread (:class:`EngineThread`, which also says how a failing step
or a dead engine is handled); this module is the asyncio side: ``generate`` streams one
request's outputs, ``abort``, ``call`` runs a function on the engine between two steps,
``release_kv_transfer`` hands a connector's params back, ``shutdown`` stops the thread.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from kvferry.config import ConfigError, EngineConfig
from kvferry.engine.engine_thread import (
    MAX_CONSECUTIVE_STEP_ERRORS,
    EngineDeadError,
    EngineSnapshot,
    EngineStepError,
    EngineThread,
    PromptType,
    StatObserver,
)
from kvferry.engine.llm_engine import LLMEngine
from kvferry.engine.request_stream import RequestStream, check_stream_interval
from kvferry.outputs import RequestOutput
from kvferry.sampling_params import SamplingParams

__all__ = [
    "MAX_CONSECUTIVE_STEP_ERRORS",
    "AsyncLLM",
    "EngineDeadError",
    "EngineSnapshot",
    "EngineStepError",
    "PromptType",
    "RequestStream",
    "StatObserver",
]

T = TypeVar("T")


class AsyncLLM:
    """``async for out in llm.generate(prompt, params): ...`` over one engine thread.

    Built (engine included) by the constructor, which raises the engine's ConfigError on bad
    settings. ``stream_interval`` is the tokens per output ``generate`` yields (see
    :class:`RequestStream`; 1: every token). ``shutdown()`` stops the thread and fails
    requests still in flight.
    """

    def __init__(
        self,
        config: EngineConfig,
        observer: StatObserver | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.stream_interval = check_stream_interval(stream_interval)
        # /metrics needs the scheduler's stats (this also turns on the periodic stats log line).
        config.log_stats = True
        self.config = config
        self.observer = observer
        self._core = EngineThread(config, observer)
        self._thread: threading.Thread = self._core.thread
        self._core.start()

    # -- properties set once at start (safe to read from any thread) -------------------------

    @property
    def engine(self) -> LLMEngine:
        """The engine; only touch it from ``call(fn)`` while the server runs."""
        assert self._core.engine is not None
        return self._core.engine

    @property
    def has_kv_connector(self) -> bool:
        return self.config.kv_transfer_config is not None

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is dead (``/health``); None while it serves."""
        return self._core.dead_reason

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine thread's latest :class:`EngineSnapshot` (``/metrics``)."""
        return self._core.snapshot

    # -- public API (asyncio side) ------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        *,
        final_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the finished one: every output by default, one per
        ``stream_interval`` new tokens otherwise (the first and the final one always, none
        skipped when this loop runs late); only the finished one with ``final_only``. Raises ConfigError for a prompt
        the engine rejects, EngineStepError / EngineDeadError on engine failure. Leaving the
        iteration early (cancellation, client gone) aborts the request."""
        self._check_alive()
        rid = request_id or uuid.uuid4().hex
        stream = RequestStream(rid, asyncio.get_running_loop(), self.stream_interval, final_only)
        self._core.add(rid, prompt, params, cache_salt, stream)
        done = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                self._core.abort([rid])

    async def abort(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._core.abort(ids)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps; return its result."""
        self._check_alive()
        return await asyncio.wrap_future(self._core.call(fn))  # type: ignore[no-any-return]

    async def release_kv_transfer(
        self, kv_transfer_params: dict[str, Any], timeout: float = 30.0
    ) -> str:
        """Hand ``kv_transfer_params`` to the connector's ``request_finished`` through a
        one-token request that is aborted right after it is added (no step in between), so
        the connector releases whatever those params hold (e.g. a prefill instance's blocks
        kept for a decode that will never come).

        Returns the dummy request's id once the scheduler let go of it. A connector that
        keeps it (a delayed free) until the release is done makes that mean the blocks are
        back: the NixlConnector waits for the prefill side's answer, or gives up after a
        bounded time. Raises EngineStepError past ``timeout`` seconds."""
        if not self.has_kv_connector:
            raise ConfigError("this server runs without a KV connector; nothing to release")
        if not isinstance(kv_transfer_params, dict) or not kv_transfer_params:
            raise ConfigError("kv_transfer_params must be a non-empty JSON object")
        extra = {"kv_transfer_params": dict(kv_transfer_params)}
        params = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)

        def add_and_abort(engine: LLMEngine) -> str:
            rid = f"kv-release-{uuid.uuid4().hex}"
            engine.add_request([0], params, rid)
            engine.abort_request(rid)
            return rid

        rid = await self.call(add_and_abort)
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + timeout, 0.001
        while await self.call(lambda engine: engine.scheduler.get_request(rid) is not None):
            if loop.time() >= deadline:
                raise EngineStepError(
                    f"the KV connector did not complete the release within {timeout:g}s"
                )
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.02)
        return rid

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (requests in flight fail) and shut the engine down."""
        self._core.stop(timeout)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")
