"""The plan one ``Scheduler.schedule()`` call builds, and what the workers get to see of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvferry.request import Request
from kvferry.step_types.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)


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

    def to_scheduler_output(
        self, kv_cache_manager: KVCacheManager, finished_req_ids: set[str]
    ) -> SchedulerOutput:
        """The workers' view of the plan (built before num_computed_tokens advances)."""
        return SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData.from_request(r, kv_cache_manager.get_block_ids(r.request_id))
                for r in self.new_reqs
            ],
            scheduled_cached_reqs=CachedRequestData.from_requests(
                self.cached_reqs, self.cached_new_block_ids
            ),
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            has_sync_kv_loads=self.has_sync_kv_loads,
        )

    def num_valid_tokens(self) -> dict[str, int]:
        """Per planned request, the tokens whose KV was valid before the step: with sync loads
        in the step, new requests keep none (their loads may not have happened)."""
        sync = self.has_sync_kv_loads
        valid = {r.request_id: 0 if sync else r.num_computed_tokens for r in self.new_reqs}
        valid.update((r.request_id, r.num_computed_tokens) for r in self.cached_reqs)
        return valid


def num_valid_tokens_of_step(so: SchedulerOutput) -> dict[str, int]:
    """:meth:`StepPlan.num_valid_tokens` for a step already handed to the workers."""
    valid = {
        new.req_id: 0 if so.has_sync_kv_loads else new.num_computed_tokens
        for new in so.scheduled_new_reqs
    }
    cached = so.scheduled_cached_reqs
    valid.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return valid
