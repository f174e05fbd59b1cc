"""HTTP pieces shared by the server and the P/D proxy (no engine imports, so the proxy stays
light): OpenAI error bodies, SSE events and responses, disconnect handling, request body
limits, sockets, uvicorn (with a guard against clients that send their headers slowly)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvferry.config import ConfigError
from kvferry.entrypoints.openai.limits import ServerLimits

T = TypeVar("T")


def error_body(message: str, err_type: str, param: str | None, code: int | str | None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    err_type: str,
    param: str | None = None,
    code: Any = None,
    close: bool = False,
) -> JSONResponse:
    """OpenAI's error body; ``close`` ends the connection after it (the client may still be
    sending a body nobody will read)."""
    headers = {"connection": "close"} if close else None
    body = error_body(message, err_type, param, code or status)
    return JSONResponse(body, status_code=status, headers=headers)


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


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


# After refusing a body, read on (and drop) this long at most before answering, so that the
# client, which may still be sending, reads the answer instead of a connection reset.
_DRAIN_S = 1.0


class BodyLimitMiddleware:
    """Reads each request body before the app runs: at most ``max_bytes`` (else 413, and a
    declared ``Content-Length`` over the limit is refused before any of it is read) and all of
    it within ``timeout_s`` of the request head (else 408). The app then gets the body as one
    message; its later ``receive()`` calls go to the server (they report the disconnect)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        try:
            if declared is not None and int(declared) > self.max_bytes:
                raise _BodyTooLarge
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except _ClientGone:
            return
        except _BodyTooLarge:
            with contextlib.suppress(_ClientGone, asyncio.TimeoutError):
                await asyncio.wait_for(self._drain(receive), _DRAIN_S)
            msg = f"the request body is larger than the limit of {self.max_bytes} bytes"
            # No close here: closing with the rest of a big body unread resets the connection,
            # and the client would never read the 413.
            await error_response(413, msg, "invalid_request_error")(scope, receive, send)
            return
        except asyncio.TimeoutError:
            msg = f"the request body did not arrive within {self.timeout_s:g} s"
            await error_response(408, msg, "invalid_request_error", close=True)(
                scope, receive, send
            )
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _drain(self, receive: Receive) -> None:
        left = self.max_bytes
        while left > 0:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            left -= len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def guarded_h11_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, plus a deadline for each request head: a connection that has
    not sent a complete head ``header_timeout_s`` after it connected (or after its previous
    response) is closed. uvicorn alone waits forever for a head that trickles in, or for the
    first byte of a new connection."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a complete head started a new request
                self._disarm_head_timer()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is cycle and not self.transport.is_closing():
                self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


def read_api_key_file(path: str, what: str = "API key file") -> str:
    """The API key in ``path`` (surrounding whitespace stripped); ConfigError if unusable."""
    try:
        with open(path, "rb") as f:
            data = f.read(4097)
    except OSError as e:
        raise ConfigError(f"cannot read the {what} {path!r}: {e.strerror}") from None
    try:
        key = data.decode().strip()
    except UnicodeDecodeError:
        key = ""
    if not key or len(data) > 4096 or any(c.isspace() for c in key):
        raise ConfigError(f"the {what} {path!r} must hold one key (text, no spaces, <= 4 KiB)")
    return key


def listen_socket(host: str, port: int, what: str) -> socket.socket:
    """A bound, listening socket (port 0: any free port); ConfigError if that fails. Prints
    ``WHAT listening on http://HOST:PORT`` (connections wait in the backlog until served)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections of a socket
        # whose proto says TCP. Without it Nagle's algorithm holds a response's body behind
        # its headers until the client's delayed ACK (~40 ms on every non-streamed answer).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
    limits: ServerLimits | None = None,
) -> None:
    """Run uvicorn on ``sock`` until SIGINT/SIGTERM; ``limits`` sets the connection timeouts
    and the concurrency limit (the body limits are :class:`BodyLimitMiddleware`'s)."""
    import uvicorn

    extra: dict[str, Any] = {}
    if limits is not None:
        extra = {
            "http": guarded_h11_protocol(limits.header_timeout),
            "timeout_keep_alive": limits.timeout_keep_alive,
            "limit_concurrency": limits.limit_concurrency,
        }
    config = uvicorn.Config(
        app, log_level=log_level, timeout_graceful_shutdown=5, lifespan=lifespan, **extra
    )
    uvicorn.Server(config).run(sockets=[sock])
