"""The scheduler's book of requests: intake, queues, queries, finishing and upkeep.

:class:`SchedulerBase` holds every request the scheduler knows and the queues they sit in;
:class:`~kvferry.core.scheduler.Scheduler` adds the step itself (``schedule()`` and
``update_from_output()``). Together they are one scheduler and the only writer of request
state (status, computed tokens, errors): the helpers they call (connector state, admission,
load failures, stop checks) return decisions, and these two classes apply them.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

from kvferry.config import (
    CacheConfig,
    KVEventsConfig,
    SchedulerConfig,
    check_kv_load_failure_policy,
    check_scheduler_limits,
)
from kvferry.core.connector_state import ConnectorState, FinishOutcome
from kvferry.core.integrity import check_scheduler_integrity
from kvferry.core.kv_cache_manager import KVCacheManager
from kvferry.core.kv_event_publishing import KVEventPublisher, create_publisher
from kvferry.core.outputs import EngineCoreOutput
from kvferry.core.stats import SchedulerStats
from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_transfer.base import KVConnectorBase, KVConnectorStats
from kvferry.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class SchedulerBase:
    """Requests, queues and finishing; see :class:`~kvferry.core.scheduler.Scheduler`.

    ``kv_events_config`` turns KV cache events on (``.publishes``): the scheduler then owns a
    publisher (``kv_event_publisher``, made by ``EventPublisherFactory`` unless one is given)
    and shuts it down with itself.
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
        kv_events_config: KVEventsConfig | None = None,
        kv_event_publisher: KVEventPublisher | None = None,
    ) -> None:
        check_scheduler_limits(
            scheduler_config, cache_config, kv_cache_config.block_size, max_model_len
        )
        check_kv_load_failure_policy(kv_load_failure_policy)
        self.scheduler_config = scheduler_config
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.max_model_len = max_model_len
        self.block_size = kv_cache_config.block_size
        self.log_stats = log_stats
        publishes = kv_events_config is not None and kv_events_config.publishes
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            log_stats=log_stats,
            enable_kv_cache_events=publishes,
        )
        self.kv_event_publisher: KVEventPublisher | None = None
        if publishes:
            self.kv_event_publisher = kv_event_publisher or create_publisher(kv_events_config)
        # KV connector: the scheduler-role connector and the state kept around it.
        self.connector = connector
        self.connector_state = ConnectorState(connector, self.kv_cache_manager)
        # Read once, as vLLM does; one step at a time leaves no stale output to drop when a
        # request is preempted, so nothing else depends on it here.
        self.requires_kv_delivery = bool(connector is not None and connector.requires_kv_delivery)
        self.recompute_failed_loads = kv_load_failure_policy == "recompute"
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
        # KV connector: on_new_request before it is queued (an exception refuses it).
        self.connector_state.on_new_request(request)
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
        return self.get_num_unfinished_requests() > 0 or self.connector_state.has_pending_work()

    def has_finished_requests(self) -> bool:
        """True while finished ids still have to be flushed to the workers by a step, or
        requests that failed while being scheduled still have to be reported."""
        return bool(self.finished_req_ids or self._failed_admissions or self._undelivered)

    def has_requests(self) -> bool:
        """The engine loop's "keep stepping" test: unfinished work or ids to flush."""
        return self.has_unfinished_requests() or self.has_finished_requests()

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
            if request is not None and not request.is_finished():
                if error is not None:
                    request.error = error
                outputs.append(self._finish(request, finished_status))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> EngineCoreOutput:
        """End an unfinished request outside the token path; return its final output."""
        # KV connector: a load in flight keeps the blocks until finished_recving reports it,
        # since the transfer may still write into them.
        load_in_flight = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not (
            self.connector_state.is_load_finished(request.request_id)
        )
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.kv_holding:
            self.kv_holding.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        params = self._free_request(request, load_in_flight)
        return EngineCoreOutput.from_request(request, [], None, params)

    def _free_request(
        self, request: Request, load_in_flight: bool = False
    ) -> dict[str, Any] | None:
        """Retire a finished request; returns the connector's kv_transfer_params. A failing
        ``request_finished`` turns the request's end into an error (an abort stays one)."""
        assert request.is_finished()
        # KV connector: request_finished before freeing; held blocks (a delayed free or a
        # load in flight) stay, with the request, until the transfer is reported done.
        outcome = self.connector_state.request_finished(request, load_in_flight)
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

    def _fail_admission(self, request: Request, message: str) -> None:
        """End a waiting request whose admission failed in a connector hook; the caller takes
        it out of its queue. Its blocks (if any) are released after the step."""
        logger.warning("request %s failed: %s", request.request_id, message)
        request.status = RequestStatus.FINISHED_ERROR
        request.error = message
        outcome = self.connector_state.request_finished(request)
        self.finished_req_ids.add(request.request_id)
        self._failed_admissions.append((request, outcome))

    def _release_failed_admissions(self) -> list[EngineCoreOutput]:
        failed, self._failed_admissions = self._failed_admissions, []
        outputs: list[EngineCoreOutput] = []
        for request, outcome in failed:
            if not outcome.held:
                self._free_blocks(request)
            outputs.append(
                EngineCoreOutput.from_request(request, [], None, outcome.kv_transfer_params)
            )
        return outputs

    # -- maintenance ----------------------------------------------------------------------

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """Forget all cached prefixes (and, if asked, the connector's cache); False while any
        request holds blocks or the connector's reset failed."""
        ok = self.kv_cache_manager.reset_prefix_cache()
        return (self.connector_state.reset_cache() if reset_connector else True) and ok

    def take_kv_connector_stats(self) -> KVConnectorStats | None:
        """Connector stats (workers' aggregated with the scheduler side's) since last call."""
        return self.connector_state.take_stats()

    def make_stats(self) -> SchedulerStats | None:
        """Current stats, or None unless the scheduler was built with ``log_stats=True``."""
        if not self.log_stats:
            return None
        prefix = self.kv_cache_manager.prefix_cache_stats
        connector_prefix = self.connector_state.prefix_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.kv_holding),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            prefix_cache_hit_rate=prefix.hit_rate,
            num_preemptions=self.num_preemptions,
            num_waiting_for_remote_kvs=sum(
                r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.kv_holding
            ),
            num_held_by_connector=len(self.connector_state.held_request_ids()),
            connector_prefix_cache_queries=connector_prefix.queries,
            connector_prefix_cache_hits=connector_prefix.hits,
            connector_prefix_cache_hits_by_source=dict(connector_prefix.hits_by_source),
        )

    def check_integrity(self) -> None:
        """Assert pool, table and queue invariants (see :func:`check_scheduler_integrity`)."""
        # Failed while being scheduled: finished, in no queue, released after the step.
        failed = {r.request_id for r, _ in self._failed_admissions}
        check_scheduler_integrity(
            self.requests,
            self.waiting,
            self.kv_holding,
            self.running,
            self.connector_state.held_request_ids() | failed,
            self.connector_state.loads_done_ids(),
            self.kv_cache_manager,
        )

    def close_kv_event_publisher(self) -> None:
        """Stop the KV event publisher (the first call only); later events are dropped."""
        publisher, self.kv_event_publisher = self.kv_event_publisher, None
        if publisher is not None:
            publisher.shutdown()

    def shutdown(self) -> None:
        self.close_kv_event_publisher()
        self.connector_state.shutdown()
