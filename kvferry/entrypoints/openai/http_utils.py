"""HTTP pieces shared by the server and the P/D proxy (no engine imports, so the proxy stays
light): OpenAI error bodies, SSE events and responses, disconnect handling, sockets, uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvferry.config import ConfigError

T = TypeVar("T")


def error_body(message: str, err_type: str, param: str | None, code: int | str | None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(
    status: int, message: str, err_type: str, param: str | None = None, code: Any = None
) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, param, code or status), status_code=status)


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: {...}\\n\\n``."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class EventStream:
    """SSE chunks from ``gen``; ``aclose()`` also runs ``cleanup``, even when iteration never
    started (an async generator that never ran would skip its own ``finally``)."""

    def __init__(
        self, gen: AsyncGenerator[str | bytes, None], cleanup: Callable[[], Awaitable[Any]]
    ) -> None:
        self._gen = gen
        self._cleanup = cleanup

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> str | bytes:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        finally:
            await self._cleanup()


class SSEResponse(StreamingResponse):
    """An event stream that is always closed, so a client that disconnects (in whichever way
    the ASGI server reports it) aborts the work behind it."""

    def __init__(self, events: EventStream) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already; the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work`` unless the client leaves first; then cancel it (which aborts) and
    return ``(False, None)``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False, None


def listen_socket(host: str, port: int, what: str) -> socket.socket:
    """A bound, listening socket (port 0: any free port); ConfigError if that fails. Prints
    ``WHAT listening on http://HOST:PORT`` (connections wait in the backlog until served)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except (OSError, OverflowError) as e:
        reason = getattr(e, "strerror", None) or e
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}") from None
    bound_host, bound_port = sock.getsockname()[:2]
    print(f"{what} listening on http://{bound_host}:{bound_port}", flush=True)
    return sock


def serve_app(
    app: FastAPI,
    sock: socket.socket,
    log_level: str = "warning",
    lifespan: Literal["auto", "on", "off"] = "off",
) -> None:
    """Run uvicorn on ``sock`` until SIGINT/SIGTERM."""
    import uvicorn

    config = uvicorn.Config(
        app, log_level=log_level, timeout_graceful_shutdown=5, lifespan=lifespan
    )
    uvicorn.Server(config).run(sockets=[sock])
