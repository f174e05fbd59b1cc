"""Which requests a step's KV load failures hit, and how much of their KV is still valid.

Workers report bad loads two ways in ``KVConnectorOutput``: ``failed_recving`` (a whole async
load failed) and ``invalid_block_ids`` (engine blocks whose loaded content is bad). This module
turns both into one :class:`LoadFailure` per request; the scheduler applies them (rewinds the
requests, unpublishes and evicts the bad blocks, and fails or recomputes per
``kv_load_failure_policy``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvferry.core.kv_cache_manager import KVCacheManager
from kvferry.request import Request, RequestStatus
from kvferry.step_types.kv_connector_output import KVConnectorOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadFailure:
    """A request whose loaded KV is (partly) bad: only its first ``num_valid_tokens`` tokens
    can be trusted. ``bad_block_index`` is the first bad block of its table, or None when the
    connector failed the whole load (``failed_recving``)."""

    num_valid_tokens: int
    bad_block_index: int | None
    reason: str


@dataclass
class StepLoadFailures:
    """The decisions for one step: the requests hit, and the pool blocks whose KV is bad (they
    must stop producing prefix-cache hits at once, whoever holds them)."""

    by_request: dict[str, LoadFailure] = field(default_factory=dict)
    bad_block_ids: set[int] = field(default_factory=set)


def find_load_failures(
    kv_out: KVConnectorOutput,
    kv_cache_manager: KVCacheManager,
    requests: Mapping[str, Request],
    candidates: Iterable[Request],
    num_scheduled_tokens: Mapping[str, int],
) -> StepLoadFailures:
    """Requests hit by this step's ``failed_recving`` / ``invalid_block_ids``.

    ``candidates`` are the requests whose blocks may hold loaded KV: those waiting for an
    async load and the running ones (sync loads). Only blocks covering tokens computed
    *before* this step count; tokens of this step are recomputed anyway. Every request that
    depends on a bad block is truncated to it, including requests sharing it through a
    same-step prefix hit (both then rewrite the same content; simpler than electing one).
    """
    result = StepLoadFailures()
    for req_id in sorted(kv_out.failed_recving):
        request = requests.get(req_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            result.by_request[req_id] = LoadFailure(0, None, "the connector failed the whole load")
    invalid = _in_pool(kv_out.invalid_block_ids, kv_cache_manager.num_blocks)
    null = kv_cache_manager.block_pool.null_block
    if null is not None:  # holds no KV: nothing loaded into it can be bad
        invalid.discard(null.block_id)
    if not invalid:
        return result
    result.bad_block_ids = invalid
    bs = kv_cache_manager.block_size
    for request in candidates:
        req_id = request.request_id
        if req_id in result.by_request:
            continue
        computed_before = request.num_computed_tokens - num_scheduled_tokens.get(req_id, 0)
        # The first bad block of any KV cache group truncates the request.
        found = [
            (i, block_id)
            for table in kv_cache_manager.get_block_ids(req_id)
            for i, block_id in enumerate(table[: -(-computed_before // bs)])
            if block_id in invalid
        ]
        if found:
            bad, block_id = min(found)
            reason = f"block {block_id} (tokens {bad * bs}..{(bad + 1) * bs - 1}) is invalid"
            result.by_request[req_id] = LoadFailure(bad * bs, bad, reason)
    return result


def _in_pool(block_ids: set[int], num_blocks: int) -> set[int]:
    valid = {b for b in block_ids if 0 <= b < num_blocks}
    if len(valid) != len(block_ids):
        logger.warning("ignoring invalid_block_ids outside the pool: %s", block_ids - valid)
    return valid
