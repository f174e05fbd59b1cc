"""The block tables of one KV cache group, by attention type (vLLM's names):
:class:`FullAttentionManager` and :class:`SlidingWindowManager`.

Every group's table covers the request's tokens left to right, ``block_size`` tokens per
block, so all groups of a request have tables of the same length. A sliding-window group
only needs the blocks holding the last ``sliding_window - 1`` tokens before the next token to
compute: the blocks before them go back to the pool (cached content intact, so another
request can still hit them) and the pool's null block takes their place in the table.

All groups draw from one shared :class:`~kvferry.core.block_pool.BlockPool`; the
:class:`~kvferry.core.kv_cache_manager.KVCacheManager` coordinates them (hit lengths every
group can serve, allocation counted over all groups).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvferry.core.block_pool import BlockPool, KVCacheBlock
from kvferry.kv_cache_config import KVCacheGroupSpec
from kvferry.request import BlockHash, Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Block tables and prefix-cache publishing of one group; see the module doc.

    Contract: the coordinating manager calls :meth:`remove_skipped_blocks` before growing a
    request's table, :meth:`allocate` only after checking the pool has room for
    :meth:`num_blocks_to_allocate` blocks, and :meth:`free` once per request.
    """

    def __init__(self, spec: KVCacheGroupSpec, group_id: int, block_pool: BlockPool) -> None:
        self.spec = spec
        self.group_id = group_id
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are published (or are null blocks); blocks
        # past this index may still be filling up.
        self.num_cached_blocks: dict[str, int] = {}

    # -- hits -----------------------------------------------------------------------------

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_num_blocks: int
    ) -> list[KVCacheBlock]:
        """The hit of at most ``max_num_blocks`` blocks this group can serve, as a table of
        that length (null blocks where the group needs none). Takes no references."""
        raise NotImplementedError

    def _cached(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.block_pool.get_cached_block(block_hash, self.group_id)

    # -- allocation -----------------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks no token from ``num_computed_tokens`` on can read."""

    def skipped_blocks(self, num_table_blocks: int, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Null blocks to append to a table of ``num_table_blocks`` so that it reaches the
        first block the token at ``num_computed_tokens`` reads (for KV a connector loads
        past a table's end: a sliding-window group needs only its window's part)."""
        return []

    def num_blocks_to_allocate(self, request_id: str, num_slots: int, num_hit_blocks: int) -> int:
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(0, _cdiv(num_slots, self.block_size) - held - num_hit_blocks)

    def num_revived(self, hit_blocks: Sequence[KVCacheBlock]) -> int:
        """Hit blocks that sit in the free queue: touching them takes them out of it."""
        null = self.block_pool.null_block
        return sum(1 for b in hit_blocks if b.ref_cnt == 0 and b is not null)

    def allocate(
        self,
        request_id: str,
        hit_blocks: Sequence[KVCacheBlock],
        num_new_blocks: int,
        touched: bool = False,
    ) -> list[KVCacheBlock]:
        """Adopt ``hit_blocks`` (touched here unless ``touched``) and append
        ``num_new_blocks`` fresh blocks; returns the fresh ones."""
        if not touched:
            self.block_pool.touch(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        table = self.req_to_blocks.setdefault(request_id, [])
        table.extend(hit_blocks)
        table.extend(new_blocks)
        # Hit blocks are published already; never re-publish them.
        self.num_cached_blocks[request_id] = max(
            self.num_cached_blocks.get(request_id, 0), len(hit_blocks)
        )
        return new_blocks

    def holds_window(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether the table still holds every block the token at ``num_computed_tokens``
        and later ones read (always, without a window)."""
        return True

    def num_blocks_to_cover(self, request: Request) -> int:
        """Blocks ``request`` still needs, beyond those it holds, to compute all its known
        tokens (in one step, from its current computed count)."""
        held = len(self.req_to_blocks.get(request.request_id, ()))
        return max(0, _cdiv(request.num_tokens, self.block_size) - held)

    # -- prefix cache ---------------------------------------------------------------------

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks covering its first ``num_computed_tokens``."""
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
            group_id=self.group_id,
        )
        self.num_cached_blocks[req_id] = num_full

    def uncache_blocks(self, request_id: str, num_valid_tokens: int) -> None:
        """Unpublish the request's blocks from the one holding token ``num_valid_tokens``."""
        first = num_valid_tokens // self.block_size
        table = self.req_to_blocks.get(request_id, [])
        self.block_pool.evict_blocks(b.block_id for b in table[first:] if b.block_hash is not None)
        if request_id in self.num_cached_blocks:
            self.num_cached_blocks[request_id] = min(self.num_cached_blocks[request_id], first)

    # -- release and queries --------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Release every block the request holds, last first: the tail of a sequence is the
        least likely to be shared, so it should be the first evicted."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds in this group, null blocks not counted."""
        null = self.block_pool.null_block
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b is not null)

    def count_holders(self, holders: list[int]) -> None:
        """Add this group's references per block id to ``holders`` (integrity checks) and
        assert the group's own invariants."""
        null = self.block_pool.null_block
        for req_id, table in self.req_to_blocks.items():
            ids = [b.block_id for b in table if b is not null]
            assert len(ids) == len(set(ids)), f"request {req_id} holds a block twice"
            for block in table:
                assert self.block_pool.blocks[block.block_id] is block, "foreign block"
                if block is not null:
                    holders[block.block_id] += 1
            num_cached = self.num_cached_blocks.get(req_id, 0)
            assert num_cached <= len(table), f"request {req_id} cached past its table"
        assert set(self.num_cached_blocks) <= set(self.req_to_blocks), "stale cached marks"


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every token reads every earlier token: a hit is a run of leading cached blocks."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_num_blocks: int
    ) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_blocks]:
            block = self._cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A token at position ``p`` reads positions ``p - window + 1 .. p`` only (its own K/V
    are written by its own step)."""

    def __init__(self, spec: KVCacheGroupSpec, group_id: int, block_pool: BlockPool) -> None:
        super().__init__(spec, group_id, block_pool)
        assert spec.sliding_window is not None, "a sliding-window group needs its window"
        assert block_pool.null_block is not None, "a sliding-window group needs a null block"
        self.sliding_window = spec.sliding_window
        self.null_block = block_pool.null_block

    def _first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block the token at position ``num_computed_tokens`` reads."""
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_num_blocks: int
    ) -> list[KVCacheBlock]:
        """The longest ``n <= max_num_blocks`` such that the blocks the token at ``n *
        block_size`` reads are all cached; the blocks before them become null blocks."""
        found = [self._cached(h) for h in block_hashes[:max_num_blocks]]
        # run[i]: how many consecutive cached blocks end at block i.
        run, length = [], 0
        for block in found:
            length = length + 1 if block is not None else 0
            run.append(length)
        for n in range(len(found), 0, -1):
            first = self._first_needed_block(n * self.block_size)
            if run[n - 1] >= n - first:
                hit = [self.null_block] * first
                hit.extend(b for b in found[first:n] if b is not None)
                return hit
        return []

    def skipped_blocks(self, num_table_blocks: int, num_computed_tokens: int) -> list[KVCacheBlock]:
        first = self._first_needed_block(num_computed_tokens)
        return [self.null_block] * max(0, first - num_table_blocks)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        table = self.req_to_blocks.get(request_id)
        if not table:
            return
        first = min(self._first_needed_block(num_computed_tokens), len(table))
        skipped = [b for b in table[:first] if b is not self.null_block]
        if not skipped:
            return
        for i in range(first):
            table[i] = self.null_block
        # Earliest first: the blocks furthest from any future window are evicted first.
        self.block_pool.free_blocks(skipped)

    def holds_window(self, request_id: str, num_computed_tokens: int) -> bool:
        table = self.req_to_blocks.get(request_id, [])
        first = self._first_needed_block(num_computed_tokens)
        return all(b is not self.null_block for b in table[first:])

    def num_blocks_to_cover(self, request: Request) -> int:
        table = self.req_to_blocks.get(request.request_id, [])
        first = self._first_needed_block(request.num_computed_tokens)
        needed = max(0, _cdiv(request.num_tokens, self.block_size) - first)
        held = sum(1 for b in table[first:] if b is not self.null_block)
        return max(0, needed - held)


def make_manager(
    spec: KVCacheGroupSpec, group_id: int, block_pool: BlockPool
) -> SingleTypeKVCacheManager:
    """The manager for ``spec``'s attention type."""
    if spec.sliding_window is not None:
        return SlidingWindowManager(spec, group_id, block_pool)
    return FullAttentionManager(spec, group_id, block_pool)
