"""The LMCacheMPConnector's worker half: registers the engine's KV caches with the LMCache
server and runs the step's retrieves and stores through LMCache's worker adapter.

kvferry's per-layer KV tensors are ``(2, num_blocks, block_size, num_kv_heads, head_dim)``,
the layout LMCache calls ``NHD`` (vLLM's flash-attention layout); an HND pool is refused. On a CPU engine LMCache's
adapter copies blocks itself (engine-driven transfer): a store gathers the blocks into the
server's buffers (POSIX shared memory when the server has ``--shm-name``) and commits them,
a retrieve scatters the server's buffers into the blocks; both finish inside the call, and
their completions are reported by the adapter's ``get_finished``.

Retrieves run before the forward (``start_load_kv``), stores after it (``wait_for_save``).
A call that raises (the server went away mid-call) fails only that request's transfer: a
retrieve's blocks are reported as load errors (``kv_load_failure_policy`` applies), a store
is dropped.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvferry.config import ConfigError
from kvferry.kv_layout import KVCacheLayout, layout_of
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
from kvferry.kv_transfer.connectors.split import WorkerHalf

if TYPE_CHECKING:
    import torch

    from kvferry.kv_transfer.base import KVConnectorMetadata
    from kvferry.model.forward_context import ForwardContext

logger = logging.getLogger(__name__)

# LMCache's name for kvferry's per-layer layout (2, blocks, block_size, heads, head_dim).
KV_LAYOUT = "NHD"


class LMCacheMPWorker(WorkerHalf):
    def __init__(
        self,
        opts: LMCacheMPOptions,
        model_name: str,
        block_size: int,
        owner: str,
        tp_size: int = 1,
        rank: int = 0,
    ) -> None:
        self._api = lmcache_api()
        self._owner = owner
        self._url = opts.server_url
        self._block_size = block_size
        try:
            self.adapter: Any = self._api.WorkerAdapter(
                opts.server_url,
                self._api.zmq_context,
                model_name,
                block_size,
                parallel_strategy(self._api, tp_size, rank),
                extra_config=opts.adapter_config(),
            )
        except ConnectionError as e:
            raise ConfigError(f"{owner}: {e}") from None
        except ValueError as e:
            raise ConfigError(f"{owner}: the LMCache server at {opts.server_url}: {e}") from None
        self.chunk_tokens: int = self.adapter.lmcache_tokens_per_chunk
        # Requests this worker submitted stores for: the scheduler delayed their frees.
        self._storing: set[str] = set()
        self._failed_loads: set[str] = set()
        self._error_blocks: set[int] = set()
        self._stats: dict[str, Any] = {}
        self._healthy = True

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, t in kv_caches.items():
            if t.dim() != 5 or t.shape[0] != 2 or t.shape[2] != self._block_size:
                raise ConfigError(
                    f"{self._owner}: layer {name} has KV shape {tuple(t.shape)}; LMCache "
                    f"transfers the (2, blocks, {self._block_size}, heads, head_dim) layout"
                )
            if t.shape[3] > 1 and layout_of(t) is not KVCacheLayout.NHD:
                raise ConfigError(
                    f"{self._owner}: layer {name}'s KV is not in the NHD memory order (the KV "
                    "pool is HND: a connector or KVFERRY_KV_CACHE_LAYOUT asked for it); kvferry "
                    "hands LMCache NHD caches only"
                )
        try:
            self.adapter.register_kv_caches(kv_caches, layout_hints={"kv_layout": KV_LAYOUT})
        except ConnectionError as e:
            raise ConfigError(f"{self._owner}: {e}") from None
        except (ValueError, NotImplementedError) as e:
            raise ConfigError(f"{self._owner}: LMCache refused kvferry's KV caches: {e}") from None
        if self._unpickles():
            self.adapter.shutdown()
            raise ConfigError(
                f"{self._owner}: the LMCache server at {self._url} has no shared-memory "
                "segment, so LMCache would send KV to this engine as pickles (unpickling data "
                "from a peer can run code); start the server with --shm-name NAME"
            )

    def _unpickles(self) -> bool:
        """Whether the adapter's transport unpickles what the server sends (engine-driven
        transfer to a server without ``--shm-name``; also after a re-registration with a
        restarted server)."""
        ctx = getattr(self.adapter, "transfer_ctx", None)
        try:
            inner = getattr(ctx, "engine_driven_context", None)
        except RuntimeError:  # not registered (yet)
            return False
        return isinstance(inner, self._api.PickleContext)

    def _op(self, op: ChunkOp) -> Any:
        return self._api.LoadStoreOp(
            token_ids=op.token_ids,
            block_ids=[op.block_ids],
            start=op.start,
            end=op.end,
            skip_first_n_tokens=op.skip_first_n_tokens,
        )

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, LMCacheMPConnectorMetadata)
        self.adapter.handle_preemptions(metadata.preempted)

    def start_load_kv(self, metadata: KVConnectorMetadata, forward_context: ForwardContext) -> None:
        assert isinstance(metadata, LMCacheMPConnectorMetadata)
        unsafe = bool(metadata.loads) and self._unpickles()
        for op in metadata.loads:
            if unsafe:
                # A restarted server without shared memory: refuse its pickles, compute.
                logger.error(
                    "%s: the LMCache server at %s now sends KV as pickles (no --shm-name); "
                    "not loading %s",
                    self._owner, self._url, op.request_id,
                )  # fmt: skip
                self._failed_loads.add(op.request_id)
                self._error_blocks.update(op.block_ids)
                self._count("load_errors", 1)
                continue
            t0 = time.perf_counter()
            try:
                self.adapter.submit_retrieve_request(
                    op.request_id, self._op(op), self.adapter.create_recorded_event(), op.cache_salt
                )
            except Exception as e:  # a dead server surfaces here as a timeout or a closed socket
                logger.warning(
                    "%s: retrieve of %s from %s failed (%s: %s); its tokens are not loaded",
                    self._owner, op.request_id, self._url, type(e).__name__, e,
                )  # fmt: skip
                self._failed_loads.add(op.request_id)
                self._error_blocks.update(op.block_ids)
                self._count("load_errors", 1)
                continue
            self._count("load_tokens", op.end - op.start - op.skip_first_n_tokens)
            self._sample("load_seconds", time.perf_counter() - t0)

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, LMCacheMPConnectorMetadata)
        for op in metadata.stores:
            self._storing.add(op.request_id)
            t0 = time.perf_counter()
            try:
                self.adapter.submit_store_request(
                    op.request_id, self._op(op), self.adapter.create_recorded_event(), op.cache_salt
                )
            except Exception as e:
                logger.warning(
                    "%s: store of %s to %s failed (%s: %s); dropped",
                    self._owner, op.request_id, self._url, type(e).__name__, e,
                )  # fmt: skip
                self._count("store_errors", 1)
                continue
            self._count("store_tokens", op.end - op.start)
            self._sample("store_seconds", time.perf_counter() - t0)

    def get_finished(
        self, finished_req_ids: set[str], metadata: KVConnectorMetadata | None
    ) -> tuple[set[str] | None, set[str] | None]:
        self._note_health()
        # Only requests with stores have delayed frees; LMCache's adapter would report any
        # finished request id it is handed.
        sending, recving = self.adapter.get_finished(finished_req_ids & self._storing)
        sending = set(sending or ())
        self._storing -= sending
        recving = set(recving or ()) | self._failed_loads
        self._failed_loads = set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = set(self.adapter.get_block_ids_with_load_errors()) | self._error_blocks
        self._error_blocks = set()
        return errors

    def _note_health(self) -> None:
        healthy = bool(self.adapter.is_healthy)
        if healthy != self._healthy:
            self._healthy = healthy
            if healthy:
                logger.warning(
                    "%s: LMCache server %s answers again (KV caches registered again)",
                    self._owner,
                    self._url,
                )
            else:
                logger.warning(
                    "%s: LMCache server %s does not answer: stores are dropped and loads fail "
                    "until it is back",
                    self._owner,
                    self._url,
                )

    def _count(self, key: str, n: int) -> None:
        self._stats[key] = self._stats.get(key, 0) + n

    def _sample(self, key: str, value: float) -> None:
        self._stats.setdefault(key, []).append(value)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self._stats:
            return None
        stats, self._stats = KVConnectorStats(data=self._stats), {}
        return stats

    def shutdown(self) -> None:
        self.adapter.shutdown()
