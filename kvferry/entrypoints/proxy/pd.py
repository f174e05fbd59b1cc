"""PDProxy: the prefill/decode (P/D) flow.

For each ``/v1/completions`` or ``/v1/chat/completions`` request:

1. pick a prefill instance (round robin, or the ``--policy``: kv_aware sends a prompt to the
   prefill instance that already holds its prefix) and send it the body with
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
"""

from __future__ import annotations

import asyncio
import itertools
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
    UpstreamError,
    error,
    normalize_url,
    upstream_message,
)
from kvferry.entrypoints.proxy.router import Router
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


class PDProxy(ProxyBase):
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        timeout: float = 600.0,
        upstream_api_key: str | None = None,
        router: Router | None = None,
    ) -> None:
        if not prefill or not decode:
            raise ConfigError("the proxy needs at least one --prefill and one --decode URL")
        super().__init__(timeout, upstream_api_key)
        self.prefill = [normalize_url(u) for u in prefill]
        self.decode = [normalize_url(u) for u in decode]
        self._next_p = itertools.cycle(self.prefill)
        self._next_d = itertools.cycle(self.decode)
        # Without a router: plain round robin over the prefill instances, nothing polled.
        self.router = router
        self._background: set[asyncio.Future[bool]] = set()
        self._warned_no_params = False

    def all_instances(self) -> list[str]:
        return self.prefill + self.decode

    def models_instance(self) -> str:
        return self.decode[0]

    async def start(self) -> None:
        if self.router is not None:
            self.router.start(self._http())

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.router is not None:
            await self.router.close()
        await super().close()

    # -- the P/D flow ---------------------------------------------------------------------------

    async def _pick_prefill(self, body: dict[str, Any], endpoint: str) -> str:
        if self.router is None:
            return next(self._next_p)
        prompt = await self.router.prompt(body, endpoint)
        return self.router.choose(prompt).url

    async def _route(
        self, body: dict[str, Any], endpoint: str, headers: dict[str, str], t0: float
    ) -> Response:
        p_url, d_url = await self._pick_prefill(body, endpoint), next(self._next_d)
        if self.router is not None:
            self.router.loads.begin(p_url)
        try:
            kv_params = await self._prefill(p_url, body, endpoint, headers)
        except UpstreamError as e:
            self.metrics.requests.labels(endpoint, "prefill_error").inc()
            return e.response
        finally:
            if self.router is not None:
                self.router.loads.end(p_url)
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
            return error(status, message, "service_unavailable" if status == 503 else "bad_gateway")

        try:
            resp = await http.send(req, stream=True)
        except NOT_SENT as e:
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
            msg = (
                f"decode instance {d_url} failed (HTTP {resp.status_code}): "
                f"{upstream_message(content)}"
            )
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
            raise UpstreamError(
                error(503, f"prefill instance {p_url} timed out: {e!r}", "service_unavailable")
            ) from None
        except httpx.HTTPError as e:
            self.metrics.upstream_errors.labels("prefill", p_url).inc()
            if self.router is not None and isinstance(e, NOT_SENT):
                self.router.loads.mark_down(p_url)
            raise UpstreamError(
                error(503, f"prefill instance {p_url} is unreachable: {e!r}", "service_unavailable")
            ) from None
        if 400 <= resp.status_code < 500:
            raise UpstreamError(
                Response(resp.content, resp.status_code, media_type="application/json")
            )
        if resp.status_code != 200:
            self.metrics.upstream_errors.labels("prefill", p_url).inc()
            msg = (
                f"prefill instance {p_url} failed (HTTP {resp.status_code}): "
                f"{upstream_message(resp.content)}"
            )
            raise UpstreamError(error(502, msg, "bad_gateway"))
        try:
            params = resp.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            raise UpstreamError(
                error(502, f"prefill instance {p_url} sent a malformed answer", "bad_gateway")
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
