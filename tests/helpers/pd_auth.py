"""Shared by the P/D trust tests: the test secrets and compat description, a ``PeerAuth``
built from a secret, the check that a refusal says nothing about the instance, and the
NixlConnector config of the engine-process tests."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from kvferry.kv_transfer.connectors.pd import handshake as hs
from kvferry.kv_transfer.connectors.pd.auth import EnvelopeAuth, ParamsSigner, PeerAuth
from kvferry.kv_transfer.secret import DeploymentSecret

SECRET = DeploymentSecret(b"s3cret-for-the-tests-0123456789", "test")
OTHER = DeploymentSecret(b"another-secret-entirely-987654321", "test")
COMPAT = hs.Compat("model=m weights=w dtype=float32 layout=x protocol=2")


LEASE_S = 4.0


def _auth(secret: DeploymentSecret = SECRET, window: float = 60.0, clock: Any = time.time):
    return PeerAuth(
        EnvelopeAuth(secret.key_for("nixl-side-channel"), window, clock),
        ParamsSigner(secret.key_for("nixl-kv-params"), 600.0, clock),
        secret.source,
    )


def _refusal(frame: bytes) -> hs.Envelope:
    env = msgspec.msgpack.decode(frame, type=hs.Envelope)
    assert (env.compat_hash, env.compat_desc) == ("", ""), env  # nothing about this instance
    return env


def _kv(secret: Path, policy: str = "fail") -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "side_channel_port": 0,
            "handshake_timeout": 1.5,
            "transfer_timeout": 10.0,
            "kv_lease_duration": LEASE_S,
            "heartbeat_interval": 0.5,
            "secret_file": str(secret),
        },
    }
