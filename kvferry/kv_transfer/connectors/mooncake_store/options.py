"""Typed options of the MooncakeStoreConnector, parsed from ``kv_connector_extra_config`` by
:func:`kvferry.kv_transfer.options.parse_options` (unknown keys are refused with the list of
valid ones). The Mooncake client settings (``local_hostname``, ``metadata_server``,
``master_server_address``, ``protocol``, ``device_name``, ``global_segment_size``,
``local_buffer_size``) are accepted here too and override ``MOONCAKE_CONFIG_PATH`` /
``MOONCAKE_MASTER`` (see :mod:`kvferry.kv_transfer.stores.mooncake_config`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.config import ConfigError
from kvferry.kv_transfer.stores.mooncake_client import ReplicateOptions

MiB = 1 << 20


@dataclass
class MooncakeStoreOptions:
    """``blocks_per_chunk``: engine blocks per store value (one value per chunk and rank,
    holding every layer's K and V). ``lookup_timeout_s``: how long a request waits for the
    store to say which chunks it holds before it computes them (a miss). ``load_timeout_s``:
    how long a load may take before its blocks are reported failed (the request then follows
    ``kv_load_failure_policy``). ``staging_buffer_bytes``: the one registered host buffer all
    transfers go through (half for loads, half for stores). ``max_pending_store_chunks``:
    chunks queued for storing beyond which new ones are skipped (a slow store never holds
    engine blocks for long). ``reconnect_interval_s``: how often an unreachable store is
    probed. ``replica_num``, ``with_hard_pin``, ``soft_pin_ttl_ms``, ``preferred_segment``:
    Mooncake's ``ReplicateConfig`` for puts. ``secret_file``: the deployment secret (else
    ``KVFERRY_KV_SECRET_FILE`` / ``KVFERRY_KV_SECRET``) that keys the values' checks."""

    blocks_per_chunk: int = 4
    lookup_timeout_s: float = 2.0
    load_timeout_s: float = 10.0
    staging_buffer_bytes: int = 128 * MiB
    max_pending_store_chunks: int = 256
    reconnect_interval_s: float = 1.0
    replica_num: int = 1
    with_hard_pin: bool = False
    soft_pin_ttl_ms: int | None = None
    preferred_segment: str | None = None
    secret_file: str | None = None
    # Mooncake client settings (override the environment's).
    local_hostname: str | None = None
    metadata_server: str | None = None
    master_server_address: str | None = None
    protocol: str | None = None
    device_name: str | None = None
    global_segment_size: int | str | None = None
    local_buffer_size: int | str | None = None

    def validate(self, owner: str) -> None:
        for name in ("blocks_per_chunk", "staging_buffer_bytes", "max_pending_store_chunks",
                     "replica_num"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"{owner}: {name} must be positive, got {getattr(self, name)}")
        for name in ("lookup_timeout_s", "load_timeout_s", "reconnect_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{owner}: {name} must be positive, got {getattr(self, name)}")
        if self.soft_pin_ttl_ms is not None and self.soft_pin_ttl_ms <= 0:
            raise ConfigError(f"{owner}: soft_pin_ttl_ms must be positive")
        if self.secret_file == "":
            raise ConfigError(f"{owner}: secret_file must be the path of a file")

    @property
    def replicate(self) -> ReplicateOptions:
        return ReplicateOptions(
            self.replica_num, self.with_hard_pin, self.soft_pin_ttl_ms, self.preferred_segment
        )

    def mooncake_overrides(self) -> dict[str, object]:
        names = ("local_hostname", "metadata_server", "master_server_address", "protocol",
                 "device_name", "global_segment_size", "local_buffer_size")  # fmt: skip
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}
