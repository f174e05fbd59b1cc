"""Attacks of an untrusted HTTP client on one ``kvferry serve``: values that used to pass intake
and fail in the engine step, huge prompts and bodies, many prompts, slow connections."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from .conftest import HEADER_TIMEOUT
from .harness import PROFILE, Attack, json_body, run_attack

# (label, path, body, statuses accepted). Tiny positive temperature and top_p are values
# vLLM accepts (greedy / the top token), so 200 is as good as a 400 for them.
BAD_SAMPLING: list[tuple[str, str, dict[str, Any], set[int]]] = [
    ("temperature NaN", "/v1/completions", {"temperature": float("nan")}, {400}),
    ("temperature inf", "/v1/completions", {"temperature": float("inf")}, {400}),
    ("temperature 1e-40", "/v1/completions", {"temperature": 1e-40}, {200, 400}),
    ("top_p 1e-300", "/v1/completions", {"top_p": 1e-300}, {200, 400}),
    ("seed 2**64", "/v1/completions", {"seed": 2**64}, {400}),
    ("seed 10**30", "/v1/completions", {"seed": 10**30}, {400}),
    ("lone surrogate", "/v1/completions", {"prompt": "ab\ud800cd"}, {400}),
    (
        "lone surrogate (chat)",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi \udc00"}]},
        {400},
    ),
]
COPIES = 4  # four at once used to kill the engine


_local = threading.local()


def _post(url: str, path: str, content: bytes, timeout: float = 30.0) -> int | str:
    """POST raw bytes (one client per attacker thread: building clients costs CPU)."""
    http = getattr(_local, "http", None)
    if http is None:
        http = _local.http = httpx.Client(trust_env=False, timeout=timeout)
    try:
        r = http.post(url + path, content=content, headers={"Content-Type": "application/json"})
        return r.status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def _expect(a: Attack, label: str, got: int | str, ok: set[int]) -> None:
    a.details.setdefault("answers", {}).setdefault(label, {})
    counts = a.details["answers"][label]
    counts[str(got)] = counts.get(str(got), 0) + 1
    a.check(got in ok, f"{label}: answered {got}, expected {sorted(ok)}")


def test_bad_sampling_values(single_up, single_good) -> None:
    def attack(a: Attack) -> None:
        jobs = []
        for label, path, extra, ok in BAD_SAMPLING:
            body = {"model": "tiny", "prompt": "x", "max_tokens": 2, **extra}
            if path.endswith("chat/completions"):
                body.pop("prompt")
            jobs += [(label, path, json_body(body), ok)] * COPIES
        with ThreadPoolExecutor(8) as pool:
            for _ in a.rounds(pause=0.2):
                answers = pool.map(lambda j: _post(single_up.url, j[1], j[2]), jobs)
                for (label, _, _, ok), got in zip(jobs, answers, strict=True):
                    _expect(a, label, got, ok)

    r = run_attack(
        "bad_sampling",
        "Bad sampling values (NaN/inf/1e-40 temperature, top_p 1e-300, seed >= 2**64, "
        "lone surrogates), 4 of each at once",
        attack,
        good=single_good,
        watch=[single_up],
    )
    assert not r.violations, r.summary()


def _huge(a: Attack, url: str, path: str, make: Any, what: str) -> None:
    body = json_body(make("word " * (a.profile.huge_bytes // 5)))
    a.details["body_bytes"] = len(body)
    for _ in a.rounds(pause=0.5):
        t0 = time.monotonic()
        got = _post(url, path, body)
        a.details["answer_s"] = max(a.details.get("answer_s", 0.0), time.monotonic() - t0)
        _expect(a, what, got, {400, 413})


def test_huge_prompt(single_up, single_good) -> None:
    def attack(a: Attack) -> None:
        make = lambda text: {"model": "tiny", "prompt": text, "max_tokens": 4}  # noqa: E731
        _huge(a, single_up.url, "/v1/completions", make, "10 MB prompt")

    r = run_attack(
        "huge_prompt", "Huge prompt (10 MB)", attack, good=single_good, watch=[single_up]
    )
    assert not r.violations, r.summary()


def test_huge_chat_message(single_up, single_good) -> None:
    def attack(a: Attack) -> None:
        make = lambda text: {  # noqa: E731
            "model": "tiny",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 4,
        }
        _huge(a, single_up.url, "/v1/chat/completions", make, "10 MB chat message")

    r = run_attack(
        "huge_chat", "Huge chat message (10 MB)", attack, good=single_good, watch=[single_up]
    )
    assert not r.violations, r.summary()


def test_many_prompts(single_up, single_good) -> None:
    def attack(a: Attack) -> None:
        texts = {"model": "tiny", "prompt": ["hello there"] * 10_000, "max_tokens": 4}
        ids = {"model": "tiny", "prompt": [[5, 6, 7]] * 10_000, "max_tokens": 4}
        for i in a.rounds(pause=0.3):
            body = texts if i % 2 == 0 else ids
            _expect(
                a, "10,000 prompts", _post(single_up.url, "/v1/completions", json_body(body)), {400}
            )

    r = run_attack(
        "many_prompts", "10,000 prompts in one request", attack, good=single_good, watch=[single_up]
    )
    assert not r.violations, r.summary()


def _declared_huge(url: str) -> str:
    """Declare a 1 GiB body, send 1 MiB of it, and read what the server says."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {1 << 30}\r\n\r\n"
        )
        # The server may hang up while we send; its answer is still readable.
        with contextlib.suppress(OSError):
            s.sendall(head.encode() + b'{"prompt": "' + b"a" * (1 << 20))
        try:
            data = s.recv(200)
        except OSError as e:
            return type(e).__name__
    return data.split(b"\r\n", 1)[0].decode(errors="replace") or "closed without an answer"


def test_oversize_body(single_up, single_good) -> None:
    def attack(a: Attack) -> None:
        junk = {"model": "tiny", "prompt": "x", "max_tokens": 2, "junk": "a" * (20 << 20)}
        body = json_body(junk)
        for _ in a.rounds(pause=0.5):
            _expect(a, "20 MiB body", _post(single_up.url, "/v1/completions", body), {413})
            status = _declared_huge(single_up.url)
            a.details.setdefault("declared 1 GiB", []).append(status)
            a.check(" 413" in status, f"declared 1 GiB body: answered {status!r}, expected 413")

    r = run_attack(
        "oversize_body",
        "Oversize body (20 MiB sent; 1 GiB declared)",
        attack,
        good=single_good,
        watch=[single_up],
    )
    assert not r.violations, r.summary()


def test_slow_clients(single_up, single_good) -> None:
    """Half the connections trickle their request head, half a body they declared; the
    server must cut them off after its header / body timeouts, and serve others meanwhile."""
    limit = float(HEADER_TIMEOUT)

    def attack(a: Attack) -> None:
        host, port = single_up.url.removeprefix("http://").split(":")
        n = a.profile.slow_clients
        sel = selectors.DefaultSelector()
        opened: dict[socket.socket, float] = {}
        kind: dict[socket.socket, str] = {}
        closed_after: list[float] = []
        for i in range(n):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.setblocking(False)
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            if i % 2:
                head += "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
            s.send(head.encode())
            opened[s] = time.monotonic()
            kind[s] = "slow body" if i % 2 else "slow head"
            sel.register(s, selectors.EVENT_READ, data=s)
        a.details["connections"] = n
        deadline = time.monotonic() + limit + 2.5
        next_trickle = time.monotonic()
        try:
            while opened and time.monotonic() < deadline:
                if time.monotonic() >= next_trickle:
                    for s in list(opened):
                        try:
                            s.send(b"a")
                        except OSError:
                            closed_after.append(time.monotonic() - opened.pop(s))
                            sel.unregister(s)
                            s.close()
                    next_trickle = time.monotonic() + 0.5
                for key, _ in sel.select(timeout=0.1):
                    s = key.data
                    try:
                        data = s.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if data.startswith(b"HTTP/1.1 "):
                        a.count(f"answered {data[9:12].decode(errors='replace')}: {kind[s]}")
                    if not data and s in opened:  # the server hung up
                        closed_after.append(time.monotonic() - opened.pop(s))
                        sel.unregister(s)
                        s.close()
        finally:
            a.details["still_open"] = len(opened)
            for s in opened:
                a.count(f"still open: {kind[s]}")
            for s in opened:
                s.close()
            sel.close()
        a.details["closed_by_server"] = len(closed_after)
        if closed_after:
            a.details["closed_after_max_s"] = round(max(closed_after), 2)
        a.check(
            not a.details["still_open"],
            f"{a.details['still_open']} of {n} slow connections still open "
            f"{limit + 2.5:.1f}s after connecting (timeout {limit:.0f}s)",
        )

    r = run_attack(
        "slow_clients",
        f"Slow clients ({PROFILE.slow_clients} connections trickling head or body)",
        attack,
        good=single_good,
        watch=[single_up],
    )
    assert not r.violations, r.summary()
