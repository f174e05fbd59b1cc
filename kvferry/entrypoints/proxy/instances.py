"""InstanceProxy: one pool of plain instances (``--instance``), each request served whole by
the one the routing policy picks.

The body goes on unchanged and the answer comes back as it is (JSON, or the SSE stream byte
for byte). An instance that refuses the connection certainly never saw the request: it is
marked down and the request goes to the next pick (each instance tried at most once). Other
failures: 503 when none could be reached, 502 for a 5xx or a broken answer, 504 for a read
timeout, a 4xx passed through.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

import httpx
from fastapi.responses import Response

from kvferry.config import ConfigError
from kvferry.entrypoints.openai.http_utils import (
    EventStream,
    SSEResponse,
    error_body,
    sse,
)
from kvferry.entrypoints.proxy.common import (
    NOT_SENT,
    ProxyBase,
    error,
    normalize_url,
    upstream_message,
)
from kvferry.entrypoints.proxy.router import Router, RouterConfig
from kvferry.entrypoints.proxy.routing_metrics import RoutingMetrics


class InstanceProxy(ProxyBase):
    def __init__(
        self,
        instances: list[str],
        config: RouterConfig | None = None,
        timeout: float = 600.0,
        upstream_api_key: str | None = None,
    ) -> None:
        if not instances:
            raise ConfigError("the proxy needs at least one --instance URL")
        super().__init__(timeout, upstream_api_key)
        self.instances = [normalize_url(u) for u in instances]
        self.routing_metrics = RoutingMetrics(self.metrics.registry)
        self.router = Router(self.instances, config or RouterConfig(), self.routing_metrics)

    def all_instances(self) -> list[str]:
        return self.instances

    def models_instance(self) -> str:
        return next((u for u in self.instances if self.router.loads.up(u)), self.instances[0])

    async def start(self) -> None:
        self.router.start(self._http())

    async def close(self) -> None:
        await self.router.close()
        await super().close()

    async def _route(
        self, body: dict[str, Any], endpoint: str, headers: dict[str, str], t0: float
    ) -> Response:
        router, http = self.router, self._http()
        prompt = await router.prompt(body, endpoint)
        tried: list[str] = []
        refused = ""
        while len(tried) < len(self.instances):
            url = router.choose(prompt, avoid=tried).url
            tried.append(url)
            router.loads.begin(url)
            req = http.build_request("POST", url + endpoint, json=body, headers=headers)
            try:
                resp = await http.send(req, stream=True)
            except NOT_SENT as e:
                router.loads.end(url)
                router.loads.mark_down(url)
                self.metrics.upstream_errors.labels("instance", url).inc()
                refused = f"instance {url} is unreachable: {e!r}"
                continue
            except httpx.HTTPError as e:
                router.loads.end(url)
                return self._fail(endpoint, url, 504, f"instance {url} did not answer: {e!r}")
            return await self._answer(resp, url, endpoint, bool(body.get("stream")), t0)
        return self._fail(endpoint, tried[-1], 503, refused or "no instance reachable")

    def _fail(self, endpoint: str, url: str, status: int, message: str) -> Response:
        self.metrics.upstream_errors.labels("instance", url).inc()
        self.metrics.requests.labels(endpoint, "instance_error").inc()
        kind = "service_unavailable" if status == 503 else "bad_gateway"
        return error(status, message, kind)

    async def _answer(
        self, resp: httpx.Response, url: str, endpoint: str, stream: bool, t0: float
    ) -> Response:
        done = self.router.loads.end
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            done(url)
            if 400 <= resp.status_code < 500:
                self.metrics.requests.labels(endpoint, "client_error").inc()
                return Response(content, resp.status_code, media_type="application/json")
            msg = f"instance {url} failed (HTTP {resp.status_code}): {upstream_message(content)}"
            return self._fail(endpoint, url, 502, msg)
        self.metrics.ttft.observe(time.perf_counter() - t0)
        if not stream:
            try:
                content = await resp.aread()
            except httpx.HTTPError as e:
                status = 504 if isinstance(e, httpx.TimeoutException) else 502
                return self._fail(endpoint, url, status, f"instance {url} broke off: {e!r}")
            finally:
                await resp.aclose()
                done(url)
            self.metrics.requests.labels(endpoint, "ok").inc()
            return Response(content, 200, media_type="application/json")
        self.metrics.requests.labels(endpoint, "ok").inc()
        finished = False

        async def cleanup() -> None:
            nonlocal finished
            await resp.aclose()
            if not finished:
                finished = True
                done(url)

        return SSEResponse(EventStream(self._relay(resp, url), cleanup))

    async def _relay(self, resp: httpx.Response, url: str) -> AsyncGenerator[bytes | str, None]:
        try:
            async for chunk in resp.aiter_bytes():
                yield chunk
        except httpx.HTTPError as e:
            self.metrics.upstream_errors.labels("instance", url).inc()
            yield sse(
                error_body(
                    f"instance {url} broke off the stream: {e!r}", "service_unavailable", None, 502
                )
            )
            yield sse("[DONE]")
