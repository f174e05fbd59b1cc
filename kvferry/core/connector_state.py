"""The scheduler's side of the KV-connector protocol, apart from queue handling.

:class:`ConnectorState` wraps the scheduler-role connector (or None: then every hook is a no-op
and lookups are local only), so the scheduler calls the same methods either way. Between steps
it remembers what the protocol leaves open:

* loads reported finished (``finished_recving``) whose request is not promoted yet;
* finished requests whose blocks the connector still holds, and why: a *delayed free*
  (``request_finished`` returned True; released by ``finished_sending``) or an *orphaned load*
  (the request finished while its async load was in flight; the transfer may still write into
  its blocks, so they are released by ``finished_recving``). Such a request stays in
  ``Scheduler.requests`` but in no queue;
* connector stats and KV cache events until the engine takes them.

It never writes a request: it answers with decisions (a :class:`PrefixHit`, a
:class:`FinishOutcome`, which finished requests to release, whether a load is done) and the
scheduler applies them. A per-request hook that raises (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``request_finished``) or answers out of contract is that
request's fault, not the step's: :class:`ConnectorHookError` (or :attr:`FinishOutcome.error`)
tells the scheduler to end only that request with an error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvferry.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvferry.core.stats import ConnectorPrefixStats
from kvferry.kv_transfer.base import (
    CacheHitSource,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorStats,
    SupportsHMA,
)
from kvferry.request import Request, RequestStatus
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from kvferry.step_types.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixHit:
    """Where an admitted waiting request's leading tokens come from.

    ``local_blocks`` (``num_local`` tokens) are adopted from this pool's prefix cache; the next
    ``num_external`` tokens are loaded by the connector into newly allocated blocks, during this
    step's forward (sync) or between steps (``load_async``). ``looked_up`` is False for a request
    that resumes with blocks it already holds (after its async load); it gets no new hit.
    """

    local_blocks: KVCacheBlocks | None = None
    num_local: int = 0
    num_external: int = 0
    load_async: bool = False
    looked_up: bool = True


RESUMED = PrefixHit(looked_up=False)


class ConnectorHookError(Exception):
    """A scheduler-side connector hook failed for one request; the message says which and why.
    The scheduler ends that request with FINISHED_ERROR and goes on with the others."""


def _hook_error(connector: KVConnectorBase, hook: str, request: Request, e: Exception) -> str:
    logger.exception("%s.%s failed for %s", type(connector).__name__, hook, request)
    return f"the KV connector's {hook} failed for this request: {type(e).__name__}: {e}"


@dataclass(frozen=True)
class FinishOutcome:
    """What :meth:`ConnectorState.request_finished` decided. ``held``: the blocks stay until the
    connector reports the transfer done. ``error``: the connector's ``request_finished`` raised
    (then nothing is held for it beyond a load in flight, and there are no params)."""

    held: bool
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None


def apply_partial_tail_rule(
    num_local: int, block_size: int, num_external: int, load_async: bool
) -> tuple[int, int, bool]:
    """Combine a local hit that may end inside a block with an external hit counted from the
    hit's block boundary (the connector is only ever asked about whole blocks).

    Returns ``(num_local, num_external, load_async)`` to use: if the external hit reaches past
    the partial tail, the tail block is dropped from the local hit and the load covers it;
    otherwise the external hit adds nothing and is ignored. (kvferry's own prefix cache only
    reports whole blocks, so the tail is empty there; the rule keeps the connector contract
    exact for any lookup that does not.)
    """
    tail = num_local % block_size
    if tail == 0:
        return num_local, num_external, load_async
    if num_external > tail:
        return num_local - tail, num_external, load_async
    return num_local, 0, False


class ConnectorState:
    """The scheduler-role connector plus the bookkeeping around it (see the module doc).

    Contract with the scheduler: :meth:`lookup` only for requests holding no blocks;
    :meth:`after_alloc` after every successful allocation of a waiting request;
    :meth:`build_meta` once per ``schedule()``; :meth:`request_finished` exactly once per
    request, before its blocks are freed (free them only if it returns ``held=False``);
    :meth:`process_transfers` once per ``update_from_output``, after the step's tokens.
    """

    def __init__(self, connector: KVConnectorBase | None, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.prefix_stats = ConnectorPrefixStats()
        self._loads_done: set[str] = set()
        self._awaiting_send: set[str] = set()
        self._awaiting_recv: set[str] = set()
        self._stats: KVConnectorStats | None = None
        # External hit tokens by tier of the request being admitted, until the scheduler takes
        # them into its PrefillStats (right after the allocation).
        self._hit_sources: dict[str, dict[str, int]] = {}
        self._num_groups = kv_cache_manager.num_groups
        if connector is not None:
            connector.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        """``on_new_request`` as a request arrives; an exception refuses it (ValueError)."""
        if self.connector is None:
            return
        try:
            self.connector.on_new_request(request)
        except Exception as e:
            raise ValueError(_hook_error(self.connector, "on_new_request", request, e)) from e

    # -- admission ------------------------------------------------------------------------

    def lookup(self, request: Request) -> PrefixHit | None:
        """Local prefix hit, then the connector's external hit on top of it; None when the
        connector cannot answer yet (skip the request this step and ask again). Raises
        ConnectorHookError when the connector's lookup raises or offers more tokens than the
        request has."""
        blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
        connector = self.connector
        if connector is None:
            return PrefixHit(blocks, num_local)
        aligned = num_local - num_local % self.block_size
        try:
            num_external, load_async = connector.get_num_new_matched_tokens(request, aligned)
        except Exception as e:
            raise ConnectorHookError(
                _hook_error(connector, "get_num_new_matched_tokens", request, e)
            ) from e
        if num_external is None:
            return None
        if (
            not isinstance(num_external, int)
            or num_external < 0
            or aligned + num_external > request.num_tokens
        ):
            raise ConnectorHookError(
                f"{type(connector).__name__}.get_num_new_matched_tokens offered "
                f"{num_external} tokens for {request.request_id!r} after {aligned} local ones, "
                f"but the request has only {request.num_tokens}"
            )
        if num_external > 0 and not self._restores_every_group(connector, request):
            num_external, load_async = 0, False
        num_kept, num_external, load_async = apply_partial_tail_rule(
            num_local, self.block_size, num_external, load_async and num_external > 0
        )
        if num_kept < num_local:
            # (Whole-block local hits never get here: a cut sliding-window hit could be short
            # of its window's blocks.)
            n = num_kept // self.block_size
            blocks = KVCacheBlocks(tuple(list(g[:n]) for g in blocks.blocks))
        return PrefixHit(blocks, num_kept, num_external, load_async)

    def _restores_every_group(self, connector: KVConnectorBase, request: Request) -> bool:
        """Every KV group holds KV the request reads: a load restoring fewer cannot be used."""
        try:
            groups = set(connector.get_loaded_kv_cache_group_ids(request))
        except Exception as e:
            raise ConnectorHookError(
                _hook_error(connector, "get_loaded_kv_cache_group_ids", request, e)
            ) from e
        if groups.issuperset(range(self._num_groups)):
            return True
        logger.warning(
            "%s loads KV cache groups %s of %d for %s; its external hit is not used",
            type(connector).__name__, sorted(groups), self._num_groups, request.request_id,
        )  # fmt: skip
        return False

    def take_hit_sources(self, request: Request) -> dict[str, int]:
        """The external hit tokens of ``request``'s admission by tier (empty for none)."""
        return self._hit_sources.pop(request.request_id, {})

    def _record_hit_sources(self, connector: KVConnectorBase, request: Request, n: int) -> None:
        try:
            sources = connector.get_external_cache_hit_sources(request, n)
            by_tier = {CacheHitSource(k).value: int(v) for k, v in sources.items() if v}
        except Exception:
            logger.exception("%s.get_external_cache_hit_sources failed", type(connector).__name__)
            by_tier = {}
        if sum(by_tier.values()) != n or any(v < 0 for v in by_tier.values()):
            by_tier = {CacheHitSource.EXTERNAL_UNSPECIFIED.value: n}
        self._hit_sources[request.request_id] = by_tier
        for tier, count in by_tier.items():
            self.prefix_stats.hits_by_source[tier] = (
                self.prefix_stats.hits_by_source.get(tier, 0) + count
            )

    def after_alloc(self, request: Request, hit: PrefixHit) -> None:
        """``update_state_after_alloc`` for a just-allocated waiting request (whole table).
        Raises ConnectorHookError when the hook raises."""
        connector = self.connector
        if connector is None:
            return
        try:
            connector.update_state_after_alloc(
                request, self.kv_cache_manager.get_blocks(request.request_id), hit.num_external
            )
        except Exception as e:
            raise ConnectorHookError(
                _hook_error(connector, "update_state_after_alloc", request, e)
            ) from e
        if not hit.looked_up:
            return
        if request.num_preemptions > 0:
            self.prefix_stats.preempted_requests += 1
        else:
            self.prefix_stats.requests += 1
            self.prefix_stats.queries += request.num_tokens - hit.num_local
            self.prefix_stats.hits += hit.num_external
            if hit.num_external > 0:
                self._record_hit_sources(connector, request, hit.num_external)

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        if self.connector is None:
            return None
        return self.connector.build_connector_meta(scheduler_output)

    def num_reserved_blocks(self, holders: Iterable[Request]) -> int:
        """Blocks an async load must leave free: what ``holders`` (requests that hold KV and
        must run to release it: loading, loaded, running) still need to cover their known
        tokens. Without this, loads could fill the pool with requests none of which can run
        (each waiting for a block another holds), and nothing would ever free a block."""
        return sum(self.kv_cache_manager.get_num_blocks_to_cover(r) for r in holders)

    def is_load_finished(self, req_id: str) -> bool:
        return req_id in self._loads_done

    def take_finished_load(self, req_id: str) -> bool:
        """True (once) when ``req_id``'s async load was reported finished: the scheduler then
        promotes the request, since its blocks now hold the loaded KV."""
        if req_id not in self._loads_done:
            return False
        self._loads_done.discard(req_id)
        return True

    # -- finishing and transfer completions -----------------------------------------------

    def request_finished(self, request: Request, load_in_flight: bool = False) -> FinishOutcome:
        """Tell the connector the request ended.

        ``held``: the blocks must stay allocated (and the request known) until the connector
        reports the transfer done: a delayed free, or ``load_in_flight`` (an async load that
        may still write into them). A hook that raises holds nothing beyond a load in flight:
        waiting for a transfer it may never report would leak the blocks.
        """
        req_id = request.request_id
        self._loads_done.discard(req_id)
        self._hit_sources.pop(req_id, None)
        delay_free, params, error = False, None, None
        connector = self.connector
        if connector is not None:
            block_ids = self.kv_cache_manager.get_block_ids(req_id)
            try:
                # As vLLM: a connector for several groups hears of all of them.
                if isinstance(connector, SupportsHMA):
                    delay_free, params = connector.request_finished_all_groups(request, block_ids)
                else:
                    delay_free, params = connector.request_finished(request, block_ids[0])
            except Exception as e:
                delay_free, params = False, None
                error = _hook_error(connector, "request_finished", request, e)
        if delay_free:
            self._awaiting_send.add(req_id)
        if load_in_flight:
            self._awaiting_recv.add(req_id)
        return FinishOutcome(delay_free or load_in_flight, params, error)

    def process_transfers(
        self, kv_out: KVConnectorOutput | None, requests: Mapping[str, Request]
    ) -> list[str]:
        """Hand the step's connector output (None: the workers sent none) to the connector,
        then collect stats, then apply the completions. (The workers' KV cache events reach the
        connector with the output; the scheduler drains ``take_events()`` after this.)

        A finished load of a waiting request is remembered (promoted at the next schedule);
        one of a finished request releases its orphaned blocks. Returns the finished requests
        whose blocks are released now: the caller frees them and forgets the requests.
        """
        if kv_out is not None and self.connector is not None:
            self.connector.update_connector_output(kv_out)
        # After the update: what it counted (e.g. stores the output reports done) belongs to
        # this step's stats, as the engine may take no further step.
        self._collect_stats(kv_out)
        if kv_out is None:
            return []
        release: list[str] = []
        for req_id in sorted(kv_out.finished_recving or ()):
            request = requests.get(req_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._loads_done.add(req_id)
            elif req_id in self._awaiting_recv:
                self._awaiting_recv.discard(req_id)
                if req_id not in self._awaiting_send:
                    release.append(req_id)
            else:
                logger.debug("finished_recving for %r, which awaits no load; ignored", req_id)
        for req_id in sorted(kv_out.finished_sending or ()):
            if req_id not in self._awaiting_send:
                logger.warning("finished_sending for %r, which has no delayed free", req_id)
                continue
            self._awaiting_send.discard(req_id)
            if req_id not in self._awaiting_recv:
                release.append(req_id)
        return release

    def _collect_stats(self, kv_out: KVConnectorOutput | None) -> None:
        for stats in (
            kv_out.kv_connector_stats if kv_out is not None else None,
            self.connector.get_kv_connector_stats() if self.connector is not None else None,
        ):
            if stats is None:
                continue
            if isinstance(stats, dict):
                stats = self._rebuild_stats(stats)
            self._stats = stats if self._stats is None else self._stats.aggregate(stats)

    def _rebuild_stats(self, data: dict[str, Any]) -> KVConnectorStats:
        """Stats a worker sent as plain data, as the connector's own stats class."""
        built = self.connector.build_kv_connector_stats(data) if self.connector else None
        return built if built is not None else KVConnectorStats(data=dict(data))

    # -- queries and upkeep ---------------------------------------------------------------

    def held_request_ids(self) -> set[str]:
        """Finished requests whose blocks the connector still holds."""
        return self._awaiting_send | self._awaiting_recv

    def loads_done_ids(self) -> set[str]:
        return set(self._loads_done)

    def has_pending_work(self) -> bool:
        """Work that only more steps complete: held blocks, or the connector's own queue."""
        if self._awaiting_send or self._awaiting_recv:
            return True
        return self.connector is not None and self.connector.has_pending_push_work()

    def has_pending_block_frees(self) -> bool:
        return self.connector is not None and self.connector.has_pending_block_frees()

    def take_stats(self) -> KVConnectorStats | None:
        stats, self._stats = self._stats, None
        return stats

    def reset_cache(self) -> bool:
        """Reset the connector's own cache; True on success or when it has none."""
        if self.connector is None:
            return True
        return self.connector.reset_cache() is not False

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
