"""kvferry's objects decoded through the vLLM surface the way a connector reads them,
attribute by attribute, in a real run (``probe_connector`` records what each hook read)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.kv_transfer import vllm_imports

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPT = list(range(3, 3 + 37))


@pytest.fixture(scope="module")
def probe(tiny_model_factory):
    model_dir: Path = tiny_model_factory("llama")
    kv = {
        "kv_connector": "VllmProbeConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "tests.helpers.vllm_style.probe_connector",
        "kv_connector_extra_config": {"probe": 7},
    }
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, kv_transfer_config=kv)
    from tests.helpers.vllm_style import probe_connector

    inits = probe_connector.SEEN.pop("init")[-2:]  # this engine's two roles
    probe_connector.SEEN.clear()
    probe_connector.SEEN["init"] = inits
    out = llm.generate([{"prompt_token_ids": PROMPT}], PARAMS, use_tqdm=False)[0]
    # A later request: its first step tells the workers the first one finished.
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
    seen = {k: list(v) for k, v in probe_connector.SEEN.items()}
    yield llm, out, seen
    llm.engine.shutdown()


def test_vllm_config_view(probe, tiny_model_factory):
    llm, _, _ = probe
    cfg = llm.engine.config
    arch = cfg.model_config.arch
    from vllm.config import KVEventsConfig, VllmConfig

    v = VllmConfig(cfg)
    assert v.engine_config is cfg
    assert v.model_config.dtype is torch.float32
    assert v.model_config.max_model_len == 128
    assert v.model_config.served_model_name == cfg.model_config.model
    assert v.model_config.get_num_layers(v.parallel_config) == arch.num_hidden_layers
    assert v.model_config.get_num_kv_heads(v.parallel_config) == arch.num_key_value_heads
    assert v.model_config.get_head_size() == arch.head_dim
    assert v.model_config.hf_config.num_attention_heads == arch.num_attention_heads
    assert v.model_config.arch is arch  # kvferry's own names pass through
    assert v.cache_config.block_size == cfg.cache_config.block_size
    assert v.cache_config.cache_dtype == "auto"
    assert (v.parallel_config.world_size, v.parallel_config.rank) == (1, 0)
    assert v.scheduler_config.max_num_batched_tokens == cfg.scheduler_config.max_num_batched_tokens
    assert v.scheduler_config.max_num_seqs == cfg.scheduler_config.max_num_seqs
    assert v.scheduler_config.max_model_len == 128
    assert v.kv_transfer_config is cfg.kv_transfer_config
    assert v.kv_events_config == KVEventsConfig()
    assert v.kv_events_config.publisher == "null"
    assert v.device_config.device == cfg.device_config.torch_device
    assert v.device_config.device_type == "cpu"
    # A view, not a copy: a change to kvferry's config shows through.
    cfg.scheduler_config.max_num_seqs += 1
    assert v.scheduler_config.max_num_seqs == cfg.scheduler_config.max_num_seqs
    cfg.scheduler_config.max_num_seqs -= 1


def test_constructor_reads(probe):
    llm, _, seen = probe
    cfg, kvc = llm.engine.config, llm.engine.kv_cache_config
    arch, group = cfg.model_config.arch, kvc.groups[0]
    inits = seen["init"]
    assert {int(i["role"]) for i in inits} == {0, 1}
    for i in inits:
        assert i["is_vllm_config"]
        assert i["dtype"] is torch.float32
        assert (i["max_model_len"], i["sched_max_model_len"]) == (128, 128)
        assert i["served_model_name"] == cfg.model_config.model
        assert (i["num_layers"], i["num_kv_heads"], i["head_size"]) == (
            arch.num_hidden_layers,
            arch.num_key_value_heads,
            arch.head_dim,
        )
        assert (i["block_size"], i["cache_dtype"]) == (16, "auto")
        assert (i["world_size"], i["rank"], i["tensor_parallel_size"]) == (1, 0, 1)
        assert i["max_num_batched_tokens"] == cfg.scheduler_config.max_num_batched_tokens
        assert i["max_num_seqs"] == cfg.scheduler_config.max_num_seqs
        assert (i["kv_role"], i["engine_id"], i["extra"]) == (
            "kv_both",
            cfg.kv_transfer_config.engine_id,
            7,
        )
        assert i["events_enabled"] is False
        assert i["device"] == torch.device("cpu")
        assert i["num_blocks"] == kvc.num_blocks
        assert i["layer_names"] == list(group.layer_names)
        assert i["spec"] == (16, group.num_kv_heads, group.head_dim, torch.float32)
        assert i["page_size_bytes"] == group.bytes_per_block_per_layer


def test_request_and_blocks(probe):
    _, out, seen = probe
    look = seen["lookup"][0]
    assert look["prompt_token_ids"] == PROMPT == look["all_token_ids"]
    assert (look["num_tokens"], look["num_prompt_tokens"]) == (len(PROMPT), len(PROMPT))
    assert look["num_computed_tokens"] == 0 == look["arg_num_computed"]
    assert look["waiting"] and not look["is_finished"] and look["max_tokens"] == 3
    assert look["kv_transfer_params"] is None and look["cache_salt"] is None
    assert look["num_block_hashes"] == len(PROMPT) // 16
    assert look["mm_features"] == [] and look["lora_request"] is None
    alloc = seen["alloc"][0]
    assert alloc["is_blocks"] and alloc["num_external_tokens"] == 0
    assert len(alloc["block_ids"]) == 1 and len(alloc["block_ids"][0]) == 3  # 37 + 1 slots
    fin = seen["finished"][0]
    assert fin["finished"] and fin["is_finished"] and fin["reason"] == "length"
    assert fin["output_token_ids"] == list(out.outputs[0].token_ids)
    assert fin["num_output_tokens"] == 3
    assert fin["block_ids"][: len(alloc["block_ids"][0])] == alloc["block_ids"][0]


def test_scheduler_output(probe):
    _, out, seen = probe
    builds = [b for b in seen["build"] if b["total"]]
    first, second = builds[0], builds[1]
    (new,) = first["new"]
    rid = new["req_id"]
    assert new["prompt_token_ids"] == PROMPT
    assert new["block_ids"] == seen["alloc"][0]["block_ids"]
    assert new["num_computed_tokens"] == 0 and new["max_tokens"] == 3
    assert new["mm_features"] == [] and new["lora_request"] is None
    assert first["num_scheduled_tokens"] == {rid: len(PROMPT)} and first["total"] == len(PROMPT)
    assert first["num_reqs"] == 0 and first["spec_tokens"] == {} == first["encoder_inputs"]
    assert second["new"] == [] and second["cached_req_ids"] == [rid] and second["num_reqs"] == 1
    assert second["resumed_req_ids"] == set() and second["new_token_ids"] == [[]]
    assert second["cached_num_computed"] == [len(PROMPT)]
    assert second["cached_num_output"] == [1]
    assert second["num_scheduled_tokens"] == {rid: 1}
    assert not second["preempted_req_ids"]
    assert any(rid in b["finished_req_ids"] for b in seen["build"])


def test_forward_context_attention_and_output(probe):
    llm, _, seen = probe
    kvc = llm.engine.kv_cache_config
    shape = (2, kvc.num_blocks, 16, kvc.groups[0].num_kv_heads, kvc.groups[0].head_dim)
    loads = [s for s in seen["start_load"] if s["has_attn"]]
    assert loads
    for s in seen["start_load"]:
        assert s["is_context"] and s["is_current"] and s["attn_is_dict"]
        assert s["all_metadata"] and s["slot_mapping_per_layer"]
        assert s["layers"] == {name: shape for name in kvc.layer_names}
        assert s["layer_names_match"] and s["registered_tensors"]
    # vLLM's per-layer dict: every attention layer, on a step with tokens; None without.
    assert all(s["attn_layers"] == sorted(kvc.layer_names) for s in loads)
    assert all(s["attn_layers"] is None for s in seen["start_load"] if not s["has_attn"])
    saves = seen["save"]
    assert {s["layer_name"] for s in saves} == set(kvc.layer_names)
    assert all(s["is_metadata"] and s["from_context"] and s["kv_shape"] == shape for s in saves)
    table = seen["alloc"][0]["block_ids"][0]
    first = [s for s in saves if len(s["slot_mapping"]) == len(PROMPT)][0]
    assert first["slot_mapping"] == [table[t // 16] * 16 + t % 16 for t in range(len(PROMPT))]
    n = len(PROMPT)
    assert first["query_start_loc"] == (torch.int32, [0, n])
    assert first["seq_lens"] == (torch.int32, [n])
    assert first["block_table"] == [table]
    assert (first["num_actual_tokens"], first["max_query_len"], first["max_seq_len"]) == (n, n, n)
    decode = [s for s in saves if s["slot_mapping"] == [table[n // 16] * 16 + n % 16]][0]
    assert decode["query_start_loc"] == (torch.int32, [0, 1])
    assert decode["seq_lens"] == (torch.int32, [n + 1])
    assert (decode["num_actual_tokens"], decode["max_query_len"]) == (1, 1)
    for o in seen["output"]:
        assert o["is_output"]
        # Nothing was transferred; every field is there with its empty value.
        assert o["fields"][:7] == (None, None, None, None, None, set(), set())
        assert isinstance(o["fields"][7], int)


def test_module_level_helpers(caplog):
    assert vllm_imports.install()
    from vllm.distributed import get_tensor_model_parallel_rank as rank0
    from vllm.distributed.kv_events import (
        MEDIUM_CPU,
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventAggregator,
        KVEventBatch,
    )
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        get_tp_group,
        get_world_group,
    )
    from vllm.logger import init_logger
    from vllm.platforms import current_platform
    from vllm.utils import cdiv
    from vllm.utils.hashing import safe_hash, sha256
    from vllm.utils.math_utils import round_down, round_up

    assert (cdiv(33, 16), cdiv(32, 16), round_up(17, 16), round_down(17, 16)) == (3, 2, 32, 16)
    assert safe_hash(b"x", usedforsecurity=False).hexdigest() == safe_hash(b"x").hexdigest()
    assert sha256([1, 2]) == sha256([1, 2]) != sha256([2, 1])
    assert (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()) == (0, 1)
    assert rank0 is get_tensor_model_parallel_rank
    for group in (get_tp_group(), get_pp_group(), get_world_group()):
        assert (group.rank_in_group, group.world_size, group.is_first_rank) == (0, 1, True)
        assert group.broadcast_object("x") == "x"
    assert current_platform.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert current_platform.is_cpu() != current_platform.is_cuda()
    log = init_logger("my_connector")
    assert log.name == "kvferry.connector.my_connector"
    # vLLM's constructors (lora_id, medium, lora_name and ts have no defaults there either).
    stored = BlockStored([7], None, [1, 2], 16, None, MEDIUM_CPU, None)
    agg = KVEventAggregator(2)
    agg.add_events([stored, BlockRemoved([7], MEDIUM_CPU)])
    agg.add_events([stored])
    assert agg.get_common_events() == [stored]
    assert KVEventBatch(ts=1.0, events=[AllBlocksCleared()]).events == [AllBlocksCleared()]
    from kvferry.kv_events import BlockStored as EngineBlockStored

    assert BlockStored is EngineBlockStored  # a connector builds the engine's own events
    with caplog.at_level(logging.INFO, logger="kvferry.connector.my_connector"):
        logging.getLogger("kvferry.connector.my_connector").propagate = True
        log.info("hello")
    assert "hello" in caplog.text
