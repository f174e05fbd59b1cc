"""``kvferry serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncLLM.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE streams),
``GET /v1/models``, ``POST /v1/kv/release``, ``GET /health``, ``GET /metrics``, and vLLM's
``GET /version``, ``POST /tokenize``, ``POST /detokenize`` (same fields as vLLM's).

``POST /v1/kv/release`` with ``{"kv_transfer_params": {...}}`` hands params that a prefill
instance returned back to *its* KV connector, so blocks it holds for a decode that will never
come are freed now instead of at lease expiry. The server keeps no state for it: the params go
into a one-token request that is aborted as soon as it is added (vLLM's "abort immediately"),
so the connector's ``request_finished`` sees them on an aborted, never-scheduled request (a
``do_remote_prefill`` request that never loaded) and must release the remote side they name,
even when that remote side is this very instance; releasing twice must be harmless.

Errors always have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: bad
bodies and values 400, bad API key 401, unknown model 404, body not sent in time 408, body too
large 413, engine failure 500, dead engine 503. A client that disconnects aborts its requests.
Routes under ``/v1`` need ``--api-key`` when set (checked before the body is read). Bodies are
read under :class:`ServerLimits` and parsed off the event loop.
"""

from __future__ import annotations

import argparse
import secrets
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvferry import envs
from kvferry.config import ConfigError
from kvferry.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from kvferry.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from kvferry.entrypoints.openai.http_utils import (
    BodyLimitMiddleware,
    EventStream,
    SSEResponse,
    listen_socket,
    read_api_key_file,
    serve_app,
    unless_disconnected,
)
from kvferry.entrypoints.openai.http_utils import error_response as _error
from kvferry.entrypoints.openai.limits import ServerLimits
from kvferry.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    KVReleaseRequest,
    TokenizeRequest,
    parse_body,
    validation_message,
)
from kvferry.entrypoints.openai.serving import (
    ModelNotFoundError,
    OpenAIServing,
    RequestFailedError,
)
from kvferry.logger import init_logger
from kvferry.version import __version__

logger = init_logger(__name__)
M = TypeVar("M", bound=BaseModel)


class ApiKeyMiddleware:
    """Plain ASGI (no BaseHTTPMiddleware, which would get in the way of streaming)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                msg = "Incorrect API key provided."
                resp = _error(401, msg, "invalid_request_error", None, "invalid_api_key")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _respond(request: Request, work: Awaitable[dict | EventStream]) -> Response:
    finished, result = await unless_disconnected(request, work)
    if not finished or result is None:
        return Response(status_code=499)  # nobody is listening any more
    if isinstance(result, dict):
        return JSONResponse(result)
    return SSEResponse(result)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        # Locations start with where the value came from ("body", "query"): drop that part.
        errors = [{**e, "loc": tuple(e.get("loc", ()))[1:]} for e in exc.errors()]
        msg, param = validation_message(errors)
        return _error(400, msg, "invalid_request_error", param)

    @app.exception_handler(ConfigError)
    async def _config(_: Request, exc: ConfigError) -> Response:
        return _error(400, str(exc), "invalid_request_error", getattr(exc, "param", None))

    @app.exception_handler(ModelNotFoundError)
    async def _model(_: Request, exc: ModelNotFoundError) -> Response:
        return _error(404, str(exc), "invalid_request_error", "model", "model_not_found")

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> Response:
        return _error(503, f"the engine is unavailable: {exc}", "service_unavailable")

    @app.exception_handler(EngineStepError)
    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, exc: Exception) -> Response:
        return _error(500, str(exc), "internal_server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return _error(500, f"internal error: {type(exc).__name__}", "internal_server_error")


def build_app(
    llm: AsyncLLM,
    served_model_name: str,
    metrics: ServerMetrics,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    limits = limits or ServerLimits()
    app = FastAPI(title="kvferry", docs_url=None, redoc_url=None, openapi_url=None)
    serving = OpenAIServing(llm, served_model_name, limits)
    app.state.serving = serving
    _install_error_handlers(app)
    # The last one added runs first: the key is checked before any body is read.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=limits.max_request_body_bytes,
        timeout_s=limits.body_read_timeout,
    )
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    async def parse(request: Request, model: type[M]) -> M:
        return await serving.offload(parse_body, await request.body(), model)

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_alive:
            reason = llm.dead_reason or "it is shut down"
            return _error(503, f"the engine is dead: {reason}", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(serving.models())

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await parse(request, TokenizeRequest)
        return JSONResponse(await serving.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await parse(request, DetokenizeRequest)
        return JSONResponse(await serving.detokenize(body))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        return await _respond(request, serving.create_completion(body))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        return await _respond(request, serving.create_chat_completion(body))

    @app.post("/v1/kv/release")
    async def release(request: Request) -> Response:
        body = await parse(request, KVReleaseRequest)
        request_id = await llm.release_kv_transfer(body.kv_transfer_params)
        return JSONResponse({"released": True, "request_id": request_id})

    return app


def _publisher_stats(llm: AsyncLLM) -> Any:
    """The KV event publisher's ``PublisherStats`` (read at scrape time), None without one."""
    publisher = llm.engine.scheduler.kv_event_publisher
    stats = getattr(publisher, "stats", None)
    return stats() if stats is not None else None


def resolve_api_key(flag: str | None, key_file: str | None) -> str | None:
    """The server's API key: ``--api-key``, else ``--api-key-file``, else ``KVFERRY_API_KEY``
    (vLLM's ``VLLM_API_KEY`` in kvferry's name); at most one of the two flags."""
    if flag and key_file:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if key_file:
        return read_api_key_file(key_file)
    return flag or envs.api_key()


def run_server(args: argparse.Namespace) -> int:
    from kvferry.engine.arg_utils import EngineArgs

    config = EngineArgs.from_cli_args(args).create_engine_config()
    limits = ServerLimits.from_cli_args(args)
    api_key = resolve_api_key(args.api_key, getattr(args, "api_key_file", None))
    name = args.served_model_name or args.model
    sock = listen_socket(args.host, args.port, "kvferry serve")
    metrics = ServerMetrics(name, config)
    llm = AsyncLLM(config, observer=metrics, stream_interval=getattr(args, "stream_interval", 1))
    kvc = llm.engine.kv_cache_config
    metrics.attach(
        lambda: llm.snapshot, kvc.bytes_per_block / kvc.block_size, lambda: _publisher_stats(llm)
    )
    app = build_app(llm, name, metrics, api_key, limits)
    try:
        serve_app(app, sock, args.uvicorn_log_level, limits=limits)
    finally:
        app.state.serving.shutdown()
        llm.shutdown()
    return 0
