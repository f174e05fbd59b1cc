"""SharedCluster: ``kvferry serve`` instances sharing KV through a Mooncake Store, behind the
KV-aware proxy, on localhost (what ``kvferry demo shared`` and its end-to-end test run).

Each instance runs a MultiConnector chain: the engine's own pool, then host memory
(``OffloadingConnector``), then the shared store (``MooncakeStoreConnector``) on one
``mooncake_master`` whose standalone storage client holds the store's memory, so stored KV
outlives every engine. The first child with a hit loads a request and every child stores,
so a prompt one instance computed is, on that instance, a host-tier hit once its pool
dropped it, and on every other instance a store hit.

The proxy (``--policy kv_aware``) follows every instance's KV events. The store's events
carry medium ``"cpu"`` (the host tier's are ``"CPU"``), and ``--kv-shared-medium cpu`` makes
a block announced there count for every instance.

:meth:`SharedCluster.ask` sends one greedy completion and says which instance served it,
why the proxy chose it (``kvferry_proxy_routing_decisions_total``), and where its prompt's
cached tokens came from (``vllm:prompt_tokens_cached_by_source_total``: ``device`` is the
engine pool, ``host`` the host tier, ``external_unspecified`` the store).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvferry.config import ConfigError
from kvferry.entrypoints.demo.processes import (
    Instance,
    connector_stats,
    scrape,
    start,
    stop,
    wait_healthy,
    wait_listening,
)

# The tier of each ``vllm:prompt_tokens_cached_by_source`` source in this chain.
TIERS = {"device": "pool", "host": "host", "external_unspecified": "store"}
STORE_CHILD = "1.MooncakeStoreConnector"
MEDIUM_STORE = "cpu"  # MooncakeStoreConnector's event medium (the host tier's is "CPU")


def free_port() -> int:
    """A loopback port nobody listens on now (bound, then closed): a server restarted on it
    keeps its address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chain_kv_config(
    store_client: dict[str, Any], blocks_per_chunk: int = 2, host_bytes: int = 64 << 20
) -> dict[str, Any]:
    """The MultiConnector chain: host memory first (the nearer tier answers first), then the
    store (``store_client``: Mooncake client settings, as ``MooncakeMaster.config()``)."""
    store_options = {**store_client, "blocks_per_chunk": blocks_per_chunk,
                     "lookup_timeout_s": 5.0, "reconnect_interval_s": 0.5}  # fmt: skip
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        # A store that fails a load costs a recompute, never the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_connector_extra_config": {
                        "cpu_bytes_to_use": host_bytes,
                        "blocks_per_chunk": blocks_per_chunk,
                    },
                },
                {
                    "kv_connector": "MooncakeStoreConnector",
                    "kv_connector_extra_config": store_options,
                },  # fmt: skip
            ]
        },
    }


@dataclass
class Served:
    """One answered request: who served it, why, and where its cached prompt tokens were."""

    instance: str  # the serving instance's name ("a", "b", ...)
    reason: str  # the proxy's routing reason ("" when sent to the instance directly)
    token_ids: list[int]
    cached: dict[str, int] = field(default_factory=dict)  # tier ("pool"/"host"/"store") -> n

    def describe(self) -> str:
        tiers = ", ".join(f"{n} from {t}" for t, n in self.cached.items() if n) or "none"
        via = f"proxy -> {self.instance} ({self.reason})" if self.reason else self.instance
        return f"{via}; cached prompt tokens: {tiers}"


@dataclass
class _Server:
    name: str
    http: int
    events: int
    replay: int
    inst: Instance | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"


class SharedCluster:
    """A master, ``n`` chained instances (``a``, ``b``, ...), an optional plain reference
    instance, and the KV-aware proxy. Use as a context manager: everything it started is
    stopped on exit, on failure too."""

    def __init__(
        self,
        model: Path,
        log_dir: Path,
        server_args: list[str],
        n: int = 2,
        reference: bool = True,
        env: dict[str, str] | None = None,
        blocks_per_chunk: int = 2,
        store_bytes: int = 256 << 20,
        model_name: str = "demo",
    ) -> None:
        from kvferry.kv_transfer.stores.master import MooncakeMaster

        self.model, self.log_dir, self.model_name = model, log_dir, model_name
        self.server_args = server_args
        self.env = dict(env if env is not None else os.environ)
        self.blocks_per_chunk = blocks_per_chunk
        self.master = MooncakeMaster(segment_bytes=store_bytes, log_dir=str(log_dir / "mooncake"))
        self.servers = [
            _Server(chr(ord("a") + i), free_port(), free_port(), free_port()) for i in range(n)
        ]
        self.with_reference = reference
        self.reference: Instance | None = None
        self.proxy: Instance | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> SharedCluster:
        try:
            self.master.start()
            for s in self.servers:
                self._spawn(s)
            if self.with_reference:
                argv = ["serve", *self._serve_argv(), "--port", "0"]
                self.reference = start("reference", argv, self.log_dir, env=self.env)
            self.proxy = start("proxy", self._proxy_argv(), self.log_dir, env=self.env)
            self._ready(*self.instances())
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        stop(self.instances())
        self.master.stop()

    def instances(self) -> list[Instance]:
        own = [s.inst for s in self.servers if s.inst is not None]
        return [i for i in (*own, self.reference, self.proxy) if i is not None]

    def logs_without_traceback(self) -> list[str]:
        """The names of the processes whose log shows a traceback (should be none)."""
        return [i.name for i in self.instances() if "Traceback" in i.log.read_text()]

    def _serve_argv(self) -> list[str]:
        return [str(self.model), "--served-model-name", self.model_name, *self.server_args]

    def _spawn(self, s: _Server) -> None:
        events = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{s.events}",
            "replay_endpoint": f"tcp://127.0.0.1:{s.replay}",
        }
        kv = chain_kv_config(self.master.config(), self.blocks_per_chunk)
        argv = ["serve", *self._serve_argv(), "--port", str(s.http),
                "--kv-transfer-config", json.dumps(kv), "--kv-events-config", json.dumps(events)]  # fmt: skip
        s.inst = start(s.name, argv, self.log_dir, env=self.env)

    def _proxy_argv(self) -> list[str]:
        argv = ["proxy", "--port", "0", "--policy", "kv_aware", "--tokenizer", str(self.model),
                "--instance", *(s.url for s in self.servers), "--load-poll-interval", "0.2",
                "--kv-shared-medium", MEDIUM_STORE, "--kv-recent-ttl", "0"]  # fmt: skip
        argv += ["--kv-events-endpoint", *(f"tcp://127.0.0.1:{s.events}" for s in self.servers)]
        argv += ["--kv-replay-endpoint", *(f"tcp://127.0.0.1:{s.replay}" for s in self.servers)]
        return argv

    @staticmethod
    def _ready(*instances: Instance) -> None:
        for inst in instances:
            wait_listening(inst)
        for inst in instances:
            wait_healthy(inst.url, inst=inst)

    def server(self, name: str) -> _Server:
        return next(s for s in self.servers if s.name == name)

    def stop_instance(self, name: str) -> None:
        """Stop one instance and wait until the proxy marks it down."""
        s = self.server(name)
        if s.inst is not None:
            stop([s.inst])
        self._wait_proxy(lambda m: m.get(_up_key(s.url), 1.0) == 0.0, f"{name} marked down")

    def start_instance(self, name: str) -> None:
        """Start a stopped instance again on its ports (an empty pool and host tier)."""
        s = self.server(name)
        self._spawn(s)
        assert s.inst is not None
        self._ready(s.inst)
        self._wait_proxy(lambda m: m.get(_up_key(s.url), 0.0) == 1.0, f"{name} marked up")

    def _wait_proxy(self, cond: Any, what: str, timeout: float = 30.0) -> None:
        assert self.proxy is not None
        deadline = time.monotonic() + timeout
        while not cond(scrape(self.proxy.url)):
            if time.monotonic() > deadline:
                raise ConfigError(f"timed out waiting for the proxy: {what}")
            time.sleep(0.05)

    # -- requests -----------------------------------------------------------------------------
    def complete(self, url: str, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy completion of ``prompt`` (token ids) at ``url``: the output token ids."""
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key="demo", max_retries=0)
        r = client.completions.create(
            model=self.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        return list(r.choices[0].token_ids)  # type: ignore[attr-defined]

    def ask(self, prompt: list[int], max_tokens: int = 8, to: str | None = None) -> Served:
        """Send ``prompt`` through the proxy (or straight to instance ``to``)."""
        assert self.proxy is not None
        before = {s.name: _cached_by_tier(scrape(s.url)) for s in self.live()}
        routes = _decisions(scrape(self.proxy.url))
        url = self.server(to).url if to is not None else self.proxy.url
        out = self.complete(url, prompt, max_tokens)
        if to is None:
            changed = [k for k, v in _decisions(scrape(self.proxy.url)).items()
                       if v > routes.get(k, 0.0)]  # fmt: skip
            if len(changed) != 1:
                raise ConfigError(f"could not tell where the proxy sent the request: {changed}")
            reason, url = changed[0]
            name = next(s.name for s in self.servers if s.url == url)
        else:
            reason, name = "", to
        after = _cached_by_tier(scrape(self.server(name).url))
        was = before.get(name, {})
        cached = {t: int(after.get(t, 0) - was.get(t, 0)) for t in TIERS.values()}
        return Served(name, reason, out, cached)

    def live(self) -> list[_Server]:
        return [s for s in self.servers if s.inst is not None and s.inst.proc.poll() is None]

    def wait_stored(self, name: str, chunks: int, timeout: float = 30.0) -> None:
        """Wait until instance ``name`` has ``chunks`` chunks in the store (its puts done),
        then until the proxy applied its events (they follow the put at once)."""
        url = self.server(name).url
        deadline = time.monotonic() + timeout
        key = f"{STORE_CHILD}.stored_chunks"
        while connector_stats(scrape(url)).get(key, 0.0) < chunks:
            if time.monotonic() > deadline:
                raise ConfigError(f"{name}: fewer than {chunks} chunks stored in {timeout:.0f}s")
            time.sleep(0.05)
        self._settle_events(url)

    def _settle_events(self, url: str, quiet_s: float = 0.3) -> None:
        """Until the proxy applied no new event batch of ``url`` for ``quiet_s``."""
        assert self.proxy is not None
        key = f"kvferry_proxy_kv_event_batches_total{{instance={url},source=live}}"
        last, since = -1.0, time.monotonic()
        deadline = since + 10.0
        while time.monotonic() < deadline:
            now = scrape(self.proxy.url).get(key, 0.0)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.05)


def _up_key(url: str) -> str:
    return f"kvferry_proxy_instance_up{{instance={url}}}"


def _cached_by_tier(metrics: dict[str, float]) -> dict[str, float]:
    prefix = "vllm:prompt_tokens_cached_by_source_total{source="
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith(prefix):
            source = key[len(prefix) : -1]
            tier = TIERS.get(source, source)
            out[tier] = out.get(tier, 0.0) + value
    return out


def _decisions(metrics: dict[str, float]) -> dict[tuple[str, str], float]:
    """(reason, instance url) -> routing decisions so far."""
    prefix = "kvferry_proxy_routing_decisions_total{"
    out: dict[tuple[str, str], float] = {}
    for key, value in metrics.items():
        if key.startswith(prefix):
            labels = dict(p.split("=", 1) for p in key[len(prefix) : -1].split(","))
            out[(labels["reason"], labels["instance"])] = value
    return out
