"""A scheduler-role connector that answers as a test scripts it and records every call.

Set its fields before the steps that read them (``external``, ``defer``, ``delay_free``,
``params_for``, ``pending_work``, ``pending_block_frees``), then check what it recorded
(``lookups``, ``allocs``, ``finished``, ``outputs``, ``metas``). The workers' side of its
transfers is played by :mod:`tests.helpers.transfer_sim`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from kvferry.config import EngineConfig, KVTransferConfig
from kvferry.core.kv_cache_manager import KVCacheBlocks
from kvferry.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from kvferry.request import Request, RequestStatus
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from kvferry.step_types.scheduler_output import SchedulerOutput
from tests.helpers.scheduler import make_kv_cache_config


@dataclass
class ScriptedMeta(KVConnectorMetadata):
    step: int
    loads: list[tuple[str, int]] = field(default_factory=list)  # (req id, external tokens)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)


class ScriptedConnector(KVConnectorBase):
    """Scheduler side only. Per request id: how many leading tokens are available outside
    (``external``: id -> (tokens from position 0, async)), how many lookups answer None first
    (``defer``), whether the free is delayed (``delay_free``), and kv_transfer_params
    (``params_for``: the params are ``{"remote_block_ids": block_ids}``)."""

    def __init__(self) -> None:
        kvt = KVTransferConfig(kv_connector="Scripted", kv_role="kv_both")
        config = cast(EngineConfig, SimpleNamespace(kv_transfer_config=kvt))
        super().__init__(config, KVConnectorRole.SCHEDULER, make_kv_cache_config(8))
        self.external: dict[str, tuple[int, bool]] = {}
        self.defer: Counter[str] = Counter()
        self.delay_free: set[str] = set()
        self.params_for: set[str] = set()
        self.pending_block_frees = False
        self.pending_work = False
        self.lookups: list[tuple[str, int]] = []
        self.allocs: list[tuple[str, list[int], int]] = []
        self.finished: list[tuple[str, RequestStatus, list[int]]] = []
        self.outputs: list[KVConnectorOutput] = []
        self.metas: list[ScriptedMeta] = []
        self.async_started: list[str] = []
        self.delayed: list[str] = []
        self._loads: list[tuple[str, int]] = []

    # worker side: never used here
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise AssertionError("scheduler side only")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise AssertionError("scheduler side only")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        raise AssertionError("scheduler side only")

    def wait_for_save(self) -> None:
        raise AssertionError("scheduler side only")

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self.lookups.append((rid, num_computed_tokens))
        if self.defer[rid] > 0:
            self.defer[rid] -= 1
            return None, False
        available, load_async = self.external.get(rid, (0, False))
        n = max(0, available - num_computed_tokens)
        return n, load_async and n > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        self.allocs.append((rid, blocks.get_block_ids()[0], num_external_tokens))
        if num_external_tokens > 0:
            self._loads.append((rid, num_external_tokens))
            if request.status != RequestStatus.RUNNING and self.external[rid][1]:
                self.async_started.append(rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ScriptedMeta(
            len(self.metas), self._loads, dict(scheduler_output.num_scheduled_tokens)
        )
        self._loads = []
        self.metas.append(meta)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.outputs.append(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self.finished.append((rid, request.status, list(block_ids)))
        delay = rid in self.delay_free
        if delay:
            self.delayed.append(rid)
        return delay, ({"remote_block_ids": list(block_ids)} if rid in self.params_for else None)

    def take_events(self) -> list[Any]:
        return ["scheduler-event"]

    def has_pending_work(self) -> bool:
        return self.pending_work

    def has_pending_block_frees(self) -> bool:
        return self.pending_block_frees
