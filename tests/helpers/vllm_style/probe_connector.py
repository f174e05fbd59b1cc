"""A vLLM-style connector that never transfers anything: each hook reads kvferry's objects
through the vLLM surface, attribute by attribute, the way connectors do, into ``SEEN`` (hook
-> list of dicts) for the tests to check. Constructor in vLLM's positional style."""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.forward_context import ForwardContext, get_forward_context
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

SEEN: dict[str, list[dict[str, Any]]] = {}


def _see(hook: str, **values: Any) -> None:
    SEEN.setdefault(hook, []).append(values)


class VllmProbeConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
        kvt, events = vllm_config.kv_transfer_config, vllm_config.kv_events_config
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        assert isinstance(spec, FullAttentionSpec)
        _see(
            "init",
            role=role,
            is_vllm_config=isinstance(vllm_config, VllmConfig),
            dtype=mc.dtype,
            max_model_len=mc.max_model_len,
            served_model_name=mc.served_model_name,
            num_layers=mc.get_num_layers(pc),
            num_kv_heads=mc.get_num_kv_heads(pc),
            head_size=mc.get_head_size(),
            block_size=cc.block_size,
            cache_dtype=cc.cache_dtype,
            world_size=pc.world_size,
            rank=pc.rank,
            tensor_parallel_size=pc.tensor_parallel_size,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_num_seqs=sc.max_num_seqs,
            sched_max_model_len=sc.max_model_len,
            kv_role=kvt.kv_role,
            engine_id=kvt.engine_id,
            extra=kvt.get_from_extra_config("probe", None),
            events_enabled=events.enable_kv_cache_events,
            device=vllm_config.device_config.device,
            num_blocks=kv_cache_config.num_blocks,
            layer_names=list(kv_cache_config.kv_cache_groups[0].layer_names),
            spec=(spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype),
            page_size_bytes=spec.page_size_bytes,
        )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        assert isinstance(request, Request)
        _see(
            "lookup",
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            all_token_ids=list(request.all_token_ids),
            num_tokens=request.num_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens,
            arg_num_computed=num_computed_tokens,
            waiting=request.status == RequestStatus.WAITING,
            is_finished=request.is_finished(),
            max_tokens=request.sampling_params.max_tokens,
            kv_transfer_params=request.kv_transfer_params,
            num_block_hashes=len(request.block_hashes),
            mm_features=list(request.mm_features),
            lora_request=request.lora_request,
            cache_salt=request.cache_salt,
        )
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        _see(
            "alloc",
            request_id=request.request_id,
            is_blocks=isinstance(blocks, KVCacheBlocks),
            block_ids=blocks.get_block_ids(),
            num_external_tokens=num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        so = scheduler_output
        cached = so.scheduled_cached_reqs
        assert isinstance(cached, CachedRequestData)
        new = []
        for r in so.scheduled_new_reqs:
            assert isinstance(r, NewRequestData)
            new.append(
                dict(
                    req_id=r.req_id,
                    prompt_token_ids=list(r.prompt_token_ids or []),
                    block_ids=r.block_ids,
                    num_computed_tokens=r.num_computed_tokens,
                    max_tokens=r.sampling_params.max_tokens if r.sampling_params else None,
                    mm_features=list(r.mm_features),
                    lora_request=r.lora_request,
                )
            )
        _see(
            "build",
            new=new,
            cached_req_ids=list(cached.req_ids),
            resumed_req_ids=set(cached.resumed_req_ids),
            new_token_ids=list(cached.new_token_ids),
            new_block_ids=list(cached.new_block_ids),
            cached_num_computed=list(cached.num_computed_tokens),
            cached_num_output=list(cached.num_output_tokens),
            num_reqs=cached.num_reqs,
            num_scheduled_tokens=dict(so.num_scheduled_tokens),
            total=so.total_num_scheduled_tokens,
            finished_req_ids=set(so.finished_req_ids),
            preempted_req_ids=set(so.preempted_req_ids or ()),
            spec_tokens=dict(so.scheduled_spec_decode_tokens),
            encoder_inputs=dict(so.scheduled_encoder_inputs),
        )
        return KVConnectorMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        attn = forward_context.attn_metadata
        layers = forward_context.no_compile_layers
        _see(
            "start_load",
            is_context=isinstance(forward_context, ForwardContext),
            is_current=forward_context is get_forward_context(),
            attn_is_dict=attn is None or isinstance(attn, dict),
            attn_layers=None if attn is None else sorted(attn),
            all_metadata=attn is None
            or all(isinstance(m, AttentionMetadata) for m in attn.values()),
            slot_mapping_per_layer=attn is None
            or all(forward_context.slot_mapping[n] is m.slot_mapping for n, m in attn.items()),
            has_attn=attn is not None,
            layers={n: tuple(layer.kv_cache.shape) for n, layer in layers.items()},
            layer_names_match=all(layer.layer_name == n for n, layer in layers.items()),
            registered_tensors=all(
                layer.kv_cache is self._kv_caches[n] for n, layer in layers.items()
            ),
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        m = attn_metadata
        _see(
            "save",
            layer_name=layer_name,
            is_metadata=isinstance(m, AttentionMetadata),
            from_context=get_forward_context().attn_metadata[layer_name] is m,
            slot_mapping=m.slot_mapping.tolist(),
            query_start_loc=(m.query_start_loc.dtype, m.query_start_loc.tolist()),
            seq_lens=(m.seq_lens.dtype, m.seq_lens.tolist()),
            block_table=m.block_table.tolist(),
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            kv_shape=tuple(kv_layer.shape),
        )

    def wait_for_save(self) -> None:
        return

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        o = connector_output
        _see(
            "output",
            is_output=isinstance(o, KVConnectorOutput),
            fields=(
                o.finished_sending,
                o.finished_recving,
                o.kv_connector_stats,
                o.kv_cache_events,
                o.kv_connector_worker_meta,
                o.invalid_block_ids,
                o.failed_recving,
                o.expected_finished_count,
            ),
        )

    def request_finished(self, request: Request, block_ids: list[int]):
        _see(
            "finished",
            request_id=request.request_id,
            finished=RequestStatus.is_finished(request.status),
            is_finished=request.is_finished(),
            reason=request.get_finished_reason(),
            output_token_ids=list(request.output_token_ids),
            num_output_tokens=request.num_output_tokens,
            block_ids=list(block_ids),
        )
        return False, None
