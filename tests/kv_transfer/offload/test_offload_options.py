"""Offload connector set-up: typed options with unknown ones rejected, and the split
connector naming a hook called on the wrong role."""

from __future__ import annotations

import pytest

from kvferry.config import ConfigError
from kvferry.kv_transfer.connectors.offloading.options import OffloadingOptions
from kvferry.kv_transfer.connectors.simple_cpu_offload.options import SimpleCPUOffloadOptions
from kvferry.kv_transfer.options import parse_options

# -- options ------------------------------------------------------------------------------


def test_options_are_typed_and_unknown_ones_rejected() -> None:
    opts = parse_options(
        OffloadingOptions, {"cpu_bytes_to_use": 1 << 20, "blocks_per_chunk": 4}, "O"
    )
    assert opts.num_host_chunks(1 << 16, "O") == 16
    with pytest.raises(ConfigError, match="valid options are .*blocks_per_chunk"):
        parse_options(OffloadingOptions, {"cpu_bytes": 1}, "O")
    with pytest.raises(ConfigError, match="set cpu_bytes_to_use"):
        parse_options(OffloadingOptions, {}, "O")
    with pytest.raises(ConfigError, match="invalid value"):
        parse_options(OffloadingOptions, {"cpu_bytes_to_use": "1G"}, "O")
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        parse_options(OffloadingOptions, {"num_cpu_chunks": 4, "eviction_policy": "x"}, "O")
    s = parse_options(SimpleCPUOffloadOptions, {"cpu_bytes_to_use": 4096}, "S")
    assert s.num_blocks(1024, world_size=2, owner="S") == 2
    assert (
        parse_options(SimpleCPUOffloadOptions, {"num_cpu_blocks": 7}, "S").num_blocks(1, 1, "S")
        == 7
    )
    with pytest.raises(ConfigError, match="hold no KV block"):
        s.num_blocks(1 << 20, 1, "S")
    with pytest.raises(ConfigError, match="must be positive"):
        parse_options(SimpleCPUOffloadOptions, {"num_cpu_blocks": 0}, "S")


def test_split_connector_names_the_hook_called_on_the_wrong_role() -> None:
    from tests.helpers.offload_harness import OffloadHarness

    h = OffloadHarness("SimpleCPUOffloadConnector", {"num_cpu_blocks": 8})
    with pytest.raises(RuntimeError, match="register_kv_caches is a worker-side hook"):
        h.sched_conn.register_kv_caches({})
    with pytest.raises(RuntimeError, match="build_connector_meta is a scheduler-side hook"):
        h.worker_conn.build_connector_meta(None)  # type: ignore[arg-type]
    h.shutdown()
