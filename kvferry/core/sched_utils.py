"""Small pieces of the scheduler: the per-step plan, admission outcomes, stop checks, stats,
output building and the integrity check."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvferry.config import CacheConfig, ConfigError, SchedulerConfig
from kvferry.core.kv_cache_config import KVCacheConfig
from kvferry.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvferry.core.outputs import EngineCoreOutput
from kvferry.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvferry.request import PrefillStats, Request, RequestStatus
from kvferry.worker.runner_output import TokenLogprobs

if TYPE_CHECKING:
    from kvferry.core.connector_state import ConnectorState
    from kvferry.core.scheduler import Scheduler


@dataclass
class SchedulerStats:
    """A snapshot for logging; prefix-cache numbers are in tokens since the last reset."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    # KV connector (all zero without one). Of num_waiting_reqs, how many wait for a load.
    num_waiting_for_remote_kvs: int = 0
    # Finished requests whose blocks the connector still holds (delayed frees, orphaned loads).
    num_held_by_connector: int = 0
    # External lookups of admitted requests, in tokens: queried beyond the local hit, and hit.
    connector_prefix_cache_queries: int = 0
    connector_prefix_cache_hits: int = 0


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


@dataclass
class StepPlan:
    """What one ``Scheduler.schedule()`` call has decided so far."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # First-time and resumed requests: sent to workers with all tokens and the whole table.
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    cached_new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    has_sync_kv_loads: bool = False
    # A running request found no free block (it preempted, or waits for a connector's
    # frees): memory is tight, so no newcomer is admitted this step.
    out_of_blocks: bool = False

    def _take(self, request: Request, num_tokens: int) -> None:
        assert 0 < num_tokens <= self.token_budget, "scheduled tokens must fit the budget"
        assert request.request_id not in self.num_scheduled_tokens, "scheduled twice"
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens

    def schedule_new(self, request: Request, num_tokens: int) -> None:
        self._take(request, num_tokens)
        self.new_reqs.append(request)

    def schedule_cached(self, request: Request, num_tokens: int, blocks: KVCacheBlocks) -> None:
        self._take(request, num_tokens)
        self.cached_reqs.append(request)
        self.cached_new_block_ids.append(blocks.get_block_ids() if blocks.num_blocks else None)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Apply stop conditions to the request's last appended token; set status and stop_reason.

    Order and semantics follow vLLM: length limits win (``max_tokens``, or ``num_tokens``
    reaching ``max_model_len``), then ``min_tokens`` holds back EOS and stop tokens (the
    sampler is expected to mask them too), then EOS (unless ``ignore_eos``), then
    ``stop_token_ids`` (``stop_reason`` = the token id). Returns True if the request finished.
    """
    params = request.sampling_params
    if request.num_tokens >= max_model_len or (
        params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_output_tokens < params.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last in request.eos_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    return False


def append_sampled(
    request: Request,
    sampled: list[int],
    logprobs: list[TokenLogprobs] | None,
    max_model_len: int,
) -> tuple[list[int], list[TokenLogprobs] | None]:
    """Append a step's sampled tokens to ``request`` up to the first that stops it; returns
    the tokens (and logprobs) actually appended."""
    new_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = [] if logprobs is not None else None
    for k, token in enumerate(sampled):
        request.append_output_token_ids([token])
        new_ids.append(token)
        if new_logprobs is not None and logprobs is not None and k < len(logprobs):
            new_logprobs.append(logprobs[k])
            request.output_logprobs.append(logprobs[k])
        # Tokens after a stop are dropped: the request ends at the stopping token.
        if check_stop(request, max_model_len):
            break
    if request.first_token_time is None:
        request.first_token_time = time.time()
    return new_ids, new_logprobs


def make_engine_output(
    request: Request,
    new_ids: list[int],
    new_logprobs: list[TokenLogprobs] | None,
    kv_transfer_params: dict[str, Any] | None,
) -> EngineCoreOutput:
    stats = request.prefill_stats or PrefillStats()
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_ids,
        new_logprobs=new_logprobs,
        finish_reason=RequestStatus.finish_reason(request.status),
        stop_reason=request.stop_reason,
        kv_transfer_params=kv_transfer_params,
        num_local_cached_tokens=stats.num_local_cached_tokens,
        num_external_cached_tokens=stats.num_external_cached_tokens,
        error=request.error,
    )


def make_scheduler_output(
    plan: StepPlan, kv: KVCacheManager, finished_req_ids: set[str]
) -> SchedulerOutput:
    """The workers' view of ``plan`` (before num_computed_tokens advances)."""
    new_reqs = [
        NewRequestData(
            req_id=r.request_id,
            token_ids=list(r.all_token_ids),
            num_prompt_tokens=r.num_prompt_tokens,
            sampling_params=r.sampling_params,
            block_ids=kv.get_block_ids(r.request_id),
            num_computed_tokens=r.num_computed_tokens,
        )
        for r in plan.new_reqs
    ]
    cached = CachedRequestData(
        req_ids=[r.request_id for r in plan.cached_reqs],
        new_block_ids=plan.cached_new_block_ids,
        num_computed_tokens=[r.num_computed_tokens for r in plan.cached_reqs],
        num_output_tokens=[r.num_output_tokens for r in plan.cached_reqs],
    )
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=plan.num_scheduled_tokens,
        total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
        finished_req_ids=finished_req_ids,
        preempted_req_ids=plan.preempted_req_ids,
        has_sync_kv_loads=plan.has_sync_kv_loads,
    )


def check_scheduler_integrity(scheduler: Scheduler, kv_state: ConnectorState) -> None:
    """Assert the scheduler's invariants on top of the KV cache manager's: every known request
    is in exactly one queue, or finished and held by the connector; plain waiting requests
    hold no blocks; only known requests hold blocks. Raises AssertionError."""
    s, kv = scheduler, scheduler.kv_cache_manager
    kv.check_integrity()
    queued = [*s.waiting, *s.kv_holding, *s.running]
    ids = {r.request_id for r in queued}
    # Failed while being scheduled: finished, in no queue, released after the step.
    held = kv_state.held_request_ids() | {r.request_id for r, _ in s._failed_admissions}
    assert len(ids) == len(queued), "a request is queued twice"
    assert ids.isdisjoint(held), "a held (finished) request is still queued"
    assert ids | held == set(s.requests), "requests and queues disagree"
    assert all(s.requests[i].is_finished for i in held), "a held request is not finished"
    assert all(r.status == RequestStatus.RUNNING for r in s.running)
    waiting_ok = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    assert all(r.status in waiting_ok for r in s.waiting), "bad status in waiting"
    assert not any(kv.get_num_held_blocks(r.request_id) for r in s.waiting), "waiting holds KV"
    holding_ok = (*waiting_ok, RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert all(r.status in holding_ok for r in s.kv_holding), "bad status in kv_holding"
    parked = {
        r.request_id for r in s.kv_holding if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    }
    assert kv_state.loads_done_ids() <= parked, "a finished load's request is not parked"
    assert set(kv.req_to_blocks) <= set(s.requests), "blocks held by an unknown request"


def check_scheduler_config(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
) -> None:
    """Raise ConfigError for settings the scheduler cannot work with."""
    if cache_config.block_size != kv_cache_config.block_size:
        raise ConfigError(
            f"cache block_size {cache_config.block_size} != KV cache config block_size "
            f"{kv_cache_config.block_size}"
        )
    if (
        not scheduler_config.enable_chunked_prefill
        and scheduler_config.max_num_batched_tokens < max_model_len
    ):
        raise ConfigError(
            f"with chunked prefill off, max_num_batched_tokens "
            f"({scheduler_config.max_num_batched_tokens}) must be >= max_model_len "
            f"({max_model_len}), or long prompts could never be scheduled"
        )


def make_scheduler_stats(scheduler: Scheduler, kv_state: ConnectorState) -> SchedulerStats:
    s = scheduler
    prefix = s.kv_cache_manager.prefix_cache_stats
    loading = sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in s.kv_holding)
    return SchedulerStats(
        num_running_reqs=len(s.running),
        num_waiting_reqs=len(s.waiting) + len(s.kv_holding),
        kv_cache_usage=s.kv_cache_manager.usage,
        prefix_cache_queries=prefix.queries,
        prefix_cache_hits=prefix.hits,
        prefix_cache_hit_rate=prefix.hit_rate,
        num_preemptions=s.num_preemptions,
        num_waiting_for_remote_kvs=loading,
        num_held_by_connector=len(kv_state.held_request_ids()),
        connector_prefix_cache_queries=kv_state.prefix_stats.queries,
        connector_prefix_cache_hits=kv_state.prefix_stats.hits,
    )
