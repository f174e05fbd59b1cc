"""The deployment secret: one key shared by every kvferry instance of a deployment.

It authenticates what crosses the network between instances (the P/D side channel, the
``kv_transfer_params`` a prefill instance issues) and keys the checksums of stored KV (the disk
tier), so that only holders of the secret can talk to an instance's connector or plant KV that
it will load. It is never taken from the command line (which any local user can read in
``ps``): it comes from a file or the environment, first match wins:

1. ``kv_connector_extra_config["secret_file"]``: path of a file holding it;
2. ``KVFERRY_KV_SECRET_FILE``: path of a file holding it;
3. ``KVFERRY_KV_SECRET``: the secret itself.

The file's content, stripped of surrounding whitespace, is the secret; it must be at least
:data:`MIN_SECRET_BYTES` bytes. The key handed to users of the secret is never the secret
itself but one derived per purpose (:meth:`DeploymentSecret.key_for`), so a key leaked from one
use (say, a disk-tier key) does not forge messages of another (the side channel).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvferry import envs
from kvferry.config import ConfigError

MIN_SECRET_BYTES = 16
_MAX_SECRET_FILE_BYTES = 1 << 16


@dataclass(frozen=True)
class DeploymentSecret:
    """The loaded secret; ``source`` says where it came from (for logs, never the value)."""

    value: bytes
    source: str

    def key_for(self, purpose: str) -> bytes:
        """A 32-byte key for one purpose (e.g. ``"nixl-side-channel"``, ``"disk-tier"``)."""
        return hashlib.blake2b(
            purpose.encode(), key=self.value[:64], digest_size=32, person=b"kvferry-secret"
        ).digest()

    def __repr__(self) -> str:  # never print the value
        return f"DeploymentSecret(source={self.source!r})"


def _read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_SECRET_FILE_BYTES + 1)
    except OSError as e:
        reason = e.strerror or e
        raise ConfigError(
            f"cannot read the deployment secret from {what} {path!r}: {reason}"
        ) from None
    if len(data) > _MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"the deployment secret file {path!r} is larger than 64 KiB")
    return data.strip()


def _checked(value: bytes, source: str) -> DeploymentSecret:
    if len(value) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the deployment secret from {source} has {len(value)} bytes; it needs at least "
            f"{MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > FILE`)"
        )
    return DeploymentSecret(value, source)


def load_deployment_secret(
    extra_config: Mapping[str, Any] | None = None,
) -> DeploymentSecret | None:
    """The configured deployment secret, or None when none is configured; ConfigError when
    one is configured but unreadable or too short."""
    path = (extra_config or {}).get("secret_file")
    if path is not None:
        if not isinstance(path, str) or not path:
            raise ConfigError("secret_file must be the path of a file holding the secret")
        return _checked(_read_file(path, "secret_file"), f"secret_file {path}")
    path = envs.kv_secret_file()
    if path:
        return _checked(_read_file(path, "KVFERRY_KV_SECRET_FILE"), "KVFERRY_KV_SECRET_FILE")
    value = envs.kv_secret()
    if value:
        return _checked(value.strip().encode(), "KVFERRY_KV_SECRET")
    return None


__all__ = ["DeploymentSecret", "MIN_SECRET_BYTES", "load_deployment_secret"]
