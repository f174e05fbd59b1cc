"""MooncakeStoreConnector options: typed, validated, unknown keys refused."""

from __future__ import annotations

import pytest

from kvferry.config import ConfigError
from kvferry.kv_transfer.connectors.mooncake_store.options import MooncakeStoreOptions
from kvferry.kv_transfer.options import parse_options


def test_unknown_key_lists_valid_options():
    with pytest.raises(ConfigError, match="valid options are .*blocks_per_chunk"):
        parse_options(MooncakeStoreOptions, {"blocks_per_chunks": 2}, "MooncakeStoreConnector")


@pytest.mark.parametrize(
    "extra",
    [
        {"blocks_per_chunk": 0},
        {"lookup_timeout_s": 0},
        {"replica_num": "two"},
        {"soft_pin_ttl_ms": -1},
        {"staging_buffer_bytes": -5},
    ],  # fmt: skip
)
def test_bad_values_are_refused(extra):
    with pytest.raises(ConfigError):
        parse_options(MooncakeStoreOptions, extra, "MooncakeStoreConnector")


def test_replication_and_overrides_pass_through():
    opts = parse_options(
        MooncakeStoreOptions,
        {"replica_num": 2, "soft_pin_ttl_ms": 1000, "master_server_address": "h:1"},
        "MooncakeStoreConnector",
    )
    assert opts.replicate.replica_num == 2 and opts.replicate.soft_pin_ttl_ms == 1000
    assert opts.mooncake_overrides() == {"master_server_address": "h:1"}
