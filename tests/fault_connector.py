"""A fault-injecting KV connector for tests, loaded through kv_connector_module_path.

It is the ExampleConnector with chosen loads sabotaged. Extra config (on top of Example's):
``fail_loads``: indexes (0-based, in load order within this worker) of the loads to sabotage;
``mode``: ``"error"`` (the load is skipped and reported as failed) or ``"corrupt"`` (garbage is
written into the blocks, and the connector, like one that verifies checksums, reports them).
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
