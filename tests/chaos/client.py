"""The good client: a well-behaved user of the deployment under attack."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

GOOD_TIMEOUT_S = 30.0


@dataclass
class Sample:
    start: float
    latency: float
    prompt: int
    status: int | None  # None: no HTTP answer (connection refused or broken, timeout)
    tokens: list[int] | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.tokens is not None


class GoodClient:
    """A well-behaved client: the same greedy completion requests over and over, one at a
    time, rotating over ``prompts``. ``salted``: a fresh ``cache_salt`` per request, so no
    request reuses another's KV (each one is a full prefill, or a full P/D transfer). The
    reference tokens of each prompt are those of its first successful answer
    (:meth:`warm_up`)."""

    def __init__(
        self,
        url: Callable[[], str],
        prompts: list[list[int]],
        max_tokens: int = 8,
        salted: bool = True,
        name: str = "good",
    ) -> None:
        self.url = url
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.salted = salted
        self.name = name
        self.reference: dict[int, list[int]] = {}
        self._count = 0
        self._http = httpx.Client(trust_env=False, timeout=GOOD_TIMEOUT_S)

    def body(self, index: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": self.prompts[index],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if self.salted:
            body["cache_salt"] = f"{self.name}-{self._count}"
        return body

    def once(self) -> Sample:
        index = self._count % len(self.prompts)
        body = self.body(index)
        self._count += 1
        t0 = time.monotonic()
        try:
            r = self._http.post(self.url() + "/v1/completions", json=body)
        except httpx.HTTPError as e:
            return Sample(t0, time.monotonic() - t0, index, None, None, repr(e)[:200])
        latency = time.monotonic() - t0
        if r.status_code != 200:
            return Sample(t0, latency, index, r.status_code, None, r.text[:200])
        try:
            tokens = list(r.json()["choices"][0]["token_ids"])
        except (ValueError, KeyError, IndexError, TypeError) as e:
            return Sample(t0, latency, index, r.status_code, None, f"bad body: {e!r}")
        return Sample(t0, latency, index, 200, tokens)

    def warm_up(self) -> None:
        """One request per prompt; their answers become the reference."""
        for _ in self.prompts:
            s = self.once()
            if not s.ok:
                raise AssertionError(f"{self.name}: warm-up request failed: {s.error}")
            self.reference.setdefault(s.prompt, s.tokens or [])

    def clone(self, name: str) -> GoodClient:
        """Another client of the same requests and reference (one per thread)."""
        twin = GoodClient(self.url, self.prompts, self.max_tokens, self.salted, name)
        twin.reference = self.reference
        return twin

    def run(self, n: int) -> list[Sample]:
        return [self.once() for _ in range(n)]

    def wrong(self, s: Sample) -> bool:
        return s.ok and s.tokens != self.reference.get(s.prompt)

    def close(self) -> None:
        self._http.close()


class _Loop(threading.Thread):
    def __init__(self, good: GoodClient) -> None:
        super().__init__(daemon=True, name="chaos-good-client")
        self.good = good
        self.samples: list[Sample] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            sample = self.good.once()
            self.samples.append(sample)
            if not sample.ok:  # a process is down: ask again soon, but do not spin
                self.stop.wait(0.2)


def _why(s: Sample) -> str:
    return f"HTTP {s.status}" if s.status is not None else (s.error or "?").split("(")[0]
