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

This module holds the step (``schedule()``, ``update_from_output()``);
:mod:`kvferry.core.scheduler_base` holds the requests, their queues and finishing. The two
classes are the only writers of request state; the modules they call return decisions.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from itertools import chain
from typing import Any

from kvferry.core import timeline
from kvferry.core.admission import Admission, AdmissionDecision, allocate_for_admission
from kvferry.core.connector_state import RESUMED, ConnectorHookError
from kvferry.core.kv_cache_manager import KVCacheBlocks
from kvferry.core.load_failures import find_load_failures
from kvferry.core.outputs import EngineCoreOutput
from kvferry.core.scheduler_base import SchedulerBase
from kvferry.core.step_plan import StepPlan, num_valid_tokens_of_step
from kvferry.core.stop import check_stop
from kvferry.kv_events.events import KVEventBatch
from kvferry.request import PrefillStats, Request, RequestStatus
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from kvferry.step_types.runner_output import ModelRunnerOutput, TokenLogprobs
from kvferry.step_types.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler(SchedulerBase):
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
            output = plan.to_scheduler_output(self.kv_cache_manager, self.finished_req_ids)
            # KV connector: every step, empty ones too (it also resets the per-step plan).
            output.kv_connector_metadata = self.connector_state.build_meta(output)
        except BaseException:
            # Nothing advanced yet: the planned requests' computed counts are still valid.
            self._unpublish(plan.num_valid_tokens())
            raise
        self.finished_req_ids = set()
        if timeline.enabled():
            self._log_plan(output)
        self._update_after_schedule(output)
        return output

    def _log_plan(self, output: SchedulerOutput) -> None:
        """The timeline line of a planned step (before computed counts advance)."""
        chunks, decodes = [], 0
        for req_id, num in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if request.num_computed_tokens < request.num_prompt_tokens:
                chunks.append(f"{req_id}:{num}@{request.num_computed_tokens}")
            else:
                decodes += 1
        timeline.emit(
            "sched",
            t=time.time(),
            prefill=",".join(chunks) or "-",
            decodes=decodes,
            tokens=output.total_num_scheduled_tokens,
            waiting=len(self.waiting) + len(self.kv_holding),
        )

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
            if self.connector_state.has_pending_block_frees():
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
            if not self.connector_state.take_finished_load(request.request_id):
                return Admission.SKIPPED
            self._promote_loaded(request)
        hit = RESUMED  # resumes with the blocks it holds
        if request.num_computed_tokens == 0:
            # KV connector: local hit, then get_num_new_matched_tokens on its aligned length.
            try:
                found = self.connector_state.lookup(request)
            except ConnectorHookError as e:
                self._fail_admission(request, str(e))
                return Admission.FAILED
            if found is None:
                return Admission.SKIPPED  # the connector asks to be asked again next step
            hit = found
        decision = allocate_for_admission(
            request,
            hit,
            token_budget=plan.token_budget,
            holders=(r for r in chain(self.kv_holding, self.running) if r is not request),
            kv_cache_manager=self.kv_cache_manager,
            connector_state=self.connector_state,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )
        return self._apply_admission(request, decision, plan)

    def _promote_loaded(self, request: Request) -> None:
        """Make a WAITING_FOR_REMOTE_KVS request whose load finished admissible again.

        Its valid loaded prefix enters the prefix cache only now: while the load was in flight
        other requests must not hit blocks whose KV had not arrived. A full hit is rewound by
        one token, whose forward yields the logits to sample from. With nothing valid left
        (a failed load under ``recompute``) its blocks go back and it starts over with a
        fresh lookup.
        """
        if request.num_computed_tokens == 0:
            self.kv_cache_manager.free(request)
            if request.prefill_stats is not None:
                request.prefill_stats.redo_lookup = True
        else:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        preempted = request.num_preemptions > 0
        request.status = RequestStatus.PREEMPTED if preempted else RequestStatus.WAITING

    def _apply_admission(
        self, request: Request, decision: AdmissionDecision, plan: StepPlan
    ) -> Admission:
        outcome, hit = decision.outcome, decision.hit
        if outcome is Admission.FAILED:
            self._fail_admission(request, decision.error or "admission failed")
        if outcome in (Admission.BLOCKED, Admission.FAILED):
            return outcome
        stats = request.prefill_stats
        if stats is None or stats.redo_lookup:
            # The first admission's sources; after a failed load left nothing valid, the
            # fresh lookup's (still the first scheduling's time). Preemption keeps them.
            request.prefill_stats = PrefillStats(
                num_prompt_tokens=request.num_prompt_tokens,
                num_local_cached_tokens=hit.num_local,
                num_external_cached_tokens=hit.num_external,
                external_cache_hit_sources=self.connector_state.take_hit_sources(request),
            )
            if stats is not None:
                request.prefill_stats.scheduled_time = stats.scheduled_time
        request.num_computed_tokens = decision.num_computed_tokens
        if outcome is Admission.LOADING:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return outcome
        plan.has_sync_kv_loads |= hit.num_external > 0
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.schedule_new(request, decision.num_new)
        return outcome

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
        self._unpublish(num_valid_tokens_of_step(scheduler_output))

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
        connector output (``update_connector_output``, finished loads and sends), and last
        the step's KV cache events, published as one batch.
        """
        kv_out = model_runner_output.kv_connector_output
        outputs, self._undelivered = self._undelivered, []
        outputs += self._release_failed_admissions()
        void, failed_loads = self._handle_load_failures(scheduler_output, kv_out)
        outputs += failed_loads
        outputs += self._handle_worker_failures(model_runner_output.failed, void)
        outputs += self._process_sampled(scheduler_output, model_runner_output, void)
        # KV connector: completions; blocks of finished requests may be released now.
        for req_id in self.connector_state.process_transfers(kv_out, self.requests):
            self._free_blocks(self.requests[req_id])
        self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        """The prefix cache's and the connector's events since the last batch, as one."""
        events: list[Any] = self.kv_cache_manager.take_events()
        # KV connector: take_events every step (consumed: it may be a generator), published
        # or not, so the connector's queue cannot grow.
        if self.connector is not None:
            events.extend(self.connector.take_events())
        if events and self.kv_event_publisher is not None:
            # kvferry's engine is data-parallel rank 0 of its own.
            batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
            self.kv_event_publisher.publish(batch)

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        ok = super().reset_prefix_cache(reset_connector)
        # Between steps: subscribers learn of the reset now, not with the next request.
        self._publish_kv_events()
        return ok

    def _handle_load_failures(
        self, so: SchedulerOutput, kv_out: KVConnectorOutput | None
    ) -> tuple[set[str], list[EngineCoreOutput]]:
        """Apply ``kv_load_failure_policy`` to requests whose loaded KV is bad: rewind each to
        its valid prefix (0 if the whole load failed), its bad blocks out of the prefix cache;
        under ``fail`` also end it. Returns their ids (tokens sampled for them this step are
        void) and the outputs of the requests failed here."""
        if kv_out is None or not (kv_out.failed_recving or kv_out.invalid_block_ids):
            return set(), []
        loading = (r for r in self.kv_holding if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        found = find_load_failures(
            kv_out,
            self.kv_cache_manager,
            self.requests,
            [*loading, *self.running],
            so.num_scheduled_tokens,
        )
        if found.bad_block_ids:
            self.kv_cache_manager.evict_blocks(found.bad_block_ids)
        to_fail: list[Request] = []
        for req_id, failure in found.by_request.items():
            request = self.requests[req_id]
            if failure.bad_block_index is not None:
                self.kv_cache_manager.uncache_blocks(request, failure.num_valid_tokens)
            request.num_computed_tokens = failure.num_valid_tokens
            # Metrics: the tokens past the valid prefix are computed here, not loaded.
            if request.prefill_stats is not None:
                request.prefill_stats.keep_valid_prefix(failure.num_valid_tokens)
            logger.warning("KV load failed for %s: %s", request, failure.reason)
            if not self.recompute_failed_loads:
                policy = "kv_load_failure_policy='fail'"
                request.error = f"KV cache load failed: {failure.reason} ({policy})"
                to_fail.append(request)
            elif not self.kv_cache_manager.can_recompute_from(request, failure.num_valid_tokens):
                request.error = (
                    f"KV cache load failed: {failure.reason}; it cannot be recomputed: its "
                    f"sliding-window blocks before the bad block were already released"
                )
                to_fail.append(request)
        return set(found.by_request), [
            self._finish(r, RequestStatus.FINISHED_ERROR) for r in to_fail
        ]

    def _handle_worker_failures(
        self, failed: dict[str, str], void: set[str]
    ) -> list[EngineCoreOutput]:
        """Finish the requests the workers could not continue this step. One being recomputed
        after a bad KV load (in ``void``) gets another try: what it sampled was void anyway."""
        outputs: list[EngineCoreOutput] = []
        for req_id, message in failed.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or req_id in void:
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
            new_ids, new_logprobs = self._append_sampled(request, sampled, logprobs)
            kv_transfer_params = None
            if request.is_finished():
                stopped.add(req_id)
                kv_transfer_params = self._free_request(request)
            outputs.append(
                EngineCoreOutput.from_request(request, new_ids, new_logprobs, kv_transfer_params)
            )
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
        return outputs

    def _append_sampled(
        self, request: Request, sampled: list[int], logprobs: list[TokenLogprobs] | None
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
            stop = check_stop(request, self.max_model_len)
            if stop is not None:
                request.status = stop.status
                if stop.stop_reason is not None:
                    request.stop_reason = stop.stop_reason
                break
        if request.first_token_time is None:
            request.first_token_time = time.time()
        return new_ids, new_logprobs
