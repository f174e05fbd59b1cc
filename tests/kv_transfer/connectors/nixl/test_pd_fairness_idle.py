"""No busy idle (issue 11): an idle NIXL agent sleeps, UCX listens only on the configured
(loopback) interface, and reads work with the UCX settings the connector derives."""

from __future__ import annotations

import time

import psutil
import pytest
import torch

from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.nixl.agent import NixlTransport, ucx_net_devices
from kvferry.kv_transfer.connectors.nixl.connector import NixlConnector
from kvferry.kv_transfer.connectors.pd.metadata import (
    PDConnectorMetadata as NixlConnectorMetadata,
)
from kvferry.kv_transfer.connectors.pd.metadata import (
    RecvSpec,
    RemoteRef,
    SendSpec,
)
from kvferry.kv_transfer.connectors.pd.params import token_digest
from tests.helpers.nixl_config import nixl_engine_config
from tests.helpers.scheduler import make_kv_cache_config

pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")


# -- no busy idle; UCX binds where configured ------------------------------------------------


def _listening(proc: psutil.Process) -> set[str]:
    return {c.laddr.ip for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}


def test_idle_agent_sleeps_and_ucx_listens_only_on_loopback(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert ucx_net_devices("127.0.0.1") == ucx_net_devices("localhost") == "lo"
    assert ucx_net_devices("0.0.0.0") is None and ucx_net_devices("example.org") is None
    proc = psutil.Process()
    before = _listening(proc)
    transport = NixlTransport("idle-test", ["UCX"], bind_host="127.0.0.1")
    try:
        assert "UCX_NET_DEVICES" not in __import__("os").environ  # set only while building
        new = _listening(proc) - before
        assert new and all(ip.startswith("127.") or ip == "::1" for ip in new), new
        time.sleep(0.5)
        t0, w0 = proc.cpu_times(), time.monotonic()
        time.sleep(3)
        t1, w1 = proc.cpu_times(), time.monotonic()
        cpu = (t1.user - t0.user + t1.system - t0.system) / (w1 - w0)
        assert cpu < 0.02, f"an idle NIXL agent uses {cpu:.1%} of a core"
    finally:
        transport.close()


def test_reads_still_work_with_the_derived_ucx_settings(monkeypatch):
    """No UCX_NET_DEVICES from the user: the connector's own (loopback) choice transfers."""
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    kvc = make_kv_cache_config(32)
    shape = (2, 32, 16, 1, 8)
    src = {"model.layers.0.self_attn": torch.randn(shape)}
    dst = {"model.layers.0.self_attn": torch.zeros(shape)}
    p = NixlConnector(nixl_engine_config("fair-P"), KVConnectorRole.WORKER, kvc)
    d = NixlConnector(nixl_engine_config("fair-D"), KVConnectorRole.WORKER, kvc)
    try:
        p.register_kv_caches(src)
        d.register_kv_caches(dst)
        pw, dw = p.connector_worker, d.connector_worker
        assert pw is not None and dw is not None
        digest = token_digest(list(range(32)), 32)
        pw.bind(NixlConnectorMetadata(reqs_to_send=[SendSpec("p-1", [3, 4], 32, digest)]))
        ref = RemoteRef("fair-P", "127.0.0.1", pw.port, "p-1")
        spec = RecvSpec("d-1", ref, [3, 4], [7, 9], 32, digest)
        dw.start_load(NixlConnectorMetadata(reqs_to_recv=[spec]), empty_step=True)
        got: set[str] = set()
        sent: set[str] = set()
        deadline = time.monotonic() + 20
        while not (got and sent) and time.monotonic() < deadline:
            got |= dw.get_finished()[1]
            sent |= pw.get_finished()[0]
        assert got == {"d-1"} and sent == {"p-1"} and not dw.get_failed_recving()
        s, t = src["model.layers.0.self_attn"], dst["model.layers.0.self_attn"]
        assert torch.equal(t[:, [7, 9]], s[:, [3, 4]])
    finally:
        p.shutdown()
        d.shutdown()
