"""PrefixIndex: learning blocks from events and matching prompts against them."""

from __future__ import annotations

import time

from kvferry.core.block_hash import hash_token_blocks
from kvferry.entrypoints.proxy.prefix_index import PrefixIndex
from kvferry.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    KVEventBatch,
    external_block_hash,
)
from tests.proxy.events_pub import stored

BS = 4
TOKENS = list(range(100, 112))  # three blocks of four


def batch(*events) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))


def test_token_walk_finds_the_longest_prefix_in_order() -> None:
    idx = PrefixIndex()
    idx.apply("a", batch(stored([11, 12], TOKENS[:8], BS)))
    m = idx.match("a", TOKENS + [1, 2])
    assert (m.blocks, m.tokens, m.weighted_tokens) == (2, 8, 8.0)
    # A prompt that differs in its first block matches nothing, even if later blocks agree.
    assert idx.match("a", [0] + TOKENS[1:]).blocks == 0
    # Chained: block 2's tokens alone (under another parent) do not match.
    assert idx.match("a", TOKENS[4:8] + TOKENS[:4]).blocks == 0
    assert idx.match("b", TOKENS).blocks == 0
    assert idx.block_size("a") == BS and idx.size("a") == 2


def test_events_continue_a_chain_through_parent_hash() -> None:
    idx = PrefixIndex()
    idx.apply("a", batch(stored([11], TOKENS[:4], BS), stored([12], TOKENS[4:8], BS, parent=11)))
    assert idx.match("a", TOKENS).blocks == 2


def test_tiers_weight_and_removal_per_medium() -> None:
    idx = PrefixIndex()
    idx.apply("a", batch(stored([11, 12, 13], TOKENS, BS, medium=MEDIUM_CPU)))
    idx.apply("a", batch(stored([11], TOKENS[:4], BS, medium=MEDIUM_GPU)))
    idx.apply("a", batch(stored([13], [], 0, medium=MEDIUM_STORAGE)))
    m = idx.match("a", TOKENS)
    assert m.blocks == 3 and m.weighted_tokens == 4 * 1.0 + 4 * 0.5 + 4 * 0.5
    # Evicted from the GPU pool: still in host memory.
    idx.apply("a", batch(BlockRemoved(block_hashes=[11], medium=MEDIUM_GPU)))
    assert idx.match("a", TOKENS).weighted_tokens == 12 * 0.5
    # Gone from host memory too: the walk stops at the first block.
    idx.apply("a", batch(BlockRemoved(block_hashes=[11], medium=MEDIUM_CPU)))
    assert idx.match("a", TOKENS).blocks == 0 and idx.size("a") == 2
    idx.apply("a", batch(AllBlocksCleared()))
    assert idx.size("a") == 0


def test_blocks_with_extra_keys_lora_or_other_groups_never_match_plain_tokens() -> None:
    idx = PrefixIndex()
    idx.apply("a", batch(stored([11], TOKENS[:4], BS, extra_keys=[("cache_salt", "s")])))
    idx.apply("b", batch(stored([21], TOKENS[:4], BS, group_idx=1)))
    lora = stored([31], TOKENS[:4], BS)
    lora.lora_id = 3
    idx.apply("c", batch(lora))
    assert [idx.match(i, TOKENS).blocks for i in "abc"] == [0, 0, 0]


def test_recomputed_hashes_find_blocks_announced_without_tokens() -> None:
    raw = hash_token_blocks(TOKENS, BS)
    ints = [external_block_hash(h) for h in raw]
    idx = PrefixIndex()
    # Placeholder events (a connector tier): hashes only, no token ids, no block size.
    idx.apply("a", batch(stored(ints[:2], [], 0, medium=MEDIUM_CPU)))
    forms = [(external_block_hash(h), h) for h in raw]
    assert idx.match("a", TOKENS).blocks == 0
    m = idx.match("a", TOKENS, block_size=BS, hashes=forms)
    assert m.blocks == 2 and m.weighted_tokens == 8 * 0.5
    # Bytes-form hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) match the same way.
    idx.apply("b", batch(stored([raw[0]], [], 0)))
    assert idx.match("b", TOKENS, block_size=BS, hashes=forms, use_tokens=False).blocks == 1


def test_memory_is_capped_least_recently_used_first() -> None:
    idx = PrefixIndex(max_blocks=4)
    idx.apply("a", batch(stored([1, 2, 3], TOKENS, BS)))
    other = list(range(500, 508))
    idx.apply("a", batch(stored([7, 8], other, BS)))
    assert idx.size("a") == 4
    # Block 1 (oldest) went first: the first prompt no longer matches from its start.
    assert idx.match("a", TOKENS).blocks == 0 and idx.match("a", other).blocks == 2
    idx.drop("a")
    assert idx.size("a") == 0


def test_a_shared_medium_matches_on_every_instance() -> None:
    idx = PrefixIndex(shared_media=[MEDIUM_STORAGE])
    # "a" stored the prompt in the shared store and keeps block 11 in its own pool too.
    idx.apply("a", batch(stored([11, 12, 13], TOKENS, BS, medium=MEDIUM_STORAGE)))
    idx.apply("a", batch(stored([11], TOKENS[:4], BS, medium=MEDIUM_GPU)))
    # "b" announced nothing, yet finds the whole prompt at the store's weight.
    b = idx.match("b", TOKENS)
    assert (b.blocks, b.weighted_tokens) == (3, 12 * 0.25)
    # "a" takes the better tier of each block: its own pool for the first one.
    assert idx.match("a", TOKENS).weighted_tokens == 4 * 1.0 + 8 * 0.25
    # The store outlives an instance's restart; its removals come through any instance.
    idx.drop("a")
    assert idx.match("a", TOKENS).weighted_tokens == 12 * 0.25
    idx.apply("b", batch(BlockRemoved(block_hashes=[12], medium=MEDIUM_STORAGE)))
    assert idx.match("a", TOKENS).blocks == 1 == idx.match("b", TOKENS).blocks
    # Exact strings: "cpu" (a shared Mooncake Store, as vLLM names it) is not the host tier "CPU".
    lower = PrefixIndex(shared_media=["cpu"])
    lower.apply("a", batch(stored([11, 12, 13], TOKENS, BS, medium=MEDIUM_CPU)))
    assert lower.match("b", TOKENS).blocks == 0
    lower.apply("a", batch(stored([11, 12, 13], TOKENS, BS, medium="cpu")))
    assert lower.match("b", TOKENS).weighted_tokens == 12 * 0.5
    # Without a shared medium, storage stays per instance.
    own = PrefixIndex()
    own.apply("a", batch(stored([11, 12, 13], TOKENS, BS, medium=MEDIUM_STORAGE)))
    assert own.match("b", TOKENS).blocks == 0 and own.match("a", TOKENS).blocks == 3


FULL = {"kv_cache_spec_kind": "full_attention"}
SLIDING = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}


def test_sliding_window_blocks_neither_match_nor_withdraw_full_attention_ones() -> None:
    # A hybrid instance announces each block once per group, under the same hash.
    idx = PrefixIndex()
    idx.apply(
        "a",
        batch(
            stored([11, 12, 13], TOKENS, BS, group_idx=0, **FULL),
            stored([11, 12, 13], TOKENS, BS, group_idx=1, **SLIDING),
        ),
    )
    m = idx.match("a", TOKENS)
    assert (m.blocks, m.weighted_tokens) == (3, 12.0) and idx.size("a") == 3
    # The sliding group evicts blocks that left its window: the full-attention ones stay.
    idx.apply("a", batch(BlockRemoved(block_hashes=[11, 12], medium=MEDIUM_GPU, group_idx=1)))
    assert idx.match("a", TOKENS).blocks == 3
    idx.apply("a", batch(BlockRemoved(block_hashes=[11], medium=MEDIUM_GPU, group_idx=0)))
    assert idx.match("a", TOKENS).blocks == 0
    # Sliding blocks alone (their full-attention copies gone) are no reusable prefix.
    idx.apply("b", batch(stored([11, 12, 13], TOKENS, BS, group_idx=1, **SLIDING)))
    assert idx.match("b", TOKENS).blocks == 0 and idx.size("b") == 0


def test_groups_are_told_apart_by_their_kind_not_their_index() -> None:
    # vLLM numbers groups by layout: here group 0 slides and group 1 is full attention.
    idx = PrefixIndex()
    idx.apply(
        "a",
        batch(
            stored([11, 12], TOKENS[:8], BS, group_idx=0, **SLIDING),
            stored([11, 12], TOKENS[:8], BS, group_idx=1, **FULL),
        ),
    )
    assert idx.match("a", TOKENS).blocks == 2
    # Removals name no kind: the groups' kinds learned from the stores decide.
    idx.apply("a", batch(BlockRemoved(block_hashes=[11], medium=MEDIUM_GPU, group_idx=0)))
    assert idx.match("a", TOKENS).blocks == 2
    idx.apply("a", batch(BlockRemoved(block_hashes=[11], medium=MEDIUM_GPU, group_idx=1)))
    assert idx.match("a", TOKENS).blocks == 0


def test_a_block_stays_while_another_full_attention_group_holds_it() -> None:
    idx = PrefixIndex()
    idx.apply(
        "a",
        batch(
            stored([11], TOKENS[:4], BS, group_idx=0, **FULL),
            stored([11], TOKENS[:4], BS, group_idx=2, **FULL),
            stored([11], TOKENS[:4], BS, group_idx=2, medium=MEDIUM_CPU, **FULL),
        ),
    )
    idx.apply("a", batch(BlockRemoved(block_hashes=[11], medium=MEDIUM_GPU, group_idx=0)))
    assert idx.match("a", TOKENS).weighted_tokens == 4.0  # group 2 still has it in the pool
    idx.apply("a", batch(BlockRemoved(block_hashes=[11], medium=MEDIUM_GPU, group_idx=2)))
    assert idx.match("a", TOKENS).weighted_tokens == 4 * 0.5
    idx.apply("a", batch(BlockRemoved(block_hashes=[11], medium=MEDIUM_CPU, group_idx=2)))
    assert idx.size("a") == 0
