"""The worker's side of each step around the forward pass, for a configured KV connector.

pre_forward:  handle_preemptions -> bind_connector_metadata -> start_load_kv (sync loads)
forward:      attention layers call wait_for_layer_load / save_kv_layer
post_forward: start_load_kv (if not yet) -> wait_for_save -> get_finished -> load errors
              -> stats -> events -> worker metadata -> clear_connector_metadata
no_forward:   the same lifecycle for a step with no tokens, so async transfers keep
              reporting while nothing is computed
"""

from __future__ import annotations

import torch

from kvferry.kv_transfer.base import KVConnectorBase
from kvferry.kv_transfer.copy_ops import KVBlockCopy
from kvferry.model.forward_context import ForwardContext, set_forward_context
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from kvferry.step_types.scheduler_output import SchedulerOutput


class KVConnectorDriver:
    def __init__(self, connector: KVConnectorBase, kv_caches: dict[str, torch.Tensor]) -> None:
        self.connector = connector
        self.kv_caches = kv_caches
        connector.register_kv_caches(kv_caches)
        # One op per worker: it keeps its copier for the engine's KV and the connector's buffers.
        self.copy_op = KVBlockCopy()
        connector.set_host_xfer_buffer_ops(self.copy_op)
        self._load_started = False

    def pre_forward(self, so: SchedulerOutput, ctx: ForwardContext) -> None:
        c = self.connector
        meta = so.kv_connector_metadata
        if meta is None:
            raise RuntimeError("a KV connector is configured but the step carries no metadata")
        c.handle_preemptions(meta)
        c.bind_connector_metadata(meta)
        self._load_started = False
        if so.has_sync_kv_loads:
            c.start_load_kv(ctx)
            self._load_started = True

    def post_forward(
        self, so: SchedulerOutput, ctx: ForwardContext, wait_for_save: bool = True
    ) -> KVConnectorOutput:
        c = self.connector
        try:
            if not self._load_started:
                c.start_load_kv(ctx)
            if wait_for_save:
                c.wait_for_save()
            sending, recving = c.get_finished(so.finished_req_ids)
            return KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                invalid_block_ids=c.get_block_ids_with_load_errors(),
                failed_recving=c.get_failed_recving(),
                kv_connector_stats=c.get_kv_connector_stats(),
                kv_cache_events=c.get_kv_connector_kv_cache_events(),
                kv_connector_worker_meta=c.build_connector_worker_meta(),
            )
        finally:
            c.clear_connector_metadata()

    def no_forward(self, so: SchedulerOutput) -> KVConnectorOutput:
        ctx = ForwardContext(None, self.kv_caches, self.connector)
        with set_forward_context(ctx):
            self.pre_forward(so, ctx)
            return self.post_forward(so, ctx)

    def abort_step(self) -> None:
        """Unbind after a failed forward so the next step starts clean."""
        self.connector.clear_connector_metadata()
