"""The worker's side of each step around the forward pass, for a configured KV connector.

In vLLM's order, on every step that carries connector metadata:

pre_forward:  handle_preemptions -> bind_connector_metadata -> start_load_kv
forward:      attention layers call wait_for_layer_load / save_kv_layer
post_forward: finish_forward -> wait_for_save -> get_transfer_results -> load errors
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

    def pre_forward(self, so: SchedulerOutput, ctx: ForwardContext) -> None:
        c = self.connector
        meta = so.kv_connector_metadata
        if meta is None:
            raise RuntimeError("a KV connector is configured but the step carries no metadata")
        c.handle_preemptions(meta)
        c.bind_connector_metadata(meta)
        # Before the forward on every step, sync loads or not: connectors written for vLLM
        # rely on loads having started when the first layer asks for them.
        try:
            c.start_load_kv(ctx)
        except BaseException:
            c.clear_connector_metadata()
            raise

    def post_forward(
        self, so: SchedulerOutput, ctx: ForwardContext, wait_for_save: bool = True
    ) -> KVConnectorOutput:
        c = self.connector
        try:
            c.finish_forward()
            if wait_for_save:
                c.wait_for_save()
            results = c.get_transfer_results(so.finished_req_ids)
            return KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                invalid_block_ids=c.get_block_ids_with_load_errors(),
                failed_recving=set(results.failed_recving),
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
