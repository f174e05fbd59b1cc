"""Fault-injecting KV connectors for tests, loaded through
``kv_connector_module_path="tests.helpers.fault_connector"``; both are the ExampleConnector
with faults on top.

:class:`FaultyExampleConnector` sabotages chosen loads. Extra config (on top of Example's):
``fail_loads``: indexes (0-based, in load order within this worker) of the loads to sabotage;
``mode``: ``"error"`` (the load is skipped and reported as failed) or ``"corrupt"`` (garbage is
written into the blocks, and the connector, like one that verifies checksums, reports them).

:class:`HookFaultConnector` raises in one scheduler hook (``fail_hook``) for chosen requests
(``fail_request_ids``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvferry.kv_transfer.connectors.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)


class FaultyExampleConnector(ExampleConnector):
    subclass_options = ("fail_loads", "mode")

    def __init__(self, config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.fail_loads = set(extra.get("fail_loads", []))
        self.mode = extra.get("mode", "error")
        self.num_loads = 0
        self.sabotaged_req_ids: list[str] = []

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        good = []
        for job in meta.loads:
            index, self.num_loads = self.num_loads, self.num_loads + 1
            if index not in self.fail_loads:
                good.append(job)
                continue
            self.sabotaged_req_ids.append(job.req_id)
            bad_blocks = job.block_ids[job.start // self.block_size :]
            if self.mode == "corrupt":
                for cache in self._kv_caches.values():
                    idx = torch.tensor(bad_blocks, dtype=torch.long, device=cache.device)
                    cache.index_fill_(1, idx, 1e4)
            self._load_errors.update(bad_blocks)
        meta.loads = good
        super().start_load_kv(forward_context, **kwargs)


class HookFaultConnector(ExampleConnector):
    """ExampleConnector whose scheduler hook ``fail_hook`` raises for ``fail_request_ids``."""

    subclass_options = ("fail_hook", "fail_request_ids")

    def __init__(self, config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.fail_hook = extra["fail_hook"]
        self.fail_ids = set(extra["fail_request_ids"])

    def _maybe_fail(self, hook: str, request: Any) -> None:
        if hook == self.fail_hook and request.request_id in self.fail_ids:
            raise RuntimeError(f"injected fault in {hook}")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        self._maybe_fail("get_num_new_matched_tokens", request)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._maybe_fail("update_state_after_alloc", request)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        self._maybe_fail("request_finished", request)
        return super().request_finished(request, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        # A step-wide hook: a fault here is the step's, whichever request provoked it.
        if self.fail_hook == "build_connector_meta":
            for new in scheduler_output.scheduled_new_reqs:
                if new.req_id in self.fail_ids:
                    raise RuntimeError("injected fault in build_connector_meta")
        return super().build_connector_meta(scheduler_output)
