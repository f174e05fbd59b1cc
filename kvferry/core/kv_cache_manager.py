"""KVCacheManager: which blocks each request holds, prefix-cache lookups, slot allocation.

A request's block table covers its tokens left to right, ``block_size`` tokens per block::

    | computed | new local hit | external hit | new tokens | lookahead |
      held       adopted         allocated      allocated    allocated

*computed* blocks the request already holds; *new local hit* blocks come from this pool's
prefix cache (shared, ref-counted); *external hit* blocks are allocated here and filled by a KV
connector; *new* and *lookahead* blocks are allocated for the tokens the model computes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvferry.config import ConfigError
from kvferry.core.block_pool import BlockPool, KVCacheBlock
from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_events.events import KVCacheEvent
from kvferry.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks per KV cache group (kvferry has exactly one group today).

    Returned by :meth:`KVCacheManager.allocate_slots` (the newly allocated blocks) and by
    :meth:`KVCacheManager.get_blocks` (a request's whole table). Treat it as read-only.
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]

    @staticmethod
    def empty(num_groups: int = 1) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in range(num_groups)))

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple([*a, *b] for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group, in table order."""
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of blocks not published to the prefix cache (single-group layouts only)."""
        assert len(self.blocks) == 1, "only defined for one KV cache group"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    @property
    def num_blocks(self) -> int:
        return sum(len(group) for group in self.blocks)


@dataclass
class PrefixCacheStats:
    """Local prefix-cache lookups since the last reset, in tokens: one per admitted request.

    Resumed (preempted) requests are counted apart so they don't inflate the hit rate: they
    mostly hit their own blocks.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.requests = self.queries = self.hits = self.preempted_requests = 0


class KVCacheManager:
    """Owns the block pool and every request's block table.

    Contract for callers (the scheduler): for a request that holds no blocks call
    :meth:`get_computed_blocks` and pass its result to :meth:`allocate_slots` in the same step
    (nothing else may allocate in between, or the hit blocks might be evicted); call
    :meth:`free` exactly once when the request is done or preempted. ``request.num_computed_tokens``
    must still hold the value from *before* the tokens being allocated for.

    With ``enable_kv_cache_events`` the pool records what its prefix cache gains and loses
    (see :class:`BlockPool`); the scheduler collects them once per step with
    :meth:`take_events`.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        log_stats: bool = True,
        enable_kv_cache_events: bool = False,
    ) -> None:
        if len(kv_cache_config.groups) != 1:
            raise ConfigError(
                f"kvferry supports exactly one KV cache group, got {len(kv_cache_config.groups)}"
            )
        self.block_size = kv_cache_config.block_size
        self.num_groups = 1
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            block_size=self.block_size,
        )
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are published in the prefix cache; blocks
        # past this index may still be filling up.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # -- queries --------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks((list(self.req_to_blocks.get(request_id, ())),))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_num_held_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def eviction_candidates(self, max_blocks: int) -> list[KVCacheBlock]:
        """The next ``max_blocks`` free blocks the pool hands out, oldest first (a cached one
        loses its hash then, so these are the next prefix-cache evictions). Read only: a
        snapshot of the free queue's head; treat the blocks as read-only too."""
        out: list[KVCacheBlock] = []
        block = self.block_pool.free_queue.head
        while block is not None and len(out) < max_blocks:
            out.append(block)
            block = block.next_free
        return out

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest run of leading blocks already in the prefix cache, and its token count.

        A full-prompt hit is cut back so at least the last token is recomputed: the model must
        run on it to produce the logits for the next token. Hits are whole blocks, so the cut
        can drop a whole block. Takes no references (and records no stats);
        :meth:`allocate_slots` does both once the request is actually admitted.
        """
        if not self.enable_caching:
            return KVCacheBlocks.empty(), 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return KVCacheBlocks((hits,)), len(hits) * self.block_size

    # -- allocation -----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_reserved_blocks: int = 0,
    ) -> KVCacheBlocks | None:
        """Extend ``request``'s table to cover its computed, hit, external, new and lookahead
        tokens; return the newly allocated blocks, or None (and change nothing) if that would
        leave fewer than ``num_reserved_blocks`` free blocks.

        ``new_computed_blocks``/``num_new_computed_tokens`` come from :meth:`get_computed_blocks`.
        Full blocks up to ``min(computed + new, num_tokens)`` are published to the prefix cache
        right away (their KV is written by this step's forward, before anyone can read them in
        a later step), unless ``delay_cache_blocks``: then a connector is still loading them
        and the caller publishes them with :meth:`cache_blocks` once the load succeeded.
        """
        if num_new_tokens < 0 or num_external_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("token counts passed to allocate_slots must be >= 0")
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("allocate_slots needs new tokens or external computed tokens")
        hit_blocks = list(new_computed_blocks.blocks[0]) if new_computed_blocks else []
        if len(hit_blocks) * self.block_size != num_new_computed_tokens:
            raise ValueError("num_new_computed_tokens must match new_computed_blocks")
        req_id = request.request_id
        held = self.req_to_blocks.get(req_id, [])
        if hit_blocks and held:
            raise ValueError("prefix-cache hits can only be adopted by a request without blocks")

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_covered = num_computed + num_external_computed_tokens + num_new_tokens
        num_slots = min(num_covered + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = max(0, _cdiv(num_slots, self.block_size) - len(held) - len(hit_blocks))
        # Free hit blocks are counted in the free queue but are about to be revived, not
        # handed out, so they don't count as room for new blocks.
        num_revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        available = self.block_pool.get_num_free_blocks() - num_revived - num_reserved_blocks
        if num_new_blocks > available:
            return None

        # Touch before allocating so the hit blocks cannot be evicted by get_new_blocks.
        self.block_pool.touch(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        table = self.req_to_blocks.setdefault(req_id, [])
        table.extend(hit_blocks)
        table.extend(new_blocks)
        # Hit blocks are published already; never re-publish them.
        self.num_cached_blocks[req_id] = max(self.num_cached_blocks.get(req_id, 0), len(hit_blocks))

        if self.enable_caching and not held:
            self._record_lookup(request, num_new_computed_tokens)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(num_covered, request.num_tokens))
        return KVCacheBlocks((new_blocks,))

    def _record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        # Recorded on the request's first successful allocation rather than in
        # get_computed_blocks, so a request retried over several steps counts once.
        if not self.log_stats:
            return
        stats = self.prefix_cache_stats
        if request.num_preemptions > 0:
            stats.preempted_requests += 1
        else:
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks covering its first ``num_computed_tokens`` tokens."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        table = self.req_to_blocks.get(req_id, [])
        num_full = min(
            num_computed_tokens // self.block_size, len(table), len(request.block_hashes)
        )
        num_cached = self.num_cached_blocks.get(req_id, 0)
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            table,
            request.block_hashes,
            num_cached,
            num_full,
            request.all_token_ids,
            request.cache_salt,
        )
        self.num_cached_blocks[req_id] = num_full

    def uncache_blocks(self, request: Request, num_valid_tokens: int) -> None:
        """Unpublish the request's blocks from the one holding token ``num_valid_tokens`` on.

        For KV that turned out bad (a failed load, or tokens computed on top of one): nobody may
        hit those blocks any more, and the request publishes them again once it has recomputed
        them. Holders keep their references.
        """
        req_id = request.request_id
        first = num_valid_tokens // self.block_size
        table = self.req_to_blocks.get(req_id, [])
        self.block_pool.evict_blocks(b.block_id for b in table[first:] if b.block_hash is not None)
        if req_id in self.num_cached_blocks:
            self.num_cached_blocks[req_id] = min(self.num_cached_blocks[req_id], first)

    def free(self, request: Request) -> None:
        """Release every block the request holds (no-op if it holds none).

        Blocks are released last-first: the tail of a sequence is the least likely to be
        shared, so it should be the first evicted.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    # -- prefix-cache maintenance ---------------------------------------------------------

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Stop the given blocks from producing prefix-cache hits (their KV is untrusted)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (nothing changed) while any block is in use."""
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.prefix_cache_stats.reset()
        return ok

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix cache's KV cache events since the last call ([] with events off)."""
        return self.block_pool.take_events()

    def check_integrity(self) -> None:
        """Assert pool and table invariants; raise AssertionError on the first violation.

        Every block's ref count equals the number of requests holding it, no request holds a
        block twice, free blocks are exactly those with no holder, and the hash map agrees
        with the blocks' hashes.
        """
        self.block_pool.check_integrity()
        holders = [0] * self.num_blocks
        for req_id, table in self.req_to_blocks.items():
            ids = [b.block_id for b in table]
            assert len(ids) == len(set(ids)), f"request {req_id} holds a block twice"
            for block in table:
                assert self.block_pool.blocks[block.block_id] is block, "foreign block"
                holders[block.block_id] += 1
            num_cached = self.num_cached_blocks.get(req_id, 0)
            assert num_cached <= len(table), f"request {req_id} cached past its table"
        assert set(self.num_cached_blocks) <= set(self.req_to_blocks), "stale cached marks"
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block} has ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders"
            )
