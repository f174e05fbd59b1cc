"""The scheduler's invariants, checked on demand (tests, debugging): a read-only walk."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kvferry.core.kv_cache_manager import KVCacheManager
from kvferry.request import Request, RequestStatus


def check_scheduler_integrity(
    requests: Mapping[str, Request],
    waiting: Collection[Request],
    kv_holding: Collection[Request],
    running: Collection[Request],
    held_ids: set[str],
    loads_done_ids: set[str],
    kv_cache_manager: KVCacheManager,
) -> None:
    """Assert the scheduler's invariants on top of the KV cache manager's: every known request
    is in exactly one queue, or finished and held (by the connector, or failed while being
    scheduled: ``held_ids``); plain waiting requests hold no blocks; only known requests hold
    blocks; a finished load belongs to a parked request. Raises AssertionError."""
    kvm = kv_cache_manager
    kvm.check_integrity()
    queued = [*waiting, *kv_holding, *running]
    ids = {r.request_id for r in queued}
    assert len(ids) == len(queued), "a request is queued twice"
    assert ids.isdisjoint(held_ids), "a held (finished) request is still queued"
    assert ids | held_ids == set(requests), "requests and queues disagree"
    assert all(requests[i].is_finished() for i in held_ids), "a held request is not finished"
    assert all(r.status == RequestStatus.RUNNING for r in running)
    waiting_ok = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    assert all(r.status in waiting_ok for r in waiting), "bad status in waiting"
    assert not any(kvm.get_num_held_blocks(r.request_id) for r in waiting), "waiting holds KV"
    holding_ok = (*waiting_ok, RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert all(r.status in holding_ok for r in kv_holding), "bad status in kv_holding"
    parked = {r.request_id for r in kv_holding if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
    assert loads_done_ids <= parked, "a finished load's request is not parked"
    assert set(kvm.req_to_blocks) <= set(requests), "blocks held by an unknown request"
