"""The proxy's FastAPI app and ``kvferry proxy``'s entry point (both modes)."""

from __future__ import annotations

import argparse
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvferry.config import ConfigError
from kvferry.entrypoints.metrics import CONTENT_TYPE
from kvferry.entrypoints.openai.http_utils import (
    BodyLimitMiddleware,
    listen_socket,
    read_api_key_file,
    serve_app,
)
from kvferry.entrypoints.openai.limits import ServerLimits
from kvferry.entrypoints.proxy.common import error, normalize_url
from kvferry.entrypoints.proxy.event_subscriber import EventSource
from kvferry.entrypoints.proxy.instances import InstanceProxy
from kvferry.entrypoints.proxy.pd import PDProxy
from kvferry.entrypoints.proxy.router import Router, RouterConfig
from kvferry.entrypoints.proxy.routing_metrics import RoutingMetrics
from kvferry.logger import fmt_fields, init_logger

logger = init_logger(__name__)

Proxy = PDProxy | InstanceProxy


def build_proxy_app(proxy: Proxy, limits: ServerLimits | None = None) -> FastAPI:
    """The proxy's app; clients get the same body size and read-time limits as ``serve``."""
    limits = limits or ServerLimits()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncGenerator[None, None]:
        await proxy.start()
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
        return error(500, f"proxy error: {type(exc).__name__}: {exc}", "internal_server_error")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {"Authorization": a} if (a := proxy.upstream_authorization(request)) else {}
        url = proxy.models_instance()
        role = "decode instance" if isinstance(proxy, PDProxy) else "instance"
        try:
            r = await proxy._http().get(url + "/v1/models", headers=headers, timeout=10.0)
        except httpx.HTTPError as e:
            return error(503, f"{role} {url} is unreachable: {e!r}", "service_unavailable")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.render(), media_type=CONTENT_TYPE)

    return app


def _event_sources(args: argparse.Namespace, urls: list[str]) -> list[EventSource]:
    endpoints = list(getattr(args, "kv_events_endpoint", None) or [])
    replays = list(getattr(args, "kv_replay_endpoint", None) or [])
    if not endpoints:
        if replays:
            raise ConfigError("--kv-replay-endpoint needs --kv-events-endpoint")
        return []
    if len(endpoints) != len(urls) or (replays and len(replays) != len(urls)):
        raise ConfigError(
            f"give one --kv-events-endpoint (and --kv-replay-endpoint, if any) per routed "
            f"instance, in the same order: {len(urls)} instance(s), {len(endpoints)} event "
            f"endpoint(s), {len(replays)} replay endpoint(s)"
        )
    topic = getattr(args, "kv_events_topic", "") or ""
    return [
        EventSource(u, e, replays[i] if replays else None, topic)
        for i, (u, e) in enumerate(zip(urls, endpoints, strict=True))
    ]


def router_config(args: argparse.Namespace, urls: list[str]) -> RouterConfig:
    return RouterConfig(
        policy=getattr(args, "policy", "round_robin") or "round_robin",
        tokenizer=getattr(args, "tokenizer", None),
        events=_event_sources(args, urls),
        hit_weight=getattr(args, "kv_hit_weight", 4.0),
        poll_interval=getattr(args, "load_poll_interval", 1.0),
        index_max_blocks=getattr(args, "kv_index_max_blocks", 200_000),
        hash_algo=getattr(args, "prefix_caching_hash_algo", None),
        block_size=getattr(args, "kv_block_size", 16),
        recent_ttl=getattr(args, "kv_recent_ttl", 10.0),
        shared_media=tuple(getattr(args, "kv_shared_medium", None) or ()),
    )


def make_proxy(args: argparse.Namespace, key: str | None = None) -> Proxy:
    instances = getattr(args, "instance", None) or []
    prefill, decode = args.prefill or [], args.decode or []
    if instances and (prefill or decode):
        raise ConfigError("use either --instance or --prefill/--decode, not both")
    if instances:
        urls = [normalize_url(u) for u in instances]
        return InstanceProxy(urls, router_config(args, urls), args.timeout, key)
    if not prefill or not decode:
        raise ConfigError(
            "the proxy needs --instance URL... (plain instances) or --prefill URL... and "
            "--decode URL... (prefill/decode disaggregation)"
        )
    p_urls = [normalize_url(u) for u in prefill]
    cfg = router_config(args, p_urls)
    proxy = PDProxy(p_urls, decode, timeout=args.timeout, upstream_api_key=key)
    # round_robin without a router keeps the P/D flow exactly as before (nothing polled).
    if cfg.policy != "round_robin" or cfg.events:
        proxy.router = Router(p_urls, cfg, RoutingMetrics(proxy.metrics.registry))
    return proxy


def run_proxy(args: argparse.Namespace) -> int:
    key_file = getattr(args, "upstream_api_key_file", None)
    key = read_api_key_file(key_file, "upstream API key file") if key_file else None
    proxy = make_proxy(args, key)
    sock = listen_socket(args.host, args.port, "kvferry proxy")
    if isinstance(proxy, PDProxy):
        fields = dict(prefill=",".join(proxy.prefill), decode=",".join(proxy.decode))
    else:
        fields = dict(instances=",".join(proxy.instances))
    policy = getattr(args, "policy", "round_robin")
    logger.info(fmt_fields("proxy", policy=policy, **fields))
    limits = ServerLimits()
    app = build_proxy_app(proxy, limits)
    serve_app(app, sock, args.uvicorn_log_level, lifespan="on", limits=limits)
    return 0
