"""LoadTracker: each instance's health and load, as the routing policies see them.

Load = max(requests in flight through this proxy, running + waiting on the instance). The
instance's numbers come from its ``/metrics`` (``vllm:num_requests_running`` /
``vllm:num_requests_waiting``, or kvferry's older ``kvferry_num_requests_*`` names), polled
every ``interval`` seconds together with ``/health``; they also count requests that reach it
by other routes, while the in-flight count is exact for ours between polls. An instance that
fails ``/health`` or refuses a connection is *down* until a probe succeeds again; coming back
calls ``on_up`` (the KV event subscriber rebuilds its index).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from kvferry.entrypoints.proxy.routing_metrics import RoutingMetrics

_RUNNING = ("vllm:num_requests_running", "kvferry_num_requests_running")
_WAITING = ("vllm:num_requests_waiting", "kvferry_num_requests_waiting")


def queue_depth(metrics_text: str) -> tuple[float, float] | None:
    """(running, waiting) summed over label sets; vLLM's names win over kvferry's."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _RUNNING or name in _WAITING:
            try:
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
            except ValueError:
                continue

    def first(names: tuple[str, ...]) -> float | None:
        return next((found[n] for n in names if n in found), None)

    running, waiting = first(_RUNNING), first(_WAITING)
    if running is None and waiting is None:
        return None
    return running or 0.0, waiting or 0.0


@dataclass
class InstanceLoad:
    inflight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    up: bool = True

    @property
    def load(self) -> float:
        return max(float(self.inflight), self.running + self.waiting)


class LoadTracker:
    def __init__(
        self,
        urls: Sequence[str],
        metrics: RoutingMetrics,
        interval: float = 1.0,
        on_up: Callable[[str], None] | None = None,
    ) -> None:
        self.urls = list(urls)
        self.metrics = metrics
        self.interval = interval
        self.on_up = on_up
        self.state = {u: InstanceLoad() for u in self.urls}
        self._task: asyncio.Task[None] | None = None
        for u in self.urls:
            metrics.instance_up.labels(u).set(1)

    def up(self, url: str) -> bool:
        return self.state[url].up

    def load(self, url: str) -> float:
        return self.state[url].load

    def begin(self, url: str) -> None:
        self.state[url].inflight += 1
        self._publish(url)

    def end(self, url: str) -> None:
        self.state[url].inflight -= 1
        self._publish(url)

    def mark_down(self, url: str) -> None:
        self._set_up(url, False)

    def _set_up(self, url: str, up: bool) -> None:
        st = self.state[url]
        came_back = up and not st.up
        st.up = up
        self.metrics.instance_up.labels(url).set(1 if up else 0)
        if came_back and self.on_up is not None:
            self.on_up(url)

    def _publish(self, url: str) -> None:
        self.metrics.instance_load.labels(url).set(self.state[url].load)

    # -- polling ------------------------------------------------------------------------------

    def start(self, http: httpx.AsyncClient) -> None:
        if self._task is None and self.interval > 0:
            self._task = asyncio.create_task(self._poll_forever(http))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _poll_forever(self, http: httpx.AsyncClient) -> None:
        while True:
            await self.poll(http)
            await asyncio.sleep(self.interval)

    async def poll(self, http: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self._probe(http, u) for u in self.urls))

    async def _probe(self, http: httpx.AsyncClient, url: str) -> None:
        timeout = max(0.5, min(2.0, self.interval * 2))
        try:
            health = await http.get(url + "/health", timeout=timeout)
            ok = health.status_code == 200
            if ok:
                resp = await http.get(url + "/metrics", timeout=timeout)
                depth = queue_depth(resp.text) if resp.status_code == 200 else None
                if depth is not None:
                    st = self.state[url]
                    st.running, st.waiting = depth
                    self._publish(url)
        except (httpx.HTTPError, OSError):
            ok = False
        self._set_up(url, ok)
