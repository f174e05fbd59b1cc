"""Offload connectors driven step by step around the real scheduler, with real copies.

The harness's fake forward checks the KV of every token a request builds on (local hits,
loads from host or disk) against the value its prefix must have, so a wrong or stale block
anywhere fails the test. Every test ends with the leak check: engine pool and scheduler
empty, and the offload pool idle and consistent.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvferry.config import ConfigError
from kvferry.kv_transfer.offload.disk import HEADER
from kvferry.request import Request, RequestStatus
from tests.helpers.offload_harness import OffloadHarness
from tests.helpers.scheduler import create_request

SIMPLE = "SimpleCPUOffloadConnector"
OFFLOAD = "OffloadingConnector"


def prompt(i: int, n: int = 70) -> list[int]:
    return list(range(1000 * i, 1000 * i + n))


def req(i: int, n: int = 70, max_tokens: int = 4, **kw: Any) -> Request:
    return create_request(prompt_token_ids=prompt(i, n), max_tokens=max_tokens, **kw)


def run_prompts(h: OffloadHarness, ids: list[int], n: int = 70, max_tokens: int = 4) -> None:
    for i in ids:
        h.add(req(i, n, max_tokens))
    h.run()


def slow(h: OffloadHarness, method: str, delay: float = 0.0, gate: threading.Event | None = None):
    """Make the transfer engine's ``method`` (``_store``, ``_load``, ...) wait first."""
    real = getattr(h.engine, method)

    def wrapped(p: Any) -> int:
        if gate is not None:
            assert gate.wait(10), "gate never opened"
        time.sleep(delay)
        return real(p)

    setattr(h.engine, method, wrapped)


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        (SIMPLE, {"num_cpu_blocks": 64}),
        (SIMPLE, {"num_cpu_blocks": 64, "lazy_offload": True, "lazy_window_blocks": 12}),
        (OFFLOAD, {"num_cpu_chunks": 32, "blocks_per_chunk": 2, "offload_prompt_only": False}),
        (OFFLOAD, {"num_cpu_chunks": 64, "eviction_policy": "arc"}),
        (SIMPLE, {"num_cpu_blocks": 64, "host_store_mode": "inline"}),
        (OFFLOAD, {"num_cpu_chunks": 64, "host_store_mode": "inline"}),
    ],
)
def test_prefixes_evicted_from_the_pool_come_back_from_the_host(name: str, extra: dict) -> None:
    h = OffloadHarness(name, extra, num_blocks=12)
    run_prompts(h, [0, 1, 2, 3])
    checked = h.checked_tokens
    run_prompts(h, [0, 1, 2, 3])
    stats = h.stats()
    # Lazy mode only catches blocks while they sit at the head of the free queue.
    assert stats["hit_tokens_host"] >= (64 if extra.get("lazy_offload") else 3 * 64), stats
    assert h.checked_tokens - checked >= stats["hit_tokens_host"]
    if name == SIMPLE:  # one load event and one store event per step at most
        assert all(len(m.loads) <= 1 and len(m.stores) <= 1 for m in h.metas)
    h.assert_clean()
    h.shutdown()


@pytest.mark.parametrize(
    ("name", "extra"),
    [(SIMPLE, {"num_cpu_blocks": 6}), (OFFLOAD, {"num_cpu_chunks": 3, "eviction_policy": "arc"})],
)
def test_eviction_under_a_tiny_offload_pool(name: str, extra: dict) -> None:
    h = OffloadHarness(name, extra, num_blocks=12)
    for _ in range(2):
        run_prompts(h, list(range(6)), n=50)
    stats = h.stats()
    assert stats["evicted_host"] > 0
    assert len(h.connector.scheduler_half.mgr.host) <= 6  # type: ignore[attr-defined]
    h.assert_clean()
    h.shutdown()


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        (SIMPLE, {"num_cpu_blocks": 64}),
        (OFFLOAD, {"num_cpu_chunks": 64, "offload_prompt_only": False}),
    ],
)
def test_preemption_while_stores_are_in_flight(name: str, extra: dict) -> None:
    h = OffloadHarness(name, extra, num_blocks=10)
    slow(h, "_store", delay=0.01)
    flushes: list[tuple[list[int], int]] = []
    core = h.worker_conn.worker_half.core  # type: ignore[attr-defined]
    real_flush = core.flush

    def recording_flush(job_ids: list[int]) -> None:
        flushes.append((list(job_ids), h.engine.num_in_flight()))
        real_flush(job_ids)

    core.flush = recording_flush
    a, b = req(0, 40, max_tokens=80, ignore_eos=True), req(1, 40, max_tokens=80, ignore_eos=True)
    h.add(a)
    h.add(b)
    h.run()
    assert h.scheduler.num_preemptions > 0
    assert any(in_flight for _, in_flight in flushes), "no flush met a store still running"
    assert len(h.tokens[a.request_id]) == len(h.tokens[b.request_id]) == 80
    # The preempted request came back on its offloaded blocks: checked by the forward.
    assert h.stats().get("hit_tokens_host", 0) > 0
    h.assert_clean()
    h.shutdown()


@pytest.mark.parametrize(
    ("name", "extra"), [(SIMPLE, {"num_cpu_blocks": 64}), (OFFLOAD, {"num_cpu_chunks": 64})]
)
def test_abort_during_a_load_keeps_blocks_until_the_load_is_done(name: str, extra: dict) -> None:
    h = OffloadHarness(name, extra, num_blocks=12)
    run_prompts(h, [0, 1, 2, 3])  # prompt 0 is now on the host only
    gate = threading.Event()
    slow(h, "_load", gate=gate)
    r = req(0)
    h.add(r)
    for _ in range(5):
        h.step()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.scheduler.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    held = h.scheduler.kv_cache_manager.get_num_held_blocks(r.request_id)
    assert held > 0 and r.request_id in h.scheduler.requests
    for _ in range(3):
        h.step()
        assert h.scheduler.kv_cache_manager.get_num_held_blocks(r.request_id) == held
    gate.set()
    h.assert_clean()
    h.shutdown()


@pytest.mark.parametrize(
    ("name", "extra"), [(SIMPLE, {"num_cpu_blocks": 64}), (OFFLOAD, {"num_cpu_chunks": 64})]
)
def test_repeated_lookups_are_idempotent(name: str, extra: dict) -> None:
    h = OffloadHarness(name, extra, num_blocks=12)
    run_prompts(h, [0, 1, 2, 3])
    r = req(0)
    answers = [h.connector.get_num_new_matched_tokens(r, 0) for _ in range(3)]
    assert answers == [(64, True)] * 3
    answers = [h.connector.get_num_new_matched_tokens(r, 16) for _ in range(2)]
    assert answers == [(48, True)] * 2
    host = h.connector.scheduler_half.mgr.host  # type: ignore[attr-defined]
    pins = [host.get(r.block_hashes[i]).pins for i in range(4)]
    assert pins == [0, 1, 1, 1]  # the last lookup's pin only
    h.add(r)
    h.run()
    assert h.finished[r.request_id].finish_reason == "length"
    h.assert_clean()
    h.shutdown()


@pytest.mark.parametrize(
    ("name", "extra"), [(SIMPLE, {"num_cpu_blocks": 64}), (OFFLOAD, {"num_cpu_chunks": 64})]
)
def test_a_failed_store_is_never_published(name: str, extra: dict) -> None:
    h = OffloadHarness(name, extra, num_blocks=12)

    def failing_store(p: Any) -> int:
        raise OSError("injected store failure")

    h.engine._store = failing_store  # type: ignore[method-assign]
    run_prompts(h, [0, 1, 2, 3])
    run_prompts(h, [0, 1, 2, 3])
    stats = h.stats()
    assert stats["store_failed"] == stats["store_jobs"] > 0
    assert "hit_tokens_host" not in stats
    assert len(h.connector.scheduler_half.mgr.host) == 0  # type: ignore[attr-defined]
    h.assert_clean()
    h.shutdown()


def test_a_lookup_waits_for_a_store_in_flight() -> None:
    h = OffloadHarness(OFFLOAD, {"num_cpu_chunks": 64}, num_blocks=12)
    gate = threading.Event()
    slow(h, "_store", gate=gate)
    h.add(req(0, max_tokens=1))
    while not any(m.stores for m in h.metas):
        h.step()
    r = req(0)
    assert h.connector.get_num_new_matched_tokens(r, 0) == (None, False)
    gate.set()
    while h.connector.get_num_new_matched_tokens(r, 0) == (None, False):
        h.step()
    assert h.connector.get_num_new_matched_tokens(r, 0) == (64, True)
    h.connector.request_finished(r, [])  # drop the lookup's pin: r never runs
    h.assert_clean()
    h.shutdown()


def _disk(tmp_path: Path, **kw: Any) -> dict:
    return {"num_cpu_chunks": 2, "disk_path": str(tmp_path), "num_disk_chunks": 64, **kw}


def test_disk_tier_survives_a_restart(tmp_path: Path) -> None:
    first = OffloadHarness(OFFLOAD, _disk(tmp_path), num_blocks=12)
    run_prompts(first, [0, 1, 2, 3])
    first.assert_clean()
    first.shutdown()
    files = list(tmp_path.rglob("*.kvc"))
    assert len(files) == 16  # 4 full blocks of each prompt
    second = OffloadHarness(OFFLOAD, _disk(tmp_path), num_blocks=12)
    run_prompts(second, [0, 1, 2, 3])
    stats = second.stats()
    assert stats["hit_tokens_disk"] == 4 * 64
    # Files found at start are checked before they are offered: read back through the tiny
    # host tier when it has room, else checked in place and then loaded from the file.
    assert stats.get("promote_jobs", 0) + stats.get("verify_jobs", 0) == 16
    assert second.checked_tokens >= 4 * 64
    second.assert_clean()
    second.shutdown()


def test_corrupt_and_truncated_chunks_are_misses(tmp_path: Path) -> None:
    first = OffloadHarness(OFFLOAD, _disk(tmp_path), num_blocks=12)
    run_prompts(first, [0, 1])
    first.assert_clean()
    first.shutdown()
    hashes = [req(i).block_hashes for i in (0, 1)]
    folder = next(tmp_path.rglob("rank0"))
    corrupt = folder / f"{hashes[0][1].hex()}.kvc"  # prompt 0, second block
    raw = bytearray(corrupt.read_bytes())
    raw[HEADER.size + 100] ^= 0x01
    corrupt.write_bytes(bytes(raw))
    truncated = folder / f"{hashes[1][0].hex()}.kvc"  # prompt 1, first block
    truncated.write_bytes(truncated.read_bytes()[:-8])
    size = corrupt.stat().st_size
    second = OffloadHarness(OFFLOAD, _disk(tmp_path), num_blocks=12)
    run_prompts(second, [0, 1])
    stats = second.stats()
    assert stats["corrupt_chunks"] == 1  # found when read; the truncated one at start
    assert stats["hit_tokens_disk"] == 16  # prompt 0's first block; the rest recomputed
    second.assert_clean()
    second.shutdown()
    # The bad files were deleted, and the recomputed chunks written again in their place:
    # a third engine hits everything (and its forward checks every loaded value).
    assert corrupt.stat().st_size == truncated.stat().st_size == size
    third = OffloadHarness(OFFLOAD, _disk(tmp_path), num_blocks=12)
    run_prompts(third, [0, 1])
    assert third.stats()["hit_tokens_disk"] == 2 * 64
    third.assert_clean()
    third.shutdown()


def test_prefix_caching_off_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="needs prefix caching"):
        OffloadHarness(SIMPLE, {"num_cpu_blocks": 8}, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="valid options are"):
        OffloadHarness(OFFLOAD, {"num_cpu_chunks": 8, "cpu_blocks": 3})


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_follows_the_failure_policy(policy: str) -> None:
    h = OffloadHarness(SIMPLE, {"num_cpu_blocks": 64}, num_blocks=12, policy=policy)
    run_prompts(h, [0, 1, 2, 3])

    def failing_load(p: Any) -> int:
        raise OSError("injected load failure")

    real = h.engine._load
    h.engine._load = failing_load  # type: ignore[method-assign]
    r = req(0)
    h.add(r)
    h.run()
    out = h.finished[r.request_id]
    if policy == "fail":
        assert out.finish_reason == "error"
    else:  # recomputed from scratch; the forward checked every value
        assert out.finish_reason == "length" and len(h.tokens[r.request_id]) == 4
    h.engine._load = real  # type: ignore[method-assign]
    h.assert_clean()
    assert h.stats()["load_failed"] == 1
    h.shutdown()


def test_inline_stores_are_done_when_the_step_returns() -> None:
    h = OffloadHarness(SIMPLE, {"num_cpu_blocks": 64, "host_store_mode": "inline"})
    assert h.engine.inline_stores
    run_prompts(h, [0])
    assert h.engine.num_in_flight() == 0
    assert h.stats()["store_jobs"] > 0
    h.assert_clean()
    h.shutdown()


def test_host_store_mode_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"host_store_mode must be one of \['auto'"):
        OffloadHarness(SIMPLE, {"num_cpu_blocks": 8, "host_store_mode": "sometimes"})
