"""``kvferry proxy``: the prefill/decode (P/D) router in front of kvferry servers.

For each ``/v1/completions`` or ``/v1/chat/completions`` request:

1. pick a prefill instance (round robin) and send it the body with
   ``kv_transfer_params = {"do_remote_decode": true, ...}``, ``max_tokens = 1`` and
   ``stream = false``; its KV connector keeps the prompt's KV and returns, in the response's
   top-level ``kv_transfer_params``, where a decode instance can fetch it;
2. pick a decode instance (round robin, separately) and send it the ORIGINAL body with those
   ``kv_transfer_params``; relay its answer (JSON, or the SSE stream byte for byte).

Failures: an unreachable instance -> 503, an instance answering 5xx -> 502, 4xx -> passed
through; all with OpenAI's error shape. When the prefill succeeded but the decode instance
certainly never ran the request, or is finished with it (could not connect, answered an error,
or broke off mid-stream), the proxy sends the prefill's ``kv_transfer_params`` back to that
prefill instance's ``POST /v1/kv/release`` so its held blocks are freed now. It does not do so
when the client disconnects or a read times out: the decode instance may still be reading those
blocks; it aborts the request itself, and the connector's lease frees the prefill side.
``/health`` checks every instance; ``/metrics`` has the proxy's own counters.

Upstream authentication: with ``--upstream-api-key-file FILE`` every call to an instance
(prefill, decode, release, models) carries ``Authorization: Bearer <the file's content>``
instead of whatever the client sent, so the instances' ``--api-key`` also covers the proxy's
releases. Without it the client's ``Authorization`` header is passed on as is.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvferry.config import ConfigError
from kvferry.entrypoints.metrics import CONTENT_TYPE, ProxyMetrics
from kvferry.entrypoints.openai.http_utils import (
    BodyLimitMiddleware,
    EventStream,
    SSEResponse,
    error_body,
    listen_socket,
    read_api_key_file,
    serve_app,
    sse,
    unless_disconnected,
)
from kvferry.entrypoints.openai.limits import ServerLimits
from kvferry.logger import fmt_fields, init_logger

logger = init_logger(__name__)

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# The decode instance certainly did not get (or is done with) the request: release is safe.
_NOT_SENT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url:
        raise ConfigError("an instance URL must not be empty")
    return url if "://" in url else f"http://{url}"


def _error(status: int, message: str, err_type: str) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, None, status), status_code=status)


def _message(resp_body: bytes) -> str:
    try:
        return str(json.loads(resp_body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp_body[:200].decode(errors="replace")


class _UpstreamError(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


class PDProxy:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        timeout: float = 600.0,
        upstream_api_key: str | None = None,
    ) -> None:
        if not prefill or not decode:
            raise ConfigError("the proxy needs at least one --prefill and one --decode URL")
        self._upstream_auth = f"Bearer {upstream_api_key}" if upstream_api_key else None
        self.prefill = [normalize_url(u) for u in prefill]
        self.decode = [normalize_url(u) for u in decode]
        self._next_p = itertools.cycle(self.prefill)
        self._next_d = itertools.cycle(self.decode)
        self.timeout = timeout
        self.metrics = ProxyMetrics()
        self.client: httpx.AsyncClient | None = None
        self._background: set[asyncio.Future[bool]] = set()
        self._warned_no_params = False

    def upstream_authorization(self, request: Request) -> str | None:
        """The Authorization header for calls to the instances on behalf of ``request``."""
        return self._upstream_auth or request.headers.get("authorization")

    def _http(self) -> httpx.AsyncClient:
        if self.client is None:
            # trust_env=False: instances are reached directly, never through an HTTP proxy.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self.client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout, connect=5.0), limits=limits, trust_env=False
            )
        return self.client

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    # -- the P/D flow ---------------------------------------------------------------------------

    async def handle(self, request: Request, endpoint: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:
            return _error(400, f"the request body is not valid JSON: {e}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        headers = {"X-Request-Id": request.headers.get("x-request-id") or uuid.uuid4().hex}
        if auth := self.upstream_authorization(request):
            headers["Authorization"] = auth
        finished, result = await unless_disconnected(
            request, self._route(body, endpoint, headers, time.perf_counter())
        )
        if not finished or result is None:
            self.metrics.requests.labels(endpoint, "disconnected").inc()
            return Response(status_code=499)
        return result

    async def _route(
        self, body: dict[str, Any], endpoint: str, headers: dict[str, str], t0: float
    ) -> Response:
        p_url, d_url = next(self._next_p), next(self._next_d)
        try:
            kv_params = await self._prefill(p_url, body, endpoint, headers)
        except _UpstreamError as e:
            self.metrics.requests.labels(endpoint, "prefill_error").inc()
            return e.response
        self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        d_body = dict(body)
        if kv_params is not None:
            d_body["kv_transfer_params"] = kv_params
        stream = bool(body.get("stream"))
        http = self._http()
        req = http.build_request("POST", d_url + endpoint, json=d_body, headers=headers)

        def fail(status: int, message: str, release: bool = True) -> Response:
            self.metrics.upstream_errors.labels("decode", d_url).inc()
            self.metrics.requests.labels(endpoint, "decode_error").inc()
            if release:
                self._release_later(p_url, kv_params, headers)
            return _error(
                status, message, "service_unavailable" if status == 503 else "bad_gateway"
            )

        try:
            resp = await http.send(req, stream=True)
        except _NOT_SENT as e:
            return fail(503, f"decode instance {d_url} is unreachable: {e!r}")
        except httpx.HTTPError as e:  # e.g. a read timeout: it may still be reading the KV
            return fail(504, f"decode instance {d_url} did not answer: {e!r}", release=False)
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            if 400 <= resp.status_code < 500:
                self.metrics.requests.labels(endpoint, "client_error").inc()
                self._release_later(p_url, kv_params, headers)
                return Response(content, resp.status_code, media_type="application/json")
            msg = f"decode instance {d_url} failed (HTTP {resp.status_code}): {_message(content)}"
            return fail(502, msg)
        self.metrics.ttft.observe(time.perf_counter() - t0)
        if not stream:
            try:
                content = await resp.aread()
            except (httpx.ReadError, httpx.RemoteProtocolError) as e:
                return fail(502, f"decode instance {d_url} broke off: {e!r}")
            except httpx.HTTPError as e:
                return fail(504, f"decode instance {d_url} did not finish: {e!r}", release=False)
            finally:
                await resp.aclose()
            self.metrics.requests.labels(endpoint, "ok").inc()
            return Response(content, 200, media_type="application/json")
        self.metrics.requests.labels(endpoint, "ok").inc()
        return SSEResponse(
            EventStream(self._relay(resp, d_url, p_url, kv_params, headers), resp.aclose)
        )

    async def _prefill(
        self, p_url: str, body: dict[str, Any], endpoint: str, headers: dict[str, str]
    ) -> dict[str, Any] | None:
        p_body = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        p_body.update(kv_transfer_params=dict(PREFILL_KV_PARAMS), stream=False, max_tokens=1)
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        try:
            resp = await self._http().post(p_url + endpoint, json=p_body, headers=headers)
        except httpx.TimeoutException as e:
            self.metrics.upstream_errors.labels("prefill", p_url).inc()
            raise _UpstreamError(
                _error(503, f"prefill instance {p_url} timed out: {e!r}", "service_unavailable")
            ) from None
        except httpx.HTTPError as e:
            self.metrics.upstream_errors.labels("prefill", p_url).inc()
            raise _UpstreamError(
                _error(
                    503, f"prefill instance {p_url} is unreachable: {e!r}", "service_unavailable"
                )
            ) from None
        if 400 <= resp.status_code < 500:
            raise _UpstreamError(
                Response(resp.content, resp.status_code, media_type="application/json")
            )
        if resp.status_code != 200:
            self.metrics.upstream_errors.labels("prefill", p_url).inc()
            msg = f"prefill instance {p_url} failed (HTTP {resp.status_code}): {_message(resp.content)}"
            raise _UpstreamError(_error(502, msg, "bad_gateway"))
        try:
            params = resp.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            raise _UpstreamError(
                _error(502, f"prefill instance {p_url} sent a malformed answer", "bad_gateway")
            ) from None
        if not isinstance(params, dict):
            if not self._warned_no_params:
                logger.warning(
                    "prefill instance %s returned no kv_transfer_params (is it started with a KV "
                    "connector, kv_role kv_producer or kv_both?); decode will recompute",
                    p_url,
                )
                self._warned_no_params = True
            return None
        return params

    async def _relay(
        self,
        resp: httpx.Response,
        d_url: str,
        p_url: str,
        kv_params: dict[str, Any] | None,
        headers: dict[str, str],
    ) -> AsyncGenerator[bytes | str, None]:
        try:
            async for chunk in resp.aiter_bytes():
                yield chunk
        except httpx.HTTPError as e:
            self.metrics.upstream_errors.labels("decode", d_url).inc()
            # Broke off: it is done with the prefill's KV. A timeout: it may still be reading.
            if isinstance(e, (httpx.ReadError, httpx.RemoteProtocolError)):
                self._release_later(p_url, kv_params, headers)
            msg = f"decode instance {d_url} broke off the stream: {e!r}"
            yield sse(error_body(msg, "service_unavailable", None, 502))
            yield sse("[DONE]")
        finally:
            await resp.aclose()

    # -- releasing held prefill KV --------------------------------------------------------------

    def _release_later(
        self, p_url: str, kv_params: dict[str, Any] | None, headers: dict[str, str]
    ) -> None:
        if kv_params is None:
            return
        task = asyncio.ensure_future(self.release(p_url, kv_params, headers))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def release(
        self, p_url: str, kv_params: dict[str, Any], headers: dict[str, str] | None = None
    ) -> bool:
        """Ask the prefill instance to free what it holds for ``kv_params``."""
        body = {"kv_transfer_params": kv_params}
        try:
            resp = await self._http().post(
                p_url + "/v1/kv/release", json=body, headers=headers, timeout=10.0
            )
            ok = resp.status_code == 200
        except httpx.HTTPError as e:
            ok, resp = False, None
            logger.warning(fmt_fields("kv release failed", instance=p_url, error=repr(e)))
        if resp is not None and not ok:
            logger.warning(
                fmt_fields("kv release refused", instance=p_url, status=resp.status_code)
            )
        self.metrics.releases.labels("ok" if ok else "failed").inc()
        return ok

    async def health(self) -> Response:
        async def probe(url: str) -> tuple[str, bool]:
            try:
                r = await self._http().get(url + "/health", timeout=3.0)
                return url, r.status_code == 200
            except httpx.HTTPError:
                return url, False

        urls = list(dict.fromkeys(self.prefill + self.decode))
        results = dict(await asyncio.gather(*(probe(u) for u in urls)))
        down = [u for u, ok in results.items() if not ok]
        if down:
            return _error(503, f"instances down: {', '.join(down)}", "service_unavailable")
        return JSONResponse({"status": "ok", "instances": results})


def build_proxy_app(proxy: PDProxy, limits: ServerLimits | None = None) -> FastAPI:
    """The proxy's app; clients get the same body size and read-time limits as ``serve``."""
    limits = limits or ServerLimits()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncGenerator[None, None]:
        yield
        await proxy.close()

    app = FastAPI(title="kvferry proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=limits.max_request_body_bytes,
        timeout_s=limits.body_read_timeout,
    )

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("proxy error")
        return _error(500, f"proxy error: {type(exc).__name__}: {exc}", "internal_server_error")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {"Authorization": a} if (a := proxy.upstream_authorization(request)) else {}
        url = proxy.decode[0]
        try:
            r = await proxy._http().get(url + "/v1/models", headers=headers, timeout=10.0)
        except httpx.HTTPError as e:
            return _error(
                503, f"decode instance {url} is unreachable: {e!r}", "service_unavailable"
            )
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.render(), media_type=CONTENT_TYPE)

    return app


def run_proxy(args: argparse.Namespace) -> int:
    key_file = getattr(args, "upstream_api_key_file", None)
    key = read_api_key_file(key_file, "upstream API key file") if key_file else None
    proxy = PDProxy(args.prefill, args.decode, timeout=args.timeout, upstream_api_key=key)
    sock = listen_socket(args.host, args.port, "kvferry proxy")
    logger.info(fmt_fields("proxy", prefill=",".join(proxy.prefill), decode=",".join(proxy.decode)))
    limits = ServerLimits()
    app = build_proxy_app(proxy, limits)
    serve_app(app, sock, args.uvicorn_log_level, lifespan="on", limits=limits)
    return 0
