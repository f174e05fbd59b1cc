"""What both proxies share: instance URLs, error bodies, the upstream HTTP client and its
authorization, and ``/health`` over every instance."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvferry.config import ConfigError
from kvferry.entrypoints.metrics import ProxyMetrics
from kvferry.entrypoints.openai.http_utils import error_body, unless_disconnected

# The instance certainly did not get (or is done with) the request: release / retry is safe.
NOT_SENT = (
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


def error(status: int, message: str, err_type: str) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, None, status), status_code=status)


def upstream_message(resp_body: bytes) -> str:
    try:
        return str(json.loads(resp_body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp_body[:200].decode(errors="replace")


class UpstreamError(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


def parse_body(raw: bytes) -> dict | JSONResponse:
    try:
        body = json.loads(raw)
    except ValueError as e:
        return error(400, f"the request body is not valid JSON: {e}", "invalid_request_error")
    if not isinstance(body, dict):
        return error(400, "the request body must be a JSON object", "invalid_request_error")
    return body


class ProxyBase:
    """The upstream client, the proxy's metrics and its health check."""

    def __init__(self, timeout: float, upstream_api_key: str | None) -> None:
        self._upstream_auth = f"Bearer {upstream_api_key}" if upstream_api_key else None
        self.timeout = timeout
        self.metrics = ProxyMetrics()
        self.client: httpx.AsyncClient | None = None

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

    def all_instances(self) -> list[str]:
        raise NotImplementedError

    def models_instance(self) -> str:
        """The instance that answers ``/v1/models``."""
        raise NotImplementedError

    async def start(self) -> None:
        """Background work (load polling, KV events), on the app's event loop."""

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def handle(self, request: Request, endpoint: str) -> Response:
        body = parse_body(await request.body())
        if isinstance(body, Response):
            return body
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
    ) -> Response | None:
        """Serve one parsed request (``t0``: when it arrived, for the proxy's TTFT)."""
        raise NotImplementedError

    async def health(self) -> Response:
        async def probe(url: str) -> tuple[str, bool]:
            try:
                r = await self._http().get(url + "/health", timeout=3.0)
                return url, r.status_code == 200
            except httpx.HTTPError:
                return url, False

        urls: Sequence[str] = list(dict.fromkeys(self.all_instances()))
        results = dict(await asyncio.gather(*(probe(u) for u in urls)))
        down = [u for u, ok in results.items() if not ok]
        if down:
            return error(503, f"instances down: {', '.join(down)}", "service_unavailable")
        return JSONResponse({"status": "ok", "instances": results})
