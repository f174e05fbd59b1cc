"""Each built-in connector says which tier its external hits come from; the tiered
OffloadingConnector splits a hit by the tier each chunk is read from. The split reaches the
request's metrics and the scheduler's stats. Lifecycle tests end with the harness's leak
check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvferry.kv_transfer.base import CacheHitSource
from kvferry.kv_transfer.connectors.example_connector import ExampleConnector
from kvferry.kv_transfer.connectors.nixl.connector import NixlConnector
from kvferry.kv_transfer.connectors.offloading_connector import OffloadingConnector
from kvferry.kv_transfer.connectors.simple_cpu_offload_connector import SimpleCPUOffloadConnector
from tests.helpers.offload_harness import OffloadHarness
from tests.helpers.scheduler import create_request

OFFLOAD = "OffloadingConnector"


def test_built_in_connectors_declare_their_tier() -> None:
    assert ExampleConnector._cache_hit_source is CacheHitSource.DISK
    assert NixlConnector._cache_hit_source is CacheHitSource.P2P
    assert SimpleCPUOffloadConnector._cache_hit_source is CacheHitSource.HOST
    assert OffloadingConnector._cache_hit_source is CacheHitSource.HOST


def _run(h: OffloadHarness, ids: list[int]) -> list[Any]:
    reqs = [
        create_request(prompt_token_ids=range(1000 * i, 1000 * i + 70), max_tokens=4) for i in ids
    ]
    for r in reqs:
        h.add(r)
    h.run()
    return [h.finished[r.request_id] for r in reqs]


def _disk(tmp_path: Path) -> dict[str, Any]:
    return {"num_cpu_chunks": 2, "disk_path": str(tmp_path), "num_disk_chunks": 64}


def _by_source(h: OffloadHarness) -> dict[str, int]:
    stats = h.scheduler.make_stats()
    assert stats is not None
    return stats.connector_prefix_cache_hits_by_source


def test_simple_offload_hits_are_host_hits() -> None:
    h = OffloadHarness("SimpleCPUOffloadConnector", {"num_cpu_blocks": 64}, num_blocks=12)
    _run(h, [0, 1, 2, 3])
    outs = _run(h, [0, 1, 2, 3])
    hit = sum(o.num_external_cached_tokens for o in outs)
    assert hit > 0
    assert all(
        o.external_cache_hit_sources
        == ({"host": o.num_external_cached_tokens} if o.num_external_cached_tokens else {})
        for o in outs
    )
    assert _by_source(h) == {"host": hit}
    h.assert_clean()
    h.shutdown()


def test_offload_hits_split_by_tier(tmp_path: Path) -> None:
    first = OffloadHarness(OFFLOAD, _disk(tmp_path), num_blocks=12)
    _run(first, [0, 1, 2, 3])
    outs = _run(first, [0, 1, 2, 3])  # a tiny host tier: most chunks come back from disk
    stats = first.stats()
    for o in outs:
        assert sum(o.external_cache_hit_sources.values()) == o.num_external_cached_tokens
    by_source = _by_source(first)
    assert by_source.get("disk", 0) > 0 and by_source.get("host", 0) > 0, by_source
    assert by_source == {"host": stats["hit_tokens_host"], "disk": stats["hit_tokens_disk"]}
    first.assert_clean()
    first.shutdown()
    # A new engine on the same folder: every hit is a disk hit.
    second = OffloadHarness(OFFLOAD, _disk(tmp_path), num_blocks=12)
    outs = _run(second, [0, 1, 2, 3])
    assert [o.external_cache_hit_sources for o in outs] == [{"disk": 64}] * 4
    assert _by_source(second) == {"disk": 4 * 64}
    second.assert_clean()
    second.shutdown()
