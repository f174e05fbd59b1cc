"""KV cache events of a real hybrid engine (Qwen3, sliding-window layers 1 and 3): both KV
cache groups announce a prompt's blocks under their own ``group_idx`` and the prompt's block
hashes; the sliding group's blocks that left the window are withdrawn for that group alone
when they are evicted; and the kv_aware router, fed both engines' streams, sends the prompt
to the instance holding its longest full-attention prefix. Events change no token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvferry import LLM, SamplingParams
from kvferry.core.block_hash import get_request_block_hasher
from kvferry.entrypoints.proxy.load import LoadTracker
from kvferry.entrypoints.proxy.policies import KVAware, Prompt
from kvferry.entrypoints.proxy.prefix_index import PrefixIndex
from kvferry.entrypoints.proxy.routing_metrics import RoutingMetrics
from kvferry.kv_events import (
    KV_CACHE_SPEC_FULL_ATTENTION,
    KV_CACHE_SPEC_SLIDING_WINDOW,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
    external_block_hash,
)
from kvferry.request import Request
from tests.helpers.kv_events import RecordingPublisher
from tests.helpers.ports import _dead_port
from tests.kv_events.source_helpers import HashIndex, gpu_hashes

pytest.importorskip("transformers")

WINDOW = 20
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [(7 * i) % 1900 + 5 for i in range(100)]  # 6 full blocks of 16
A, B = "http://a", "http://b"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen3", layers=4, sliding_window=WINDOW)


def _llm(model_dir: Path, events: bool = True) -> tuple[LLM, RecordingPublisher]:
    kw: dict[str, Any] = {"dtype": "float32", "max_model_len": 256,
                          "max_num_batched_tokens": 32, "num_kv_blocks": 40}  # fmt: skip
    if events:
        endpoint = f"tcp://127.0.0.1:{_dead_port()}"
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "endpoint": endpoint}
    llm = LLM(model=str(model_dir), **kw)
    pub = RecordingPublisher()
    sched = llm.engine.scheduler
    if events:
        # The test reads the batches directly; the engine's own ZMQ publisher goes.
        sched.close_kv_event_publisher()
        sched.kv_event_publisher = pub
    return llm, pub


def _generate(llm: LLM, prompt: list[int]) -> list[int]:
    (out,) = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def _all(pub: RecordingPublisher) -> list[Any]:
    return [e for batch in pub.batches for e in batch.events]


def _stored(events: list[Any], group_idx: int) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.group_idx == group_idx]


def _removed(events: list[Any], group_idx: int) -> set[Any]:
    return {
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.group_idx == group_idx
        for h in e.block_hashes
    }


def test_hybrid_engine_events_per_group_and_routing(model_dir: Path) -> None:
    a, pub_a = _llm(model_dir)
    b, pub_b = _llm(model_dir)
    plain, _ = _llm(model_dir, events=False)
    try:
        bs = a.engine.config.cache_config.block_size
        assert bs == 16
        request = Request("x", PROMPT, PARAMS, block_hasher=get_request_block_hasher(bs))
        hashes = [external_block_hash(h) for h in request.block_hashes]

        # Instance a computes the whole prompt: both groups announce its 6 full blocks.
        tokens = _generate(a, PROMPT)
        assert tokens == _generate(plain, PROMPT)  # events change nothing computed
        events = _all(pub_a)
        for group, kind, window in (
            (0, KV_CACHE_SPEC_FULL_ATTENTION, None),
            (1, KV_CACHE_SPEC_SLIDING_WINDOW, WINDOW),
        ):
            runs = _stored(events, group)
            assert [h for e in runs for h in e.block_hashes] == hashes[:6]
            assert [t for e in runs for t in e.token_ids] == PROMPT[: 6 * bs]
            assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in runs} == {
                (kind, window)
            }
            assert {e.medium for e in runs} == {MEDIUM_GPU}
        assert not [e for e in events if isinstance(e, BlockRemoved)]  # freed is not evicted
        # Other prompts take the free blocks: first the never used ones, then the sliding
        # blocks that left a's window during its prefill (they kept their KV until now).
        sched = a.engine.scheduler
        for i in range(20):
            if hashes[0] in _removed(_all(pub_a), 1):
                break
            _generate(a, [(13 * j + i) % 1900 + 5 for j in range(40)])
        events = _all(pub_a)
        index = HashIndex()  # a subscriber keeping hashes per group holds what the pool holds
        index.apply(events)
        for group in (0, 1):
            assert index.of(MEDIUM_GPU, group) == gpu_hashes(sched, group)
        assert hashes[0] in _removed(events, 1), "the sliding copy of block 0 was evicted"
        assert hashes[0] not in _removed(events, 0)  # its full-attention copy is still there
        assert hashes[0] in gpu_hashes(sched, 0) and hashes[0] not in gpu_hashes(sched, 1)

        # Instance b holds the prompt's first 3 blocks (another tail after them).
        _generate(b, PROMPT[: 3 * bs] + list(range(1500, 1520)))
        prefix = PrefixIndex()
        for url, pub in ((A, pub_a), (B, pub_b)):
            for batch in pub.batches:
                prefix.apply(url, decode_batch(encode_batch(batch)))  # over the wire format
        assert prefix.match(A, PROMPT).blocks > prefix.match(B, PROMPT).blocks == 3
        loads = LoadTracker([A, B], RoutingMetrics(CollectorRegistry()), interval=0)
        policy = KVAware([A, B], loads, prefix, synced=lambda url: True)
        choice = policy.choose(Prompt(list(PROMPT)))
        assert (choice.url, choice.reason) == (A, "kv_hit")
    finally:
        for llm in (a, b, plain):
            llm.shutdown()
