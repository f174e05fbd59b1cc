"""FaultInjectionConnector: wraps any connector and fails, corrupts or delays chosen loads and
stores, or raises from a chosen hook, so the engine's failure handling can be tested (and a
connector's author can see what the engine does when that connector misbehaves).

The wrapped connector does its work unchanged; the faults are applied at the protocol
boundary, where the engine sees them:

* a *failed load* is reported as failed, through the protocol: a synchronous load's blocks via
  ``get_block_ids_with_load_errors``, an asynchronous load's request via ``get_failed_recving``
  (with its ``finished_recving``), so ``kv_load_failure_policy`` applies ("fail" ends the
  request with finish reason ``error``, "recompute" computes the KV again);
* a *corrupt load* overwrites the loaded blocks with garbage once the wrapped connector has
  written them, and reports them failed (a connector that verifies checksums);
* a *delayed load* holds a synchronous load in ``start_load_kv``, or holds back an
  asynchronous load's ``finished_recving`` report, for the given time;
* a *failed store* is a store whose data does not survive: a later load that covers any block
  it saved is reported failed, until a later store saves that block again (needs prefix
  caching, which names blocks by hash);
* a *delayed store* holds ``wait_for_save`` of the step that computed it;
* ``raise_in``: the named hook raises :class:`InjectedFault` after the wrapped connector's
  call returned (for fault-isolation tests).

Options (``kv_connector_extra_config``):

``inner`` (required): the wrapped connector, by name (``"OffloadingConnector"``) or as a KV
transfer config object (``{"kv_connector": ..., "kv_connector_module_path": ...,
"kv_connector_extra_config": {...}}``); other KV transfer fields default to this connector's.

A *load* is one request's external hit (counted in the order the scheduler admits them, from
0); a *store* is one request's newly completed blocks in one step (in step order, from 0).
``fail_loads`` / ``corrupt_loads`` / ``fail_stores``: indexes of those to sabotage;
``fail_load_rate`` / ``corrupt_load_rate`` / ``fail_store_rate``: the probability that any
other one is (drawn from a generator seeded with ``seed``, default 0, so runs repeat).
``delay_loads_s`` / ``delay_stores_s``: how long to delay, applied to the indexes in
``delay_loads`` / ``delay_stores`` or, when those are not given, to every load / store.
``raise_in``: a hook name (e.g. ``"start_load_kv"``, ``"get_num_new_matched_tokens"``);
``raise_calls``: which calls of it raise (0-based; default: every call).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvferry.config import ConfigError, KVTransferConfig
from kvferry.kv_transfer.base import (
    CopyBlocksOp,
    KVConnectorBase,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    supports_hma,
)
from kvferry.kv_transfer.factory import KVConnectorFactory
from kvferry.kv_transfer.options import parse_options
from kvferry.logger import init_logger

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView, KVCacheManagerView
    from kvferry.model.forward_context import ForwardContext
    from kvferry.request import Request
    from kvferry.step_types.kv_connector_output import KVConnectorOutput
    from kvferry.step_types.scheduler_output import SchedulerOutput

logger = init_logger(__name__)

# Far from any real key or value, finite in every float dtype the engine uses.
GARBAGE = 1e4

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "register_kv_caches",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
)


class InjectedFault(RuntimeError):
    """Raised by the hook named in ``raise_in``."""


@dataclass
class FaultInjectionOptions:
    inner: Any = None
    fail_loads: list[int] = field(default_factory=list)
    corrupt_loads: list[int] = field(default_factory=list)
    fail_load_rate: float = 0.0
    corrupt_load_rate: float = 0.0
    delay_loads_s: float = 0.0
    delay_loads: list[int] | None = None
    fail_stores: list[int] = field(default_factory=list)
    fail_store_rate: float = 0.0
    delay_stores_s: float = 0.0
    delay_stores: list[int] | None = None
    seed: int = 0
    raise_in: str | None = None
    raise_calls: list[int] | None = None

    def validate(self, owner: str) -> None:
        if not isinstance(self.inner, (str, dict)) or not self.inner:
            raise ConfigError(
                f"{owner}: set inner to the wrapped connector's name or KV transfer config"
            )
        lists = ("fail_loads", "corrupt_loads", "delay_loads", "fail_stores", "delay_stores")
        for name in (*lists, "raise_calls"):
            value = getattr(self, name)
            if value is not None and not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
            ):
                raise ConfigError(f"{owner}: {name} must be a list of indexes >= 0")
        for name in ("fail_load_rate", "corrupt_load_rate", "fail_store_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{owner}: {name} must be between 0 and 1")
        for name in ("delay_loads_s", "delay_stores_s"):
            if not 0.0 <= getattr(self, name) < 3600:
                raise ConfigError(f"{owner}: {name} must be >= 0 seconds")
        if self.raise_in is not None and self.raise_in not in HOOKS:
            raise ConfigError(f"{owner}: raise_in must be one of {list(HOOKS)}")


@dataclass
class InjectedLoad:
    """A fault on one request's load: ``block_ids`` are the blocks it writes."""

    req_id: str
    block_ids: list[int]
    is_async: bool
    fail: bool = False
    corrupt: bool = False
    delay_s: float = 0.0


@dataclass
class FaultInjectionMetadata(KVConnectorMetadata):
    inner: KVConnectorMetadata
    loads: list[InjectedLoad] = field(default_factory=list)
    store_delay_s: float = 0.0


def inner_config(kvt: KVTransferConfig, owner: str) -> KVTransferConfig:
    """The wrapped connector's KV transfer config: ``inner`` over this one's fields."""
    inner = kvt.kv_connector_extra_config.get("inner")
    if isinstance(inner, str):
        child: dict[str, Any] = {"kv_connector": inner}
    elif isinstance(inner, dict):
        child = dict(inner)
    else:
        raise ConfigError(f"{owner}: inner must be a connector name or a KV transfer config")
    base = {f.name: getattr(kvt, f.name) for f in dataclasses.fields(kvt)}
    base.update(kv_connector=None, kv_connector_module_path=None, kv_connector_extra_config={})
    config = KVTransferConfig.from_dict({**base, **child})
    if not config.kv_connector:
        raise ConfigError(f"{owner}: inner needs a kv_connector")
    return config


def _with_kv_transfer_config(config: EngineConfig, kvt: KVTransferConfig) -> EngineConfig:
    if dataclasses.is_dataclass(config):
        return dataclasses.replace(config, kv_transfer_config=kvt)
    child = copy.copy(config)  # a partial config (tests)
    child.kv_transfer_config = kvt
    return child


class _Selector:
    """Chooses loads (or stores) by index, or at random with a seeded generator."""

    def __init__(self, indexes: Iterable[int] | None, rate: float, rng: random.Random) -> None:
        self.indexes = None if indexes is None else set(indexes)
        self.rate = rate
        self.rng = rng

    def __call__(self, index: int, every: bool = False) -> bool:
        if self.indexes is None:
            return every
        if index in self.indexes:
            return True
        return self.rate > 0 and self.rng.random() < self.rate


class FaultInjectionConnector(KVConnectorBase, SupportsHMA):
    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        name = type(self).__name__
        kvt = self._kv_transfer_config
        self.options = o = parse_options(FaultInjectionOptions, kvt.kv_connector_extra_config, name)
        child = _with_kv_transfer_config(config, inner_config(kvt, name))
        self.inner: KVConnectorBase = KVConnectorFactory.create_connector(
            child, role, kv_cache_config
        )
        self.block_size = kv_cache_config.groups[0].block_size
        rng = random.Random(o.seed)
        self._fail_load = _Selector(o.fail_loads, o.fail_load_rate, rng)
        self._corrupt_load = _Selector(o.corrupt_loads, o.corrupt_load_rate, rng)
        self._delay_load = _Selector(o.delay_loads, 0.0, rng)
        self._fail_store = _Selector(o.fail_stores, o.fail_store_rate, rng)
        self._delay_store = _Selector(o.delay_stores, 0.0, rng)
        self._calls: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        # scheduler side
        self._asked: dict[str, tuple[int, bool]] = {}  # req -> (computed tokens, async)
        self._reqs: dict[str, Request] = {}
        self._num_loads = 0
        self._num_stores = 0
        self._lost: set[Any] = set()  # block hashes saved by failed stores
        self._step_loads: list[InjectedLoad] = []
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._sync_corrupt: list[InjectedLoad] = []
        self._async: dict[str, InjectedLoad] = {}
        self._held: dict[str, tuple[float, InjectedLoad]] = {}  # delayed finished_recving
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self.sabotaged_req_ids: list[str] = []

    def __getattr__(self, name: str) -> Any:
        # Anything else (test helpers such as check_offload_integrity) is the inner's.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @classmethod
    def supports_hma_config(cls, kvt: KVTransferConfig) -> bool:
        child = inner_config(kvt, cls.__name__)
        return supports_hma(KVConnectorFactory.get_connector_class(child))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True

    def _hook(self, name: str) -> None:
        if self.options.raise_in != name:
            return
        n = self._calls.get(name, 0)
        self._calls[name] = n + 1
        calls = self.options.raise_calls
        if calls is None or n in calls:
            raise InjectedFault(f"FaultInjectionConnector: injected fault in {name} (call {n})")

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    # ---------------------------------------------------------------- scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManagerView) -> None:
        self.inner.bind_kv_cache_manager(kv_cache_manager)

    def validate_kv_transfer_params(self, params: dict[str, Any]) -> None:
        self.inner.validate_kv_transfer_params(params)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, is_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        self._asked[request.request_id] = (num_computed_tokens, is_async)
        self._hook("get_num_new_matched_tokens")
        return count, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        rid = request.request_id
        self._reqs[rid] = request
        asked = self._asked.pop(rid, None)
        if num_external_tokens > 0 and asked is not None:
            self._plan_load(request, blocks, num_external_tokens, *asked)
        self._hook("update_state_after_alloc")

    def _plan_load(
        self,
        request: Request,
        blocks: KVCacheBlocksView,
        num_external: int,
        start: int,
        is_async: bool,
    ) -> None:
        o, bs = self.options, self.block_size
        index, self._num_loads = self._num_loads, self._num_loads + 1
        end = start + num_external
        hashes = request.block_hashes[start // bs : end // bs]
        corrupt = self._corrupt_load(index)
        fail = corrupt or self._fail_load(index) or any(h in self._lost for h in hashes)
        delay = o.delay_loads_s if o.delay_loads_s > 0 and self._delay_load(index, True) else 0.0
        if not (fail or delay):
            return
        block_ids = list(blocks.get_block_ids()[0][start // bs : -(-end // bs)])
        self._step_loads.append(
            InjectedLoad(request.request_id, block_ids, is_async, fail, corrupt, delay)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = FaultInjectionMetadata(self.inner.build_connector_meta(scheduler_output))
        meta.loads, self._step_loads = self._step_loads, []
        meta.store_delay_s = self._plan_stores(scheduler_output)
        self._hook("build_connector_meta")
        return meta

    def _plan_stores(self, so: SchedulerOutput) -> float:
        """Count this step's stores (requests completing blocks); lose the failed ones."""
        o, bs = self.options, self.block_size
        cached = so.scheduled_cached_reqs
        progress = [(n.req_id, n.num_computed_tokens) for n in so.scheduled_new_reqs]
        progress += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        delay = 0.0
        for rid, computed in progress:
            request = self._reqs.get(rid)
            end = computed + so.num_scheduled_tokens.get(rid, 0)
            if request is None or end // bs <= computed // bs:
                continue
            hashes = request.block_hashes[computed // bs : end // bs]
            index, self._num_stores = self._num_stores, self._num_stores + 1
            if self._fail_store(index):
                self._lost.update(hashes)
                self._count("failed_stores")
            else:
                self._lost.difference_update(hashes)
            if o.delay_stores_s > 0 and self._delay_store(index, True):
                delay = o.delay_stores_s
        return delay

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.inner.update_connector_output(connector_output)
        self._hook("update_connector_output")

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        result = self.inner.request_finished(request, block_ids)
        self._hook("request_finished")
        return result

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        if isinstance(self.inner, SupportsHMA):
            result = self.inner.request_finished_all_groups(request, block_ids)
        else:
            result = self.inner.request_finished(request, block_ids[0])
        self._hook("request_finished")
        return result

    def _forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._asked.pop(req_id, None)

    def take_events(self) -> Iterable[Any]:
        return self.inner.take_events()

    def has_pending_work(self) -> bool:
        return self.inner.has_pending_work()

    def has_pending_block_frees(self) -> bool:
        return self.inner.has_pending_block_frees()

    def get_finished_count(self) -> int | None:
        return self.inner.get_finished_count()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.inner.set_xfer_handshake_metadata(metadata)

    def reset_cache(self) -> bool | None:
        return self.inner.reset_cache()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        self.inner.register_kv_caches(kv_caches)
        self._hook("register_kv_caches")

    def set_host_xfer_buffer_ops(self, copy_op: CopyBlocksOp) -> None:
        super().set_host_xfer_buffer_ops(copy_op)
        self.inner.set_host_xfer_buffer_ops(copy_op)

    def _meta(self, metadata: KVConnectorMetadata) -> FaultInjectionMetadata:
        if not isinstance(metadata, FaultInjectionMetadata):
            raise TypeError("FaultInjectionConnector expects FaultInjectionMetadata")
        return metadata

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        self.inner.handle_preemptions(self._meta(metadata).inner)
        self._hook("handle_preemptions")

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        meta = self._meta(metadata)
        super().bind_connector_metadata(meta)
        self.inner.bind_connector_metadata(meta.inner)
        for load in meta.loads:
            if load.is_async:
                self._async[load.req_id] = load

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.inner.clear_connector_metadata()
        self._sync_corrupt = []

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta(self._get_connector_metadata())
        sync = [load for load in meta.loads if not load.is_async]
        delay = max((load.delay_s for load in sync), default=0.0)
        if delay > 0:
            self._count("delayed_loads")
            time.sleep(delay)
        self.inner.start_load_kv(forward_context, **kwargs)
        for load in sync:
            if load.fail:
                self._sabotage(load)
                self._load_errors.update(load.block_ids)
        self._sync_corrupt = [load for load in sync if load.corrupt]
        self._hook("start_load_kv")

    def _sabotage(self, load: InjectedLoad, layers: Iterable[str] | None = None) -> None:
        if load.corrupt:
            self._garble(load.block_ids, layers)
        if layers is None:  # once per load, not once per layer
            self.sabotaged_req_ids.append(load.req_id)
            self._count("corrupted_loads" if load.corrupt else "failed_loads")
            logger.warning(
                "FaultInjectionConnector: %s the load of %s",
                "corrupted" if load.corrupt else "failed",
                load.req_id,
            )

    def _garble(self, block_ids: list[int], layers: Iterable[str] | None) -> None:
        names = self._kv_caches if layers is None else layers
        for name in names:
            cache = self._kv_caches.get(name)
            if cache is not None and block_ids:
                idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
                cache.index_fill_(1, idx, GARBAGE)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)
        # A connector that loads layer by layer may write this layer only now.
        for load in self._sync_corrupt:
            self._garble(load.block_ids, [layer_name])
        self._hook("wait_for_layer_load")

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self._hook("save_kv_layer")

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, FaultInjectionMetadata) and meta.store_delay_s > 0:
            self._count("delayed_stores")
            time.sleep(meta.store_delay_s)
        self.inner.wait_for_save()
        self._hook("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.inner.get_finished(finished_req_ids)
        done = set(recving or ())
        now = time.monotonic()
        for rid in sorted(done):
            load = self._async.pop(rid, None)
            if load is not None and load.delay_s > 0:
                done.discard(rid)
                self._held[rid] = (now + load.delay_s, load)
                self._count("delayed_loads")
            elif load is not None:
                self._finish_async(load)
        for rid, (deadline, load) in list(self._held.items()):
            if now >= deadline:
                del self._held[rid]
                done.add(rid)
                self._finish_async(load)
        if self._held:  # the engine steps idle meanwhile: do not let it spin
            time.sleep(min(0.005, max(0.0, min(d for d, _ in self._held.values()) - now)))
        self._hook("get_finished")
        return sending, done or None

    def _finish_async(self, load: InjectedLoad) -> None:
        if load.fail:
            self._sabotage(load)
            self._failed_recving.add(load.req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        errors |= self.inner.get_block_ids_with_load_errors()
        self._hook("get_block_ids_with_load_errors")
        return errors

    def get_failed_recving(self) -> set[str]:
        failed, self._failed_recving = self._failed_recving, set()
        return failed | self.inner.get_failed_recving()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self.inner.get_kv_connector_stats()
        if self.counts:
            counts = {f"injected_{k}": v for k, v in self.counts.items()}
            self.counts = {}
            if stats is None:
                return KVConnectorStats(counts)
            stats.data.update(counts)
        return stats

    def get_kv_connector_kv_cache_events(self) -> Any | None:
        return self.inner.get_kv_connector_kv_cache_events()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta = self.inner.build_connector_worker_meta()
        self._hook("build_connector_worker_meta")
        return meta

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.inner.get_handshake_metadata()

    def shutdown(self) -> None:
        self.inner.shutdown()
