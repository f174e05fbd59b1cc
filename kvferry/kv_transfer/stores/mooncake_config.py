"""How a Mooncake Store client is configured, read the way Mooncake's own loader
(``mooncake.mooncake_config.MooncakeConfig.load_from_env``) reads it, so a site that already
runs vLLM or LMCache on Mooncake reuses its configuration unchanged:

1. ``MOONCAKE_CONFIG_PATH``: a JSON file with ``local_hostname``, ``metadata_server``,
   ``master_server_address`` (all three required), ``protocol`` ("tcp"), ``device_name``
   (""), ``global_segment_size`` and ``local_buffer_size`` (bytes, or "4GB"-style strings);
2. else ``MOONCAKE_MASTER`` (the master's ``host:port``) with ``MOONCAKE_LOCAL_HOSTNAME``
   ("localhost"), ``MOONCAKE_TE_META_DATA_SERVER`` ("P2PHANDSHAKE"), ``MOONCAKE_PROTOCOL``,
   ``MOONCAKE_DEVICE``, ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` and ``MOONCAKE_LOCAL_BUFFER_SIZE``.

Keys of the same names given by the connector (``kv_connector_extra_config``) override what
the environment says; they alone are enough when they name the three required fields.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvferry.config import ConfigError

# Mooncake's own defaults (mooncake_config.py).
DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200
DEFAULT_LOCAL_BUFFER_SIZE = 1 << 30

CONFIG_KEYS = (
    "local_hostname",
    "metadata_server",
    "master_server_address",
    "protocol",
    "device_name",
    "global_segment_size",
    "local_buffer_size",
)
_REQUIRED = ("local_hostname", "metadata_server", "master_server_address")
_SUFFIXES = (
    ("tb", 1 << 40),
    ("gb", 1 << 30),
    ("mb", 1 << 20),
    ("kb", 1 << 10),
    ("t", 1 << 40),
    ("g", 1 << 30),
    ("m", 1 << 20),
    ("k", 1 << 10),
    ("b", 1),
)


def parse_size(value: Any, name: str) -> int:
    """Bytes from an int or a string such as ``"512MB"``, ``"3.5 GB"`` or ``"1024"``."""
    if isinstance(value, bool):
        raise ConfigError(f"mooncake config: {name} must be a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        s = value.strip().lower()
        mult = 1
        for suffix, m in _SUFFIXES:
            if s.endswith(suffix):
                s, mult = s[: -len(suffix)].strip(), m
                break
        try:
            n = int(float(s) * mult)
        except ValueError:
            raise ConfigError(f"mooncake config: {name}={value!r} is not a size") from None
    else:
        raise ConfigError(f"mooncake config: {name} must be a size, got {value!r}")
    if n < 0:
        raise ConfigError(f"mooncake config: {name} must not be negative, got {value!r}")
    return n


@dataclass(frozen=True)
class MooncakeStoreConfig:
    """One client's settings; ``source`` says where they came from (for logs)."""

    local_hostname: str
    metadata_server: str
    master_server_address: str
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    source: str = "kv_connector_extra_config"

    def validate(self) -> MooncakeStoreConfig:
        for name in _REQUIRED:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(
                    f"mooncake config ({self.source}): {name} must be a non-empty string, "
                    f"got {value!r}"
                )
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ConfigError(f"mooncake config ({self.source}): protocol must be set")
        host, sep, port = self.master_server_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(
                f"mooncake config ({self.source}): master_server_address must be host:port, "
                f"got {self.master_server_address!r}"
            )
        return replace(self, protocol=self.protocol.strip().lower())

    def with_segment(self, global_segment_size: int) -> MooncakeStoreConfig:
        return replace(self, global_segment_size=global_segment_size)


def _from_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"MOONCAKE_CONFIG_PATH={path!r}: cannot read it: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"MOONCAKE_CONFIG_PATH={path!r}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"MOONCAKE_CONFIG_PATH={path!r}: must hold a JSON object")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ConfigError(f"MOONCAKE_CONFIG_PATH={path!r}: missing required field(s) {missing}")
    return {k: data[k] for k in CONFIG_KEYS if k in data and data[k] is not None}


def _from_master_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {
        "master_server_address": env["MOONCAKE_MASTER"],
        "local_hostname": env.get("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
        "metadata_server": env.get("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
        "protocol": env.get("MOONCAKE_PROTOCOL", "tcp"),
        "device_name": env.get("MOONCAKE_DEVICE", ""),
    }
    for key, var in (
        ("global_segment_size", "MOONCAKE_GLOBAL_SEGMENT_SIZE"),
        ("local_buffer_size", "MOONCAKE_LOCAL_BUFFER_SIZE"),
    ):
        if var in env:
            values[key] = env[var]
    return values


def load_mooncake_config(
    overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> MooncakeStoreConfig:
    """The client configuration from the environment (see the module docstring) with
    ``overrides`` on top; ConfigError with the reason when it is missing or invalid."""
    env = os.environ if environ is None else environ
    given = {k: v for k, v in (overrides or {}).items() if k in CONFIG_KEYS and v is not None}
    path = env.get("MOONCAKE_CONFIG_PATH")
    if path:
        values, source = _from_file(path), f"MOONCAKE_CONFIG_PATH={path}"
    elif env.get("MOONCAKE_MASTER"):
        values, source = _from_master_env(env), "MOONCAKE_MASTER"
    elif all(k in given for k in _REQUIRED):
        values, source = {}, "kv_connector_extra_config"
    else:
        raise ConfigError(
            "MooncakeStoreConnector needs a Mooncake configuration: set MOONCAKE_CONFIG_PATH "
            "(a JSON file with local_hostname, metadata_server, master_server_address, ...) "
            "or MOONCAKE_MASTER (host:port), or give local_hostname, metadata_server and "
            "master_server_address in kv_connector_extra_config"
        )
    if given:
        values.update(given)
        if source != "kv_connector_extra_config":
            source += " + kv_connector_extra_config"
    for key in ("local_hostname", "metadata_server", "master_server_address", "protocol"):
        if key in values and not isinstance(values[key], str):
            raise ConfigError(f"mooncake config ({source}): {key} must be a string")
    device = values.get("device_name", "")
    if not isinstance(device, str):
        raise ConfigError(f"mooncake config ({source}): device_name must be a string")
    return MooncakeStoreConfig(
        local_hostname=values.get("local_hostname", ""),
        metadata_server=values.get("metadata_server", ""),
        master_server_address=values.get("master_server_address", ""),
        protocol=values.get("protocol", "tcp"),
        device_name=device,
        global_segment_size=parse_size(
            values.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE), "global_segment_size"
        ),
        local_buffer_size=parse_size(
            values.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE), "local_buffer_size"
        ),
        source=source,
    ).validate()
