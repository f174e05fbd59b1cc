"""Trust for P/D over HTTP: the prefill server's release endpoint needs signed params, and
the P/D proxy sends its upstream API key on every call."""

from __future__ import annotations

import time

import pytest

from kvferry.config import ConfigError
from tests.helpers.pd_auth import SECRET, _kv

# -- HTTP: the release path and the proxy ---------------------------------------------------------


def test_release_endpoint_needs_signed_params(models, tmp_path, monkeypatch) -> None:
    pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")
    import httpx

    from tests.helpers.servers import metric, ready, start_server, stop

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET.value)
    kv = _kv(secret)
    kv["kv_connector_extra_config"]["kv_lease_duration"] = 60.0
    p = start_server("prefill", models["a"], tmp_path, kv)
    try:
        ready(p)
        body = {
            "model": "tiny",
            "prompt": list(range(5, 45)),
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        r = httpx.post(p.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        held = "kvferry_num_requests_held_by_connector"
        assert metric(p.url, held) == 1
        unsigned = {k: v for k, v in params.items() if k != "kv_signature"}
        for forged in ({**params, "remote_request_id": "someone-else"}, unsigned):
            r = httpx.post(p.url + "/v1/kv/release", json={"kv_transfer_params": forged})
            assert r.status_code == 400, r.text
            assert "kv_transfer_params" in r.json()["error"]["message"]
        assert metric(p.url, held) == 1
        r = httpx.post(p.url + "/v1/kv/release", json={"kv_transfer_params": params})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while metric(p.url, held) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(p.url, held) == 0
    finally:
        stop([p])
    assert "Traceback" not in p.log.read_text()


def test_proxy_sends_its_upstream_key_everywhere(tmp_path) -> None:
    import httpx
    from fastapi.testclient import TestClient

    from kvferry.entrypoints.proxy import PDProxy, build_proxy_app, read_api_key_file

    key_file = tmp_path / "key"
    key_file.write_text("upstream-key\n")
    seen: list[tuple[str, str | None]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.host == "p1":
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
        return httpx.Response(500, json={"error": {"message": "boom"}})  # -> a release

    key = read_api_key_file(str(key_file))
    proxy = PDProxy(["http://p1"], ["http://d1"], upstream_api_key=key)
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    with TestClient(build_proxy_app(proxy)) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        r = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer client"})
        assert r.status_code == 502
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [p for p, _ in seen] == ["/v1/completions", "/v1/completions", "/v1/kv/release"]
    assert {a for _, a in seen} == {"Bearer upstream-key"}
    key_file.write_text("two words")
    with pytest.raises(ConfigError, match="one key"):
        read_api_key_file(str(key_file))
