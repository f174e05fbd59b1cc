"""Admitting one waiting request: how many tokens it runs, the slots it needs, and the
connector's ``update_state_after_alloc``.

:func:`allocate_for_admission` decides and allocates; it never writes the request. The
scheduler applies the :class:`AdmissionDecision` (status, computed tokens, queues).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from kvferry.core.connector_state import RESUMED, ConnectorHookError, ConnectorState, PrefixHit
from kvferry.core.kv_cache_manager import KVCacheManager
from kvferry.request import Request


class Admission(enum.Enum):
    """What happened when the scheduler tried to admit the request at the head of ``waiting``."""

    SCHEDULED = enum.auto()
    # Cannot run now and nothing behind it may overtake it (FCFS): stop admitting.
    BLOCKED = enum.auto()
    # Cannot run now but must not hold up the queue (used by KV connectors: lookups that
    # answer "ask later", requests parked in WAITING_FOR_REMOTE_KVS).
    SKIPPED = enum.auto()
    # Admitted with blocks for an asynchronous KV load; nothing computed until it finishes.
    LOADING = enum.auto()
    # Ended with an error while being admitted (a KV connector hook failed for it).
    FAILED = enum.auto()


@dataclass(frozen=True)
class AdmissionDecision:
    """``SCHEDULED``: the request computes ``num_new`` tokens from ``num_computed_tokens`` this
    step. ``LOADING``: ``num_computed_tokens`` is what it holds once its async load is in
    (optimistic: corrected if the load fails). ``FAILED``: ``error`` says why."""

    outcome: Admission
    hit: PrefixHit = RESUMED
    num_computed_tokens: int = 0
    num_new: int = 0
    error: str | None = None


BLOCKED = AdmissionDecision(Admission.BLOCKED)


def allocate_for_admission(
    request: Request,
    hit: PrefixHit,
    *,
    token_budget: int,
    holders: Iterable[Request],
    kv_cache_manager: KVCacheManager,
    connector_state: ConnectorState,
    enable_chunked_prefill: bool,
) -> AdmissionDecision:
    """Allocate the slots ``request`` needs on top of ``hit`` and tell the connector.

    ``holders`` are the other requests that hold KV and must run to release it; an async load
    leaves the blocks they still need free. With chunked prefill off, a prompt that does not
    fit ``token_budget`` is BLOCKED.
    """
    num_computed = request.num_computed_tokens + hit.num_local + hit.num_external
    if hit.load_async:
        # Nothing computed until the load is in; keep blocks free for requests already
        # holding KV so that loads can never fill the pool with requests that cannot run.
        num_reserved = connector_state.num_reserved_blocks(holders)
        start, num_new = num_computed, 0
    else:
        # A full hit still recomputes the last token: its forward gives the logits.
        start = min(num_computed, request.num_tokens - 1)
        num_new = request.num_tokens - start
        if not enable_chunked_prefill and num_new > token_budget:
            return BLOCKED
        num_new, num_reserved = min(num_new, token_budget), 0
    new_blocks = kv_cache_manager.allocate_slots(
        request,
        start + num_new - num_computed,
        num_new_computed_tokens=hit.num_local,
        new_computed_blocks=hit.local_blocks,
        num_external_computed_tokens=hit.num_external,
        delay_cache_blocks=hit.load_async,
        num_reserved_blocks=num_reserved,
    )
    if new_blocks is None:
        return BLOCKED
    # KV connector: update_state_after_alloc for every admitted request (external 0 too).
    try:
        connector_state.after_alloc(request, hit)
    except ConnectorHookError as e:
        # Blocks just published to the prefix cache would never be computed: unpublish all
        # but the hit and what the request computed before.
        kv_cache_manager.uncache_blocks(request, request.num_computed_tokens + hit.num_local)
        return AdmissionDecision(Admission.FAILED, hit, error=str(e))
    if hit.load_async:
        return AdmissionDecision(Admission.LOADING, hit, num_computed)
    return AdmissionDecision(Admission.SCHEDULED, hit, start, num_new)
