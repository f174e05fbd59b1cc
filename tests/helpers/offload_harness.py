"""Drive an offload connector's two halves around the real Scheduler, without a model.

:class:`OffloadHarness` builds a scheduler with the scheduler-role connector, a worker-role
connector over small float64 KV tensors, and a fake forward. The fake forward first checks
that every token before the ones it computes has the right KV in the request's blocks (so a
local hit, a load from host or disk, anything that put bad KV there, fails the test), then
writes the KV of the tokens it computes. A token's KV value is a rolling hash of the whole
prefix up to it, so two requests only share KV when they share the prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import torch

from kvferry.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from kvferry.core.outputs import EngineCoreOutput
from kvferry.core.scheduler import Scheduler
from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvferry.kv_transfer.aggregator import KVOutputAggregator
from kvferry.kv_transfer.base import KVConnectorRole, KVConnectorStats
from kvferry.kv_transfer.connectors.offloading.facade import OffloadConnectorBase
from kvferry.kv_transfer.copy_ops import copy_kv_blocks
from kvferry.kv_transfer.factory import KVConnectorFactory
from kvferry.kv_transfer.offload.transfer import TransferEngine
from kvferry.request import Request
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from kvferry.step_types.scheduler_output import SchedulerOutput
from tests.helpers.kv_events import events_on
from tests.helpers.scheduler import FakeWorker, assert_no_leaks

_MOD = (1 << 47) - 115  # a prime: values stay exact in float64


def kv_values(token_ids: list[int]) -> list[float]:
    out, h = [], 0
    for t in token_ids:
        h = (h * 1_000_003 + t + 1) % _MOD
        out.append(float(h))
    return out


class OffloadHarness:
    def __init__(
        self,
        connector: str,
        extra: dict[str, Any],
        *,
        num_blocks: int = 32,
        block_size: int = 16,
        max_model_len: int = 256,
        max_num_batched_tokens: int = 256,
        max_num_seqs: int = 16,
        policy: str = "fail",
        model_path: str | None = None,
        enable_prefix_caching: bool = True,
        num_layers: int = 2,
        kv_event_publisher: Any = None,
    ) -> None:
        """``kv_event_publisher``: turn KV cache events on and hand the batches to it."""
        # Background stores unless a test asks otherwise: the lifecycle tests are about jobs
        # that are still in flight while the scheduler moves on.
        extra = {"host_store_mode": "background", **extra}
        kvt = KVTransferConfig(
            kv_connector=connector,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy=policy,
        )
        self.config = cast(
            EngineConfig,
            SimpleNamespace(
                kv_transfer_config=kvt,
                cache_config=SimpleNamespace(enable_prefix_caching=enable_prefix_caching),
                parallel_config=SimpleNamespace(tensor_parallel_size=1),
                model_config=SimpleNamespace(model=model_path),
                kv_events_config=events_on() if kv_event_publisher is not None else None,
            ),
        )
        layers = tuple(f"model.layers.{i}.self_attn" for i in range(num_layers))
        group = KVCacheGroupSpec(layers, block_size, 1, 4, torch.float64)
        self.kv_cache_config = KVCacheConfig(num_blocks, (group,))
        self.block_size = block_size
        self.sched_conn = KVConnectorFactory.create_connector(
            self.config, KVConnectorRole.SCHEDULER, self.kv_cache_config
        )
        self.worker_conn = KVConnectorFactory.create_connector(
            self.config, KVConnectorRole.WORKER, self.kv_cache_config
        )
        self.kv_caches = {
            n: torch.full((2, num_blocks, block_size, 1, 4), -1.0, dtype=torch.float64)
            for n in layers
        }
        self.worker_conn.register_kv_caches(self.kv_caches)
        self.worker_conn.set_host_xfer_buffer_ops(copy_kv_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                enable_chunked_prefill=True,
            ),
            CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
            self.kv_cache_config,
            max_model_len=max_model_len,
            log_stats=True,
            connector=self.sched_conn,
            kv_load_failure_policy=policy,
            kv_events_config=self.config.kv_events_config,
            kv_event_publisher=kv_event_publisher,
        )
        self.fake = FakeWorker(self.scheduler)
        self.aggregator = KVOutputAggregator(1)
        self.metas: list[Any] = []
        self.outputs: list[KVConnectorOutput] = []
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, EngineCoreOutput] = {}
        self.checked_tokens = 0
        self.before_forward: Callable[[SchedulerOutput], None] | None = None
        self._stats = KVConnectorStats()

    @property
    def connector(self) -> OffloadConnectorBase:
        assert isinstance(self.sched_conn, OffloadConnectorBase)
        return self.sched_conn

    @property
    def engine(self) -> TransferEngine:
        worker = self.worker_conn.worker_half  # type: ignore[attr-defined]
        assert worker.core.engine is not None
        return cast(TransferEngine, worker.core.engine)

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    # -- one step -------------------------------------------------------------------------

    def step(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        w = self.worker_conn
        ctx: Any = SimpleNamespace()
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(ctx)  # before the forward on every step, as the engine (and vLLM) does
        if self.before_forward is not None:
            self.before_forward(so)
        ro = self.fake.execute(so)
        self._forward(so)
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        out = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            failed_recving=w.get_failed_recving(),
            kv_connector_stats=w.get_kv_connector_stats(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        ro.kv_connector_output = self.aggregator.aggregate([out])
        self.outputs.append(ro.kv_connector_output)
        for o in self.scheduler.update_from_output(so, ro):
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.finished[o.request_id] = o
        stats = self.scheduler.take_kv_connector_stats()
        if stats is not None:
            self._stats.aggregate(stats)
        self.scheduler.check_integrity()
        self.connector.check_offload_integrity()
        return so

    def _forward(self, so: SchedulerOutput) -> None:
        """Check the KV of every earlier token, then write the KV of the scheduled ones."""
        bs = self.block_size
        for rid, n in so.num_scheduled_tokens.items():
            state = self.fake.reqs[rid]
            end = state.num_computed_tokens
            start = end - n
            values = kv_values(state.token_ids[:end])
            blocks = state.block_ids
            for name, cache in self.kv_caches.items():
                got = cache[0, :, :, 0, 0].reshape(-1)
                slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(end)])
                if start:
                    want = torch.tensor(values[:start], dtype=torch.float64)
                    bad = (got[slots[:start]] != want).nonzero()
                    assert bad.numel() == 0, (
                        f"{rid}: wrong KV in {name} at positions {bad.view(-1)[:8].tolist()}"
                    )
                    self.checked_tokens += start
                new = torch.tensor(values[start:end], dtype=torch.float64)
                flat = cache.view(2, -1, 1, 4)
                flat[:, slots[start:end]] = new.view(1, -1, 1, 1)

    def run(self, max_steps: int = 2000) -> None:
        """Step until the scheduler has nothing left, transfers included."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError("the harness made no progress")

    def assert_clean(self) -> None:
        """The leak check: engine pool and scheduler empty, offload pool idle and sound."""
        self.run()
        assert_no_leaks(self.scheduler)
        self.connector.check_offload_integrity(idle=True)
        assert self.engine.num_in_flight() == 0

    def stats(self) -> dict[str, Any]:
        """Connector stats (worker and scheduler side) since the harness started."""
        return self._stats.data

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker_conn.shutdown()
