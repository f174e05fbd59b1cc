"""The LMCacheMPConnector's scheduler half: lookups, retrieve plans and store plans.

LMCache stores KV in chunks of ``chunk_size`` tokens (the server's ``--chunk-size``, a
multiple of the engine's block size), keyed by the hash of the whole token prefix up to the
chunk's end. Per request the half keeps a small tracker:

- lookup: LMCache's scheduler adapter sends LOOKUP (which also read-locks the matched chunks
  on the server) and polls the answer without blocking; ``None`` goes back to the engine
  while it is in flight. The last prompt token is never offered (its logits are needed).
- retrieve: the chunks past the engine's own prefix hit, into the blocks just allocated,
  asynchronously (the request waits in ``WAITING_FOR_REMOTE_KVS``). Chunks the engine's hit
  covers are not read; their locks are released at once.
- store: each complete prompt chunk, right after the step whose forward computed it
  (chunks already on the server, found by the lookup, are not stored again).

The blocks of a request that stored anything are freed only once the worker reports its
stores done (``finished_sending``), as LMCache's worker adapter expects.

When the server is unreachable, LMCache's adapters switch to degraded mode (health pings
fail): lookups answer 0, stores are dropped, loads in flight fail; the half logs each switch
once. Requests keep being served from the engine's own compute.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import KVConnectorStats
from kvferry.kv_transfer.connectors.lmcache_mp.lmcache_api import (
    lmcache_api,
    parallel_strategy,
)
from kvferry.kv_transfer.connectors.lmcache_mp.metadata import (
    ChunkOp,
    LMCacheMPConnectorMetadata,
)
from kvferry.kv_transfer.connectors.lmcache_mp.options import LMCacheMPOptions
from kvferry.kv_transfer.connectors.split import SchedulerHalf
from kvferry.request import RequestStatus

if TYPE_CHECKING:
    from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView, KVCacheManagerView
    from kvferry.request import Request
    from kvferry.step_types.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class _Tracker:
    request: Request
    hit_tokens: int | None = None  # LMCache's chunk-aligned prefix hit, once known
    looked_up: bool = False  # a LOOKUP went out (a server session exists)
    load_planned: bool = False
    locks_released: bool = False
    stored_upto: int = 0  # chunk-aligned: tokens on the server (found or stored)
    stored_any: bool = False

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def salt(self) -> str:
        return self.request.cache_salt or ""


class LMCacheMPScheduler(SchedulerHalf):
    def __init__(
        self,
        opts: LMCacheMPOptions,
        model_name: str,
        block_size: int,
        owner: str,
        tp_size: int = 1,
    ) -> None:
        api = lmcache_api()
        self._owner = owner
        self._block_size = block_size
        try:
            self.adapter: Any = api.SchedulerAdapter(
                [opts.server_url],
                api.zmq_context,
                model_name,
                block_size,
                parallel_strategy(api, tp_size, 0),
                extra_config=opts.adapter_config(),
            )
        except ConnectionError as e:
            raise ConfigError(f"{owner}: {e}") from None
        except ValueError as e:  # e.g. the server's chunk size is not a block multiple
            raise ConfigError(f"{owner}: the LMCache server at {opts.server_url}: {e}") from None
        self.chunk_tokens: int = self.adapter.lmcache_tokens_per_chunk
        self._url = opts.server_url
        self._eager = opts.eager_prefetch
        self._trackers: dict[str, _Tracker] = {}
        self._loads: list[ChunkOp] = []
        self._healthy = True
        self._stats: dict[str, int] = {}
        self._kv_cache_manager: KVCacheManagerView | None = None
        logger.info(
            "%s: LMCache server %s, %d-token chunks (%d blocks)",
            owner,
            self._url,
            self.chunk_tokens,
            self.chunk_tokens // block_size,
        )

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManagerView) -> None:
        self._kv_cache_manager = kv_cache_manager

    # -- lookups ----------------------------------------------------------------------------
    def _tracker(self, request: Request) -> _Tracker:
        tr = self._trackers.get(request.request_id)
        if tr is None:
            tr = self._trackers[request.request_id] = _Tracker(request)
        return tr

    def _submit_lookup(self, tr: _Tracker) -> None:
        tr.looked_up = True
        self.adapter.maybe_submit_lookup_request(
            tr.request.request_id, tr.token_ids, cache_salt=tr.salt, reserve_last_token=True
        )

    def on_new_request(self, request: Request) -> None:
        if self._eager and len(request.prompt_token_ids) > self.chunk_tokens:
            self._submit_lookup(self._tracker(request))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._note_health()
        if len(request.prompt_token_ids) <= self.chunk_tokens:
            return 0, False  # no complete chunk before the last prompt token
        tr = self._tracker(request)
        if request.status == RequestStatus.PREEMPTED and (tr.load_planned or tr.locks_released):
            # Back after preemption: the first lookup's locks are spent; look up again.
            self._end(tr)
            tr = self._trackers[request.request_id] = _Tracker(
                request, stored_upto=tr.stored_upto, stored_any=tr.stored_any
            )
        if tr.load_planned:
            return 0, False
        self._submit_lookup(tr)
        hit = self.adapter.check_lookup_result(request.request_id)
        if hit is None:
            return None, False
        tr.hit_tokens = int(hit)
        external = tr.hit_tokens - num_computed_tokens
        return (external, True) if external > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        tr = self._trackers.get(request.request_id)
        if tr is None or tr.load_planned or not tr.hit_tokens:
            return
        hit = tr.hit_tokens
        # Chunks on the server need no store, whatever is loaded.
        tr.stored_upto = max(tr.stored_upto, hit)
        if num_external_tokens <= 0:
            self._release_locks(tr, 0, hit)
            return
        local = hit - num_external_tokens
        start = local // self.chunk_tokens * self.chunk_tokens
        block_ids = blocks.get_block_ids()[0]
        bs = self._block_size
        self._loads.append(
            ChunkOp(
                request_id=request.request_id,
                token_ids=list(tr.token_ids[:hit]),
                block_ids=list(block_ids[start // bs : hit // bs]),
                start=start,
                end=hit,
                skip_first_n_tokens=local - start,
                cache_salt=tr.salt,
            )
        )
        tr.load_planned = True
        if start > 0:
            self._release_locks(tr, 0, start)
        self._count("lookup_hit_tokens", num_external_tokens)

    def _release_locks(self, tr: _Tracker, start: int, end: int) -> None:
        """Free the server's read locks on chunks ``[start, end)`` that will not be read."""
        tr.locks_released = True
        if end > start:
            self.adapter.free_lookup_locks(
                tr.token_ids, start, end, tr.request.request_id, cache_salt=tr.salt
            )

    # -- each step --------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LMCacheMPConnectorMetadata:
        meta = LMCacheMPConnectorMetadata(
            loads=self._loads, preempted=bool(scheduler_output.preempted_req_ids)
        )
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_store(meta, new.req_id, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self._plan_store(meta, req_id, computed + scheduled.get(req_id, 0))
        return meta

    def _plan_store(self, meta: LMCacheMPConnectorMetadata, req_id: str, computed: int) -> None:
        tr = self._trackers.get(req_id)
        if tr is None or self._kv_cache_manager is None:
            return
        end = min(computed, len(tr.token_ids)) // self.chunk_tokens * self.chunk_tokens
        if end <= tr.stored_upto:
            return
        start, bs = tr.stored_upto, self._block_size
        block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
        meta.stores.append(
            ChunkOp(
                request_id=req_id,
                token_ids=list(tr.token_ids[:end]),
                block_ids=list(block_ids[start // bs : end // bs]),
                start=start,
                end=end,
                cache_salt=tr.salt,
            )
        )
        tr.stored_upto, tr.stored_any = end, True

    def _note_health(self) -> None:
        healthy = bool(self.adapter.is_healthy)
        if healthy != self._healthy:
            self._healthy = healthy
            if healthy:
                logger.warning("%s: LMCache server %s answers again", self._owner, self._url)
            else:
                logger.warning(
                    "%s: LMCache server %s does not answer: lookups miss and requests are "
                    "computed here until it is back",
                    self._owner,
                    self._url,
                )
                self._count("server_unreachable", 1)

    # -- request end ------------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        tr = self._trackers.pop(request.request_id, None)
        if tr is None:
            return False, None
        self._end(tr)
        return tr.stored_any, None

    def _end(self, tr: _Tracker) -> None:
        req_id = tr.request.request_id
        if tr.hit_tokens and not tr.load_planned and not tr.locks_released:
            self._release_locks(tr, 0, tr.hit_tokens)
        if tr.looked_up:
            self.adapter.end_session(req_id)
        self.adapter.cleanup_lookup_result(req_id)

    def has_pending_work(self) -> bool:
        return bool(self._loads)

    def reset_cache(self) -> bool | None:
        return bool(self.adapter.reset_cache())

    def _count(self, key: str, n: int) -> None:
        self._stats[key] = self._stats.get(key, 0) + n

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self._stats:
            return None
        stats, self._stats = KVConnectorStats(data=dict(self._stats)), {}
        return stats

    def num_tracked_requests(self) -> int:
        """Requests the half still tracks (0 when the engine is idle: the leak check)."""
        return len(self._trackers) + len(self._loads)

    def shutdown(self) -> None:
        self.adapter.shutdown()
