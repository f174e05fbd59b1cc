"""The NixlConnector's start-up policy for the deployment secret: no unauthenticated side
channel beyond loopback, the secret file and its checks, and two NIXL agents that read
with a secret and only warn without one."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.nixl.connector import NixlConnector
from kvferry.kv_transfer.connectors.pd.auth import ParamsSigner
from kvferry.kv_transfer.connectors.pd.params import decode_params
from tests.helpers.nixl_config import nixl_engine_config
from tests.helpers.pd_auth import SECRET, _auth
from tests.helpers.scheduler import make_kv_cache_config

# -- start-up policy --------------------------------------------------------------------------


def test_no_unauthenticated_side_channel_beyond_loopback(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVFERRY_KV_SECRET", raising=False)
    monkeypatch.delenv("KVFERRY_KV_SECRET_FILE", raising=False)
    kvc = make_kv_cache_config(32)
    role = KVConnectorRole.SCHEDULER
    with pytest.raises(ConfigError, match="allow_unauthenticated: true"):
        NixlConnector(nixl_engine_config("eng-x", "0.0.0.0"), role, kvc)
    with pytest.raises(ConfigError, match="KVFERRY_KV_SECRET_FILE"):
        NixlConnector(nixl_engine_config("eng-x", "10.1.2.3"), role, kvc)
    NixlConnector(nixl_engine_config("eng-x", "0.0.0.0", allow_unauthenticated=True), role, kvc)
    NixlConnector(nixl_engine_config("eng-x", "127.0.0.1"), role, kvc)
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET.value + b"\n")
    conn = NixlConnector(nixl_engine_config("eng-x", "0.0.0.0", secret_file=str(secret)), role, kvc)
    assert conn.connector_scheduler is not None and conn.connector_scheduler.signer is not None
    monkeypatch.setenv("KVFERRY_KV_SECRET_FILE", str(secret))
    NixlConnector(nixl_engine_config("eng-x", "10.1.2.3"), role, kvc)
    with pytest.raises(ConfigError, match="at least 16"):
        secret.write_bytes(b"short")
        NixlConnector(nixl_engine_config("eng-x", "127.0.0.1"), role, kvc)


def _hold_and_read(p: NixlConnector, d: NixlConnector, signer: ParamsSigner, port: int) -> tuple:
    """P holds blocks [3, 4] of a 32-token prompt; D reads them into [7, 8] with params
    that ``signer`` issued naming side-channel port ``port`` (as D's scheduler would)."""
    from kvferry.kv_transfer.connectors.pd.metadata import (
        PDConnectorMetadata as NixlConnectorMetadata,
    )
    from kvferry.kv_transfer.connectors.pd.metadata import (
        RecvSpec,
        SendSpec,
    )
    from kvferry.kv_transfer.connectors.pd.params import parse_remote, token_digest
    from kvferry.kv_transfer.connectors.pd.scheduler import _ref

    pw, dw = p.connector_worker, d.connector_worker
    assert pw is not None and dw is not None
    digest = token_digest(list(range(32)), 32)
    pw.bind(NixlConnectorMetadata(reqs_to_send=[SendSpec("p-1", [3, 4], 32, digest)]))
    params = decode_params(
        engine_id="eng-x", request_id="p-1", host="127.0.0.1", port=port, block_ids=[3, 4],
        num_tokens=32, cached_tokens=0, signer=signer,
    )  # fmt: skip
    remote = parse_remote({**params, "remote_port": pw.port}, 16)
    spec = RecvSpec("d-1", _ref(remote), [3, 4], [7, 8], 32, digest)
    dw.start_load(NixlConnectorMetadata(reqs_to_recv=[spec]), empty_step=True)
    got: set[str] = set()
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        got |= dw.get_finished()[1]
        pw.get_finished()
    return got, dw.get_failed_recving()


def test_two_agents_with_a_secret_read_and_warn_only_without(tmp_path, monkeypatch, caplog):
    pytest.importorskip("nixl", reason="needs the nixl package (extra 'nixl')")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.delenv("KVFERRY_KV_SECRET", raising=False)
    monkeypatch.delenv("KVFERRY_KV_SECRET_FILE", raising=False)
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET.value)
    kvc = make_kv_cache_config(16)
    shape = (2, 16, 16, 1, 8)
    role = KVConnectorRole.WORKER
    with caplog.at_level(logging.WARNING):
        d_plain = NixlConnector(nixl_engine_config("eng-x", "127.0.0.1"), role, kvc)
    warned = [r for r in caplog.records if "not authenticated" in r.getMessage()]
    assert len(warned) == 1
    d_plain.shutdown()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        p = NixlConnector(
            nixl_engine_config("eng-x", "127.0.0.1", secret_file=str(secret)), role, kvc
        )
        d = NixlConnector(
            nixl_engine_config("eng-x", "127.0.0.1", secret_file=str(secret)), role, kvc
        )
    assert not [r for r in caplog.records if "not authenticated" in r.getMessage()]
    src = {"model.layers.0.self_attn": torch.randn(shape)}
    dst = {"model.layers.0.self_attn": torch.zeros(shape)}
    try:
        p.register_kv_caches(src)
        d.register_kv_caches(dst)
        assert p.connector_worker is not None
        port = p.connector_worker.port
        # Params naming another port than the one signed: P refuses the claim, D reads nothing.
        assert _hold_and_read(p, d, _auth().params, port + 1) == ({"d-1"}, {"d-1"})
        assert not dst["model.layers.0.self_attn"].any()
        assert _hold_and_read(p, d, _auth().params, port) == ({"d-1"}, set())
        s, t = src["model.layers.0.self_attn"], dst["model.layers.0.self_attn"]
        assert torch.equal(t[:, [7, 8]], s[:, [3, 4]])
    finally:
        p.shutdown()
        d.shutdown()
