"""KVCacheManager: which blocks each request holds, prefix-cache lookups, slot allocation.

A request's block table covers its tokens left to right, ``block_size`` tokens per block::

    | computed | new local hit | external hit | new tokens | lookahead |
      held       adopted         allocated      allocated    allocated

*computed* blocks the request already holds; *new local hit* blocks come from this pool's
prefix cache (shared, ref-counted); *external hit* blocks are allocated here and filled by a KV
connector; *new* and *lookahead* blocks are allocated for the tokens the model computes.

A hybrid model has one KV cache group per attention type (full, sliding window), and so one
table per group per request, all of the same length; each group's table is kept by its
:mod:`~kvferry.core.single_type_kv_cache_manager` and this class coordinates them over one
shared pool: a prefix hit is the longest every group can serve, and an allocation succeeds
only if the pool has room for what all groups need.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvferry.config import ConfigError
from kvferry.core.block_pool import BlockPool, KVCacheBlock
from kvferry.core.single_type_kv_cache_manager import make_manager
from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_events.events import KVCacheEvent
from kvferry.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks per KV cache group, in group order (``KVCacheConfig.groups``).

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

    With ``enable_kv_cache_events`` the pool records what every group's prefix cache gains
    and loses (see :class:`BlockPool`); the scheduler collects them once per step with
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
        groups = kv_cache_config.groups
        if not groups or len({g.block_size for g in groups}) != 1:
            raise ConfigError("KV cache groups must exist and share one block_size")
        self.block_size = kv_cache_config.block_size
        self.num_groups = len(groups)
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            block_size=self.block_size,
            num_groups=self.num_groups,
            reserve_null_block=kv_cache_config.null_block_id is not None,
            # Each group's events name its attention type, as vLLM's annotate them.
            group_event_specs=[(g.kv_cache_spec_kind, g.sliding_window) for g in groups],
        )
        self.managers = [make_manager(g, i, self.block_pool) for i, g in enumerate(groups)]
        # Group 0's tables and published counts (every group holds the same requests).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = self.managers[0].req_to_blocks
        self.num_cached_blocks: dict[str, int] = self.managers[0].num_cached_blocks
        self.prefix_cache_stats = PrefixCacheStats()

    # -- queries --------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out: all but the null block of a hybrid pool."""
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple(list(m.req_to_blocks.get(request_id, ())) for m in self.managers)
        )

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds over all groups (null blocks not counted)."""
        return sum(m.get_num_held_blocks(request_id) for m in self.managers)

    def get_num_blocks_to_cover(self, request: Request) -> int:
        """Blocks ``request`` still needs, over all groups and beyond those it holds, to
        compute every token it knows of in one step."""
        return sum(m.num_blocks_to_cover(request) for m in self.managers)

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
            return KVCacheBlocks.empty(self.num_groups), 0
        num_hit = (request.num_tokens - 1) // self.block_size
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        # A sliding-window hit cut shorter need not be a hit (the blocks its window needs
        # may be gone), so every group is asked again whenever one shortens the length; in
        # the last round every group serves exactly ``num_hit`` blocks.
        changed = True
        while changed:
            changed = False
            for i, manager in enumerate(self.managers):
                hits[i] = manager.find_longest_cache_hit(request.block_hashes, num_hit)
                if len(hits[i]) < num_hit:
                    num_hit, changed = len(hits[i]), True
        return KVCacheBlocks(tuple(hits)), num_hit * self.block_size

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
        tokens; return the newly allocated blocks (per group), or None (and allocate nothing)
        if that would leave fewer than ``num_reserved_blocks`` free blocks. Sliding-window
        groups first give back the blocks that left the window of every token from
        ``request.num_computed_tokens`` on (null blocks take their place in the table).

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
        groups = self.managers
        hits = [list(b) for b in new_computed_blocks.blocks] if new_computed_blocks else []
        hits = hits or [[] for _ in groups]
        if len(hits) != len(groups) or any(len(h) != len(hits[0]) for h in hits):
            raise ValueError("new_computed_blocks must hold one equally long hit per group")
        if len(hits[0]) * self.block_size != num_new_computed_tokens:
            raise ValueError("num_new_computed_tokens must match new_computed_blocks")
        req_id = request.request_id
        held = bool(self.req_to_blocks.get(req_id))
        if hits[0] and held:
            raise ValueError("prefix-cache hits can only be adopted by a request without blocks")

        # Blocks that left a sliding window go back first (also when the allocation then
        # fails: no token still to compute reads them).
        for manager in groups:
            manager.remove_skipped_blocks(req_id, request.num_computed_tokens)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_covered = num_computed + num_external_computed_tokens + num_new_tokens
        # External tokens a sliding-window group's window does not reach get null blocks:
        # nothing is loaded into them, nothing published from them. A load that reaches the
        # request's last token is rewound by one once done (that token's forward yields the
        # logits), so the window is the one of the last token, not of the token after it.
        reach = num_computed + num_external_computed_tokens
        if num_external_computed_tokens and reach >= request.num_tokens:
            reach = max(num_computed, request.num_tokens - 1)
        for i, manager in enumerate(groups):
            num_table = len(manager.req_to_blocks.get(req_id, ())) + len(hits[i])
            hits[i] += manager.skipped_blocks(num_table, reach)
        num_slots = min(num_covered + num_lookahead_tokens, self.max_model_len)
        num_new = [
            m.num_blocks_to_allocate(req_id, num_slots, len(h))
            for m, h in zip(groups, hits, strict=True)
        ]
        # Free hit blocks are counted in the free queue but are about to be revived, not
        # handed out, so they don't count as room for new blocks.
        num_revived = sum(m.num_revived(h) for m, h in zip(groups, hits, strict=True))
        available = self.block_pool.get_num_free_blocks() - num_revived - num_reserved_blocks
        if sum(num_new) > available:
            return None

        # Every group's hits are touched before any allocation, so no hit block can be
        # evicted by get_new_blocks.
        for hit in hits:
            self.block_pool.touch(hit)
        new_blocks = tuple(
            m.allocate(req_id, h, n, touched=True)
            for m, h, n in zip(groups, hits, num_new, strict=True)
        )

        if self.enable_caching and not held:
            self._record_lookup(request, num_new_computed_tokens)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(num_covered, request.num_tokens))
        return KVCacheBlocks(new_blocks)

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
        for manager in self.managers:
            manager.cache_blocks(request, num_computed_tokens)

    def uncache_blocks(self, request: Request, num_valid_tokens: int) -> None:
        """Unpublish the request's blocks from the one holding token ``num_valid_tokens`` on.

        For KV that turned out bad (a failed load, or tokens computed on top of one): nobody may
        hit those blocks any more, and the request publishes them again once it has recomputed
        them. Holders keep their references.
        """
        for manager in self.managers:
            manager.uncache_blocks(request.request_id, num_valid_tokens)

    def can_recompute_from(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether ``request`` may rewind to ``num_computed_tokens`` and recompute from there
        with the tables it holds: not when a sliding-window group already gave back blocks
        that window reads (they would have to be refilled under ids the workers do not
        know)."""
        return all(m.holds_window(request.request_id, num_computed_tokens) for m in self.managers)

    def free(self, request: Request) -> None:
        """Release every block the request holds (no-op if it holds none).

        Blocks are released last-first: the tail of a sequence is the least likely to be
        shared, so it should be the first evicted.
        """
        for manager in self.managers:
            manager.free(request.request_id)

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
        for manager in self.managers:
            manager.count_holders(holders)
            assert set(manager.req_to_blocks) == set(self.req_to_blocks), "groups disagree"
            for req_id, table in manager.req_to_blocks.items():
                assert len(table) == len(self.req_to_blocks[req_id]), f"{req_id}: table lengths"
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block} has ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders"
            )
