"""A P/D test connector (``kv_connector_module_path="tests.helpers.pd_test_connector"``).

ExampleConnector moves the KV (the prefill instance stores the prompt's full blocks in a shared
folder, the decode instance loads them), and on top of it this connector plays the P/D
hand-off the way NixlConnector does, so servers and the proxy can be tested without NIXL:

- prefill side: a request with ``kv_transfer_params={"do_remote_decode": true}`` that finishes
  normally keeps its blocks (``request_finished`` returns True) and returns
  ``{"do_remote_prefill": true, "remote_engine_id", "remote_request_id", "remote_block_ids",
  ...}``. The worker reports it ``finished_sending`` (the blocks are freed) once the release
  marker ``<store>/released/<engine_id>/<request_id>`` exists, or after ``lease_s`` seconds.
- consumer side: a request whose params say ``do_remote_prefill`` writes that marker when it
  finishes, for whatever reason: a decode that is done, or the server's
  ``/v1/kv/release`` request that is aborted right away (then on the prefill instance itself).

The worker also reports ``bytes_transferred`` and ``transfer_duration`` stats for its loads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvferry.kv_transfer.base import KVConnectorMetadata, KVConnectorStats
from kvferry.kv_transfer.connectors.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)
from kvferry.request import Request, RequestStatus


@dataclass
class PDMeta(ExampleConnectorMetadata):
    holds: list[str] = field(default_factory=list)


def _safe(name: Any) -> str:
    text = str(name)
    if not text or "/" in text or text.startswith("."):
        raise ValueError(f"bad id in kv_transfer_params: {text!r}")
    return text


class PDTestConnector(ExampleConnector):
    subclass_options = ("lease_s",)

    def __init__(self, config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.lease_s = float(extra.get("lease_s", 60.0))
        self.engine_id = str(self._kv_transfer_config.engine_id)
        self.markers = self.root / "released"
        self.bytes_per_token = kv_cache_config.bytes_per_block // self.block_size
        self._new_holds: list[str] = []
        self._held: dict[str, float] = {}  # worker: request id -> lease deadline
        self._stats: dict[str, Any] = {}

    # ---------------------------------------------------------------- scheduler side
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        super().request_finished(request, block_ids)
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            folder = self.markers / _safe(params.get("remote_engine_id"))
            folder.mkdir(parents=True, exist_ok=True)
            (folder / _safe(params.get("remote_request_id"))).touch()
            return False, None
        done = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        )
        if not (params.get("do_remote_decode") and done and block_ids):
            return False, None
        self._new_holds.append(request.request_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_host": "127.0.0.1",
            "remote_port": 0,
            "tp_size": 1,
            "num_tokens": request.num_computed_tokens,
        }

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, ExampleConnectorMetadata)
        holds, self._new_holds = self._new_holds, []
        return PDMeta(loads=meta.loads, stores=meta.stores, holds=holds)

    # ---------------------------------------------------------------- worker side
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        if isinstance(metadata, PDMeta):
            for rid in metadata.holds:
                self._held[rid] = time.monotonic() + self.lease_s

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        tokens = sum(job.num_tokens - job.start for job in meta.loads)
        t0 = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        if tokens:
            self._stats["bytes_transferred"] = (
                self._stats.get("bytes_transferred", 0) + tokens * self.bytes_per_token
            )
            self._stats.setdefault("transfer_duration", []).append(time.perf_counter() - t0)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending = set()
        now = time.monotonic()
        for rid, deadline in list(self._held.items()):
            marker = self.markers / self.engine_id / rid
            if marker.exists() or now > deadline:
                sending.add(rid)
                del self._held[rid]
                marker.unlink(missing_ok=True)
        return sending or None, None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self._stats:
            return None
        stats, self._stats = KVConnectorStats(self._stats), {}
        return stats
