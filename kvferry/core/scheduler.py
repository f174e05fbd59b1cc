"""The token-budget scheduler (vLLM V1 style: no prefill or decode phases).

Every request has ``num_computed_tokens`` (tokens whose KV sits in the pool) and ``num_tokens``
(prompt plus outputs so far). Each step the scheduler hands out at most
``max_num_batched_tokens`` tokens so that requests catch up: a decode is a request one token
behind, a prefill is many tokens behind and may be split into chunks over several steps.

One step is ``schedule()`` -> workers run the forward -> ``update_from_output()``.
``schedule()`` advances ``num_computed_tokens`` optimistically by what it scheduled;
``update_from_output()`` appends sampled tokens and applies stop conditions.

The KV connector protocol plugs in at the places marked ``# KV connector:``; the bookkeeping
behind them lives in :mod:`kvferry.core.connector_state`. Waiting requests sit in two queues:
``kv_holding`` (requests that hold blocks without running: async loads in flight or done, not
yet admitted) is always drained before ``waiting``, because its requests can only give their
blocks back by running.

Faults of one request end only that request (FINISHED_ERROR, ``request.error`` says why): a
per-request connector hook that raises (:class:`ConnectorHookError`, or an error from
``request_finished``) and a request the workers could not continue (``ModelRunnerOutput.failed``,
e.g. sampling that found no valid distribution). The step goes on for the others.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from itertools import chain
from typing import Any

from kvferry.config import CacheConfig, SchedulerConfig
from kvferry.core.connector_state import (
    RESUMED,
    ConnectorHookError,
    ConnectorState,
    FinishOutcome,
    PrefixHit,
)
from kvferry.core.kv_cache_config import KVCacheConfig
from kvferry.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvferry.core.outputs import EngineCoreOutput
from kvferry.core.sched_output import SchedulerOutput
from kvferry.core.sched_utils import (
    Admission,
    SchedulerStats,
    StepPlan,
    append_sampled,
    check_scheduler_config,
    check_scheduler_integrity,
    make_engine_output,
    make_scheduler_output,
    make_scheduler_stats,
)
from kvferry.kv_transfer.base import KVConnectorBase, KVConnectorStats
from kvferry.kv_transfer.output import KVConnectorOutput
from kvferry.request import PrefillStats, Request, RequestStatus
from kvferry.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, step by step, which requests compute how many tokens, and owns their KV blocks.

    Order within a step: running requests first (decodes and continuing chunked prefills, in
    admission order), then waiting requests first-come first-served (``kv_holding`` before
    ``waiting``), within the token budget and ``max_num_seqs``. When a running request needs
    a block and none is free, the most recently admitted running request is preempted (its
    blocks freed; it restarts from the prefix cache later). Requests leave the scheduler when
    they finish and the connector holds none of their blocks; their ids reach the workers
    through the next ``SchedulerOutput.finished_req_ids``.

    ``connector`` is the scheduler-role KV connector (built by the engine with
    ``KVConnectorFactory``), or None. ``kv_load_failure_policy`` ("fail" | "recompute") says
    what happens to requests whose external KV failed to load.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        log_stats: bool = False,
        connector: KVConnectorBase | None = None,
        kv_load_failure_policy: str = "fail",
    ) -> None:
        check_scheduler_config(scheduler_config, cache_config, kv_cache_config, max_model_len)
        self.scheduler_config = scheduler_config
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.max_model_len = max_model_len
        self.block_size = kv_cache_config.block_size
        self.log_stats = log_stats
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            log_stats=log_stats,
        )
        # KV connector: the scheduler-role connector and the state kept around it.
        self.connector = connector
        self._kv = ConnectorState(connector, self.kv_cache_manager, kv_load_failure_policy)
        # Every request the scheduler knows: queued, running, or finished while a connector
        # still holds its blocks (in no queue then).
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.kv_holding: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished since the last schedule(); flushed to the workers by the next one.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Requests that failed during schedule() (a connector hook raised after allocation):
        # finished, in no queue, their blocks kept until the step is over (the hook may have
        # recorded them for this step's transfers); released by update_from_output.
        self._failed_admissions: list[tuple[Request, FinishOutcome]] = []
        # Outputs of failed admissions whose step raised before update_from_output.
        self._undelivered: list[EngineCoreOutput] = []

    # -- intake and queries ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a fresh request (status WAITING, nothing computed)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, more than "
                f"max_model_len {self.max_model_len}"
            )
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not a fresh request")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def get_num_unfinished_requests(self) -> int:
        """Requests that will still produce output: waiting, loading or running."""
        return len(self.waiting) + len(self.kv_holding) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        """True while stepping still has work to do: requests that will produce output, and
        also KV transfers only later steps complete (finished requests whose blocks the
        connector holds: delayed frees, orphaned loads; or ``connector.has_pending_work()``).
        Such steps may schedule zero tokens; they still carry connector metadata and bring
        back the connector output that releases the blocks."""
        return self.get_num_unfinished_requests() > 0 or self._kv.has_pending_work()

    def has_finished_requests(self) -> bool:
        """True while finished ids still have to be flushed to the workers by a step, or
        requests that failed while being scheduled still have to be reported."""
        return bool(self.finished_req_ids or self._failed_admissions or self._undelivered)

    def has_requests(self) -> bool:
        """The engine loop's "keep stepping" test: unfinished work or ids to flush."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    # -- schedule -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Never schedules a request with zero tokens (the step itself may have
        none, e.g. while loads are in flight)."""
        # A previous step that raised never reached update_from_output.
        self._undelivered += self._release_failed_admissions()
        plan = StepPlan(token_budget=self.max_num_scheduled_tokens)
        try:
            self._schedule_running(plan)
            # Out of blocks, admitting newcomers would only preempt again.
            if not plan.out_of_blocks:
                self._schedule_waiting(plan)
            output = make_scheduler_output(plan, self.kv_cache_manager, self.finished_req_ids)
            # KV connector: every step, empty ones too (it also resets the per-step plan).
            output.kv_connector_metadata = self._kv.build_meta(output)
        except BaseException:
            # Nothing advanced yet: the planned requests' computed counts are still valid.
            sync = plan.has_sync_kv_loads
            valid = {r.request_id: 0 if sync else r.num_computed_tokens for r in plan.new_reqs}
            valid.update((r.request_id, r.num_computed_tokens) for r in plan.cached_reqs)
            self._unpublish(valid)
            raise
        self.finished_req_ids = set()
        self._update_after_schedule(output)
        return output

    def _schedule_running(self, plan: StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.token_budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.token_budget)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, plan)
            if new_blocks is None:
                break
            plan.schedule_cached(request, num_new, new_blocks)
            i += 1

    def _allocate_or_preempt(
        self, request: Request, num_new: int, plan: StepPlan
    ) -> KVCacheBlocks | None:
        """Allocate for ``request``, preempting from the tail of ``running`` until it fits.

        Victims come from behind ``request``, so none of them was scheduled this step.
        Returns None if ``request`` is not scheduled: it preempted itself, or the connector
        will free blocks soon and waiting a step beats throwing computed KV away.
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            plan.out_of_blocks = True
            # KV connector: pending frees (finished_sending soon) -> wait instead of preempting.
            if self._kv.has_pending_block_frees():
                return None
            victim = self.running.pop()
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Recompute preemption: drop the request's KV and queue it at the front to redo.
        It goes through the local and the connector's lookup again when re-admitted."""
        assert request.status == RequestStatus.RUNNING
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted_req_ids.add(request.request_id)
        logger.debug(
            "preempted %s (%d blocks free)", request, self.kv_cache_manager.get_num_free_blocks()
        )

    def _schedule_waiting(self, plan: StepPlan) -> None:
        # KV connector: requests holding blocks first, or finished loads could starve behind
        # a request that waits for exactly those blocks.
        if self._admit_from(self.kv_holding, plan):
            self._admit_from(self.waiting, plan)

    def _admit_from(self, queue: deque[Request], plan: StepPlan) -> bool:
        """Admit from ``queue`` in order while budget and seats last; False once a request is
        BLOCKED (nothing behind it, in any queue, may overtake it). Skipped requests keep
        their place (and stay visible to the async-load reservation)."""
        for request in list(queue):
            if plan.token_budget <= 0 or len(self.running) >= self.max_num_running_reqs:
                break
            outcome = self._try_admit(request, plan)
            if outcome is Admission.BLOCKED:
                return False
            # FAILED leaves the queue too: the request is finished.
            if outcome is not Admission.SKIPPED:
                queue.remove(request)
            if outcome is Admission.LOADING:
                self.kv_holding.append(request)
        return True

    def _try_admit(self, request: Request, plan: StepPlan) -> Admission:
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # KV connector: parked until finished_recving names it; then promoted here.
            if not self._kv.is_load_finished(request.request_id):
                return Admission.SKIPPED
            self._kv.promote_loaded(request)
        if request.num_computed_tokens > 0:
            return self._admit(request, RESUMED, plan)  # resumes with the blocks it holds
        # KV connector: local hit, then get_num_new_matched_tokens on its aligned length.
        try:
            hit = self._kv.lookup(request)
        except ConnectorHookError as e:
            self._fail_admission(request, str(e))
            return Admission.FAILED
        if hit is None:
            return Admission.SKIPPED  # the connector asks to be asked again next step
        return self._admit(request, hit, plan)

    def _admit(self, request: Request, hit: PrefixHit, plan: StepPlan) -> Admission:
        num_computed = request.num_computed_tokens + hit.num_local + hit.num_external
        if hit.load_async:
            # Nothing computed until the load is in; keep blocks free for requests already
            # holding KV so that loads can never fill the pool with requests that cannot run.
            holders = (r for r in chain(self.kv_holding, self.running) if r is not request)
            num_reserved = self._kv.num_reserved_blocks(holders)
            start, num_new = num_computed, 0
        else:
            # A full hit still recomputes the last token: its forward gives the logits.
            start = min(num_computed, request.num_tokens - 1)
            num_new = request.num_tokens - start
            if not self.enable_chunked_prefill and num_new > plan.token_budget:
                return Admission.BLOCKED
            num_new, num_reserved = min(num_new, plan.token_budget), 0
        new_blocks = self.kv_cache_manager.allocate_slots(
            request,
            start + num_new - num_computed,
            num_new_computed_tokens=hit.num_local,
            new_computed_blocks=hit.local_blocks,
            num_external_computed_tokens=hit.num_external,
            delay_cache_blocks=hit.load_async,
            num_reserved_blocks=num_reserved,
        )
        if new_blocks is None:
            return Admission.BLOCKED
        # KV connector: update_state_after_alloc for every admitted request (external 0 too).
        try:
            self._kv.after_alloc(request, hit)
        except ConnectorHookError as e:
            # Blocks just published to the prefix cache would never be computed: unpublish
            # all but the hit and what the request computed before.
            self.kv_cache_manager.uncache_blocks(
                request, request.num_computed_tokens + hit.num_local
            )
            self._fail_admission(request, str(e))
            return Admission.FAILED
        if request.prefill_stats is None:
            request.prefill_stats = PrefillStats(
                num_prompt_tokens=request.num_prompt_tokens,
                num_local_cached_tokens=hit.num_local,
                num_external_cached_tokens=hit.num_external,
            )
        if hit.load_async:
            # Optimistic: corrected if the load fails; unused until the load is in.
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = num_computed
            return Admission.LOADING
        plan.has_sync_kv_loads |= hit.num_external > 0
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = start
        self.running.append(request)
        plan.schedule_new(request, num_new)
        return Admission.SCHEDULED

    def _fail_admission(self, request: Request, message: str) -> None:
        """End a waiting request whose admission failed in a connector hook; the caller takes
        it out of its queue. Its blocks (if any) are released after the step."""
        logger.warning("request %s failed: %s", request.request_id, message)
        request.status = RequestStatus.FINISHED_ERROR
        request.error = message
        outcome = self._kv.request_finished(request)
        self.finished_req_ids.add(request.request_id)
        self._failed_admissions.append((request, outcome))

    def _release_failed_admissions(self) -> list[EngineCoreOutput]:
        failed, self._failed_admissions = self._failed_admissions, []
        outputs: list[EngineCoreOutput] = []
        for request, outcome in failed:
            if not outcome.held:
                self._free_blocks(request)
            outputs.append(make_engine_output(request, [], None, outcome.kv_transfer_params))
        return outputs

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        # Advance now rather than after the forward, so the next schedule() (and a later
        # pipelined one) already sees these tokens as taken.
        for req_id, num in output.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num

    def discard_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step of ``scheduler_output`` raised before its results were applied, so the KV
        of its tokens may never have been written (or loaded). Unpublish the blocks that hold
        them, which allocation published ahead of the forward, so that no later request
        reuses them; the requests keep their blocks. With sync loads in the step, new
        requests keep none of their published blocks (their loads may not have happened)."""
        so = scheduler_output
        valid = {
            new.req_id: 0 if so.has_sync_kv_loads else new.num_computed_tokens
            for new in so.scheduled_new_reqs
        }
        cached = so.scheduled_cached_reqs
        valid.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        self._unpublish(valid)

    def _unpublish(self, num_valid_tokens: dict[str, int]) -> None:
        for req_id, num_valid in num_valid_tokens.items():
            request = self.requests.get(req_id)
            if request is not None:
                self.kv_cache_manager.uncache_blocks(request, num_valid)

    # -- update from the workers ----------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results; return one output per request that got tokens or
        finished. Finished requests are freed and leave the scheduler, unless the connector
        holds their blocks (then they leave when the transfer is reported done).

        Order: requests that failed while being scheduled, KV load failures (so no token
        sampled on bad KV is emitted), requests the workers failed, sampled tokens, then the
        connector output (``update_connector_output``, finished loads and sends).
        """
        kv_out = model_runner_output.kv_connector_output
        outputs, self._undelivered = self._undelivered, []
        outputs += self._release_failed_admissions()
        void, failed_loads = self._handle_load_failures(scheduler_output, kv_out)
        outputs += failed_loads
        outputs += self._handle_worker_failures(model_runner_output.failed, void)
        outputs += self._process_sampled(scheduler_output, model_runner_output, void)
        # KV connector: completions; blocks of finished requests may be released now.
        for req_id in self._kv.process_transfers(kv_out, self.requests):
            self._free_blocks(self.requests[req_id])
        return outputs

    def _handle_load_failures(
        self, so: SchedulerOutput, kv_out: KVConnectorOutput | None
    ) -> tuple[set[str], list[EngineCoreOutput]]:
        """Apply ``kv_load_failure_policy`` to requests whose loaded KV is bad. Returns their
        ids (tokens sampled for them this step are void) and outputs of requests failed here."""
        if kv_out is None or not (kv_out.failed_recving or kv_out.invalid_block_ids):
            return set(), []
        loading = (r for r in self.kv_holding if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        void, to_fail = self._kv.apply_load_failures(
            kv_out, self.requests, [*loading, *self.running], so.num_scheduled_tokens
        )
        return void, [self._finish(r, RequestStatus.FINISHED_ERROR) for r in to_fail]

    def _handle_worker_failures(
        self, failed: dict[str, str], void: set[str]
    ) -> list[EngineCoreOutput]:
        """Finish the requests the workers could not continue this step. One being recomputed
        after a bad KV load (in ``void``) gets another try: what it sampled was void anyway."""
        outputs: list[EngineCoreOutput] = []
        for req_id, message in failed.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished or req_id in void:
                continue
            logger.warning("request %s failed: %s", req_id, message)
            request.error = message
            outputs.append(self._finish(request, RequestStatus.FINISHED_ERROR))
        return outputs

    def _process_sampled(
        self, so: SchedulerOutput, out: ModelRunnerOutput, void: set[str]
    ) -> list[EngineCoreOutput]:
        index = {req_id: i for i, req_id in enumerate(out.req_ids)}
        outputs: list[EngineCoreOutput] = []
        stopped: set[str] = set()
        for req_id in so.num_scheduled_tokens:
            request = self.requests.get(req_id)
            i = index.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING or i is None:
                continue  # finished while the step ran, or not in this runner output
            sampled = out.sampled_token_ids[i]
            # A partial prefill chunk samples nothing; ignore anything a worker sent anyway.
            if req_id in void or not sampled or request.num_computed_tokens < request.num_tokens:
                continue
            logprobs = out.logprobs[i] if i < len(out.logprobs) else None
            new_ids, new_logprobs = append_sampled(request, sampled, logprobs, self.max_model_len)
            kv_transfer_params = None
            if request.is_finished:
                stopped.add(req_id)
                kv_transfer_params = self._free_request(request)
            outputs.append(make_engine_output(request, new_ids, new_logprobs, kv_transfer_params))
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
        return outputs

    # -- finishing ------------------------------------------------------------------------

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        finished_status: RequestStatus,
        error: str | None = None,
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside the step loop: aborts, stop strings found by the
        engine's detokenizer, or (FINISHED_ERROR, with ``error`` saying why) a request whose
        output the engine could not process. Unknown or already finished ids are ignored.

        Returns one final output (no new tokens) per request finished here. It carries the
        ``kv_transfer_params`` the connector returned from ``request_finished``: the engine
        must forward them with that request's final result (for a stop string, merge them
        into the output it already built), as no later step reports this request again.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        ids = (request_ids,) if isinstance(request_ids, str) else tuple(request_ids)
        outputs: list[EngineCoreOutput] = []
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished:
                if error is not None:
                    request.error = error
                outputs.append(self._finish(request, finished_status))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> EngineCoreOutput:
        """End an unfinished request outside the token path; return its final output."""
        # KV connector: a load in flight keeps the blocks until finished_recving reports it,
        # since the transfer may still write into them.
        load_in_flight = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not (
            self._kv.is_load_finished(request.request_id)
        )
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.kv_holding:
            self.kv_holding.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        params = self._free_request(request, load_in_flight)
        return make_engine_output(request, [], None, params)

    def _free_request(
        self, request: Request, load_in_flight: bool = False
    ) -> dict[str, Any] | None:
        """Retire a finished request; returns the connector's kv_transfer_params. A failing
        ``request_finished`` turns the request's end into an error (an abort stays one)."""
        assert request.is_finished
        # KV connector: request_finished before freeing; held blocks (a delayed free or a
        # load in flight) stay, with the request, until the transfer is reported done.
        outcome = self._kv.request_finished(request, load_in_flight)
        if outcome.error is not None and request.status != RequestStatus.FINISHED_ABORTED:
            request.status = RequestStatus.FINISHED_ERROR
            request.error = request.error or outcome.error
        self.finished_req_ids.add(request.request_id)
        if not outcome.held:
            self._free_blocks(request)
        return outcome.kv_transfer_params

    def _free_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    # -- maintenance ----------------------------------------------------------------------

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """Forget all cached prefixes (and, if asked, the connector's cache); False while any
        request holds blocks or the connector's reset failed."""
        ok = self.kv_cache_manager.reset_prefix_cache()
        return (self._kv.reset_cache() if reset_connector else True) and ok

    def take_kv_connector_stats(self) -> KVConnectorStats | None:
        """Connector stats (workers' aggregated with the scheduler side's) since last call."""
        return self._kv.take_stats()

    def take_kv_cache_events(self) -> list[Any]:
        """KV cache events from the workers and ``connector.take_events()`` since last call."""
        return self._kv.take_events()

    def make_stats(self) -> SchedulerStats | None:
        """Current stats, or None unless the scheduler was built with ``log_stats=True``."""
        if not self.log_stats:
            return None
        return make_scheduler_stats(self, self._kv)

    def check_integrity(self) -> None:
        """Assert pool, table and queue invariants (see :func:`check_scheduler_integrity`)."""
        check_scheduler_integrity(self, self._kv)

    def shutdown(self) -> None:
        self._kv.shutdown()
