"""Processes of a P/D deployment killed (SIGKILL) while requests stream through it: the prefill
instance, the decode instance, the proxy. What is left must keep serving or fail cleanly (an
HTTP 5xx or an error event, never a hang or a wrong token), hold no blocks once drained, and
serve again once the killed process is restarted."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from .conftest import LEASE_S
from .harness import Attack, GoodClient, Service, run_attack, token_ids

STREAM_TOKENS = 64
STREAM_PROMPT = token_ids(48, 77)
RESTART_S = 60.0


@dataclass
class Stream:
    status: int | None = None
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    error: str | None = None
    started: threading.Event = field(default_factory=threading.Event)


def stream(url: str, salt: str, out: Stream, timeout: float = 30.0) -> Stream:
    """One streaming greedy completion; whatever happens is recorded in ``out``."""
    body = {
        "model": "tiny",
        "prompt": STREAM_PROMPT,
        "max_tokens": STREAM_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "cache_salt": salt,
    }
    try:
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, timeout=timeout, trust_env=False
        ) as r:
            out.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"error event: {str(event['error'].get('message'))[:120]}"
                    break
                for choice in event.get("choices", []):
                    out.tokens += choice.get("token_ids") or []
                out.started.set()
    except httpx.HTTPError as e:
        out.error = type(e).__name__
    except ValueError as e:
        out.error = f"malformed event: {e}"
    finally:
        out.started.set()
    return out


def _check_stream(a: Attack, s: Stream, expected: list[int], label: str) -> None:
    """Complete and right, or ended early with right tokens so far; never hung or wrong."""
    if s.tokens != expected[: len(s.tokens)]:
        a.violation(f"{label}: a stream got other tokens than the reference")
    elif s.error is not None and "Timeout" in s.error:
        a.violation(f"{label}: a stream hung ({s.error})")
    elif s.done and len(s.tokens) != len(expected):
        a.violation(f"{label}: a stream ended with [DONE] after {len(s.tokens)} tokens")
    outcome = "complete" if s.done else (s.error or "ended without [DONE]")
    a.count(f"{label}: {outcome}")


def _down_request(a: Attack, proxy: Service) -> None:
    """A request while a process is down: a prompt 5xx (or no connection to a dead proxy)."""
    t0 = time.monotonic()
    try:
        r = httpx.post(
            proxy.url + "/v1/completions",
            json={"model": "tiny", "prompt": STREAM_PROMPT, "max_tokens": 4},
            timeout=30,
            trust_env=False,
        )
        got: int | str = r.status_code
    except httpx.HTTPError as e:
        got = type(e).__name__
    took = time.monotonic() - t0
    a.details["request_while_down"] = {"answer": got, "seconds": round(took, 2)}
    clean = (isinstance(got, int) and 500 <= got < 600) or got in {"ConnectError", 200}
    a.check(clean and took < 15, f"a request while down: {got} after {took:.1f}s")


def _wait_proxy_healthy(proxy: Service, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(proxy.url + "/health", timeout=5, trust_env=False).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def _kill_and_restart(
    pd: dict[str, Service], good: GoodClient, victim: str
) -> Callable[[Attack], None]:
    proxy = pd["proxy"]

    def attack(a: Attack) -> None:
        ref = stream(proxy.url, f"kill-ref-{victim}", Stream())
        a.check(ref.done and len(ref.tokens) == STREAM_TOKENS, f"reference stream failed: {ref}")
        streams = [Stream() for _ in range(a.profile.kill_streams)]
        threads = [
            threading.Thread(target=stream, args=(proxy.url, f"kill-{victim}-{i}-{time.time()}", s))
            for i, s in enumerate(streams)
        ]
        for t in threads:
            t.start()
        for s in streams:
            s.started.wait(30)
        pd[victim].kill()
        a.details["killed"] = victim
        for t in threads:
            t.join(60)
        for s in streams:
            _check_stream(a, s, ref.tokens, "in flight")
        _down_request(a, proxy)
        t0 = time.monotonic()
        pd[victim].start()
        pd[victim].wait_ready(RESTART_S)
        a.check(_wait_proxy_healthy(proxy, RESTART_S), "the proxy did not turn healthy again")
        checker = good.clone(f"after-{victim}-restart")
        ok = False
        for _ in range(3):
            sample = checker.once()
            if sample.ok and not checker.wrong(sample):
                ok = True
                break
            time.sleep(1)
        checker.close()
        a.details["serving_again_after_s"] = round(time.monotonic() - t0, 2)
        a.check(ok, f"no right answer after restarting the {victim}")
        after = stream(proxy.url, f"kill-after-{victim}-{time.time()}", Stream())
        _check_stream(a, after, ref.tokens, "after restart")
        a.check(after.done, f"a stream after restarting the {victim} did not complete")

    return attack


def _run(pd: dict[str, Service], good: GoodClient, victim: str, title: str) -> None:
    survivors = [pd[n] for n in ("prefill", "decode") if n != victim]
    r = run_attack(
        f"kill_{victim}",
        title,
        _kill_and_restart(pd, good, victim),
        good=good,
        watch=survivors,
        drain_s=LEASE_S + 15.0,
        check_latency=False,
        kill=True,
    )
    assert not r.violations, r.summary()


def test_kill_prefill(pd_up, pd_good) -> None:
    _run(pd_up, pd_good, "prefill", "Prefill process killed mid-stream, then restarted")


def test_kill_decode(pd_up, pd_good) -> None:
    _run(pd_up, pd_good, "decode", "Decode process killed mid-stream, then restarted")


def test_kill_proxy(pd_up, pd_good) -> None:
    _run(pd_up, pd_good, "proxy", "Proxy process killed mid-stream, then restarted")
