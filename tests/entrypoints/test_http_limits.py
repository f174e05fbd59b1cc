"""HTTP limits of ``kvferry serve`` (ServerLimits and their flags): body size (413 while the
body streams in), body read timeout (408), a deadline for request heads so slow clients cannot
hold connections open, prompts per request and prompt characters; none of them stalls a
well-behaved request."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.helpers.servers import serving

LIMIT_FLAGS = [
    "--max-request-body-bytes",
    "65536",
    "--max-prompts-per-request",
    "8",
    "--max-prompt-chars",
    "2000",
    "--body-read-timeout",
    "1",
    "--header-timeout",
    "1",
]


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("limits")
    with serving("limits", tiny_model_factory("llama"), logs, None, *LIMIT_FLAGS) as inst:
        yield inst


def _addr(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _error(resp: httpx.Response, status: int, param: str | None = None) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return str(err["message"])


def _good(server) -> None:
    body = {"prompt": "The ferry", "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_body_over_the_limit_is_413(server) -> None:
    body = json.dumps({"prompt": "x" * 70_000, "max_tokens": 2})
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=30)
    assert "65536 bytes" in _error(r, 413)
    # Without a Content-Length (chunked), the limit holds while the body streams in.
    chunks = (body[i : i + 8192].encode() for i in range(0, len(body), 8192))
    r = httpx.post(server.url + "/v1/completions", content=chunks, timeout=30)
    _error(r, 413)
    # A declared length over the limit is refused before any byte of the body is sent.
    with socket.create_connection(_addr(server), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n"
        )
        t0 = time.monotonic()
        head = _read_all(s, 10)
        assert head.startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < 5
    _good(server)


def test_slow_body_gets_408(server) -> None:
    with socket.create_connection(_addr(server), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        t0 = time.monotonic()
        reply = _read_all(s, 10)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert 0.8 < time.monotonic() - t0 < 5
        assert b"did not arrive within 1 s" in reply
    _good(server)


def test_slow_and_silent_connections_are_closed(server) -> None:
    conns = [socket.create_connection(_addr(server), timeout=10) for _ in range(60)]
    try:
        for i, s in enumerate(conns):
            if i % 2:  # half send a head that never ends, half send nothing
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        _good(server)  # served while they hang
        t0 = time.monotonic()
        for s in conns:
            assert _read_all(s, 10) == b""  # closed by the server, without a reply
        assert time.monotonic() - t0 < 5
    finally:
        for s in conns:
            s.close()
    # A keep-alive connection gets a fresh head deadline after each response.
    with httpx.Client(timeout=30) as c:
        for _ in range(2):
            assert c.get(server.url + "/health").status_code == 200
            time.sleep(0.3)
    _good(server)


def test_prompt_count_and_length_limits(server) -> None:
    url = server.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": ["a"] * 9, "max_tokens": 1}, timeout=30)
    assert "at most 8 prompts" in _error(r, 400, "prompt")
    r = httpx.post(url, json={"prompt": "a" * 2001, "max_tokens": 1}, timeout=30)
    assert "2001 characters" in _error(r, 400, "prompt")
    chat = {"messages": [{"role": "user", "content": "a" * 1500}] * 2, "max_tokens": 1}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30)
    assert "3000 characters" in _error(r, 400, "messages")
    r = httpx.post(url, json={"prompt": ["a"] * 8, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_limits_are_checked_at_start(tiny_model_factory, capsys) -> None:
    from kvferry.entrypoints.cli import main

    model = str(tiny_model_factory("llama"))
    assert main(["serve", model, "--header-timeout", "0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --header-timeout must be positive") and "Traceback" not in err


def test_api_key_from_flag_file_or_environment(tmp_path, monkeypatch) -> None:
    from kvferry.config import ConfigError
    from kvferry.entrypoints.openai.api_server import resolve_api_key

    monkeypatch.delenv("KVFERRY_API_KEY", raising=False)
    assert resolve_api_key(None, None) is None
    monkeypatch.setenv("KVFERRY_API_KEY", "from-env")
    assert resolve_api_key(None, None) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_api_key(None, str(key_file)) == "from-file"
    assert resolve_api_key("from-flag", None) == "from-flag"
    with pytest.raises(ConfigError, match="not both"):
        resolve_api_key("from-flag", str(key_file))
    key_file.write_text("two words")
    with pytest.raises(ConfigError, match="one key"):
        resolve_api_key(None, str(key_file))


def test_proxy_refuses_oversize_bodies_before_reading_them() -> None:
    from fastapi.testclient import TestClient

    from kvferry.entrypoints.openai.limits import ServerLimits
    from kvferry.entrypoints.proxy import PDProxy, build_proxy_app

    # No instance is reachable: a body the proxy let through would be a 503, not a 413.
    proxy = PDProxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], timeout=1.0)
    app = build_proxy_app(proxy, ServerLimits(max_request_body_bytes=1024))
    with TestClient(app) as client:
        big = {"model": "m", "prompt": "x" * 4096, "max_tokens": 1}
        r = client.post("/v1/completions", json=big)
        assert r.status_code == 413, r.text
        assert "larger than the limit" in r.json()["error"]["message"]
