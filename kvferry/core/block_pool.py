"""The paged KV pool as the scheduler sees it: blocks, ref counts, LRU reuse, prefix cache.

The pool never touches KV tensors; a block is just an id into the workers' caches. A block
is either *in use* (``ref_cnt > 0``: one or more requests hold it) or *free* (``ref_cnt == 0``,
sitting in the free queue). A free block may still carry a hash: its KV is intact and a later
request with the same prefix can revive it, until the pool hands it out again and drops the
hash ("eviction").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvferry.request import BlockHash


class KVCacheBlock:
    """Metadata of one KV block.

    ``block_hash`` is set once the block is full and published to the prefix cache, and
    cleared when the block is evicted. ``prev_free``/``next_free`` link the block into the
    free queue; both are None while the block is not in the queue (or is at an end of it).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked LRU queue of free blocks: evict from the head, free to the tail.

    A linked list (rather than a deque) because a prefix-cache hit must pull a block out of
    the middle of the queue in O(1).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.head: KVCacheBlock | None = None
        self.tail: KVCacheBlock | None = None
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head
        if block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block``; the caller guarantees it is in this queue."""
        if block.prev_free is None:
            assert self.head is block, "block is not in the free queue"
            self.head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            assert self.tail is block, "block is not in the free queue"
            self.tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None and self.head is not block
        block.prev_free = self.tail
        if self.tail is None:
            self.head = block
        else:
            self.tail.next_free = block
        self.tail = block
        self.num_free_blocks += 1

    def blocks(self) -> list[KVCacheBlock]:
        """All free blocks from head (next to be evicted) to tail."""
        out: list[KVCacheBlock] = []
        block = self.head
        while block is not None:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    """``num_blocks`` blocks with ref counting, an LRU free queue and a hash -> block map.

    Contract: every block handed out by :meth:`get_new_blocks` or :meth:`touch` must be given
    back exactly once per reference through :meth:`free_blocks`. With ``enable_caching=False``
    blocks never get hashes and lookups always miss.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # Several blocks can hold the same content (e.g. two requests computed the same prefix
        # before either was published), so each hash maps to a set of blocks keyed by id.
        self.cached_blocks: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    # -- lookup ---------------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Any block holding ``block_hash``'s content, or None."""
        entry = self.cached_blocks.get(block_hash)
        if not entry:
            return None
        return next(iter(entry.values()))

    # -- allocation -----------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the LRU end, evicting their cached content."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, only {self.get_num_free_blocks()} free"
            )
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0
            self._drop_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (prefix-cache hit); revives free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue's tail
        in the given order, so the first ones given are the first to be evicted later."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    # -- prefix cache ---------------------------------------------------------------------

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        ``block_hashes[i]`` is the hash of ``blocks[i]``'s content. Blocks that already carry
        a hash (prefix-cache hits) are left as they are.
        """
        if not self.enable_caching:
            return
        assert num_full_blocks <= min(len(blocks), len(block_hashes))
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                assert block.block_hash == block_hashes[i], "block content changed under its hash"
                continue
            block.block_hash = block_hashes[i]
            self.cached_blocks.setdefault(block.block_hash, {})[block.block_id] = block

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Remove the blocks' hashes so no later lookup hits them (e.g. their KV is known bad).

        Holders keep their references; the blocks just stop being shareable.
        """
        for block_id in block_ids:
            self._drop_hash(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use,
        because running requests rely on their published blocks staying consistent."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _drop_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        entry = self.cached_blocks.get(block.block_hash)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached_blocks[block.block_hash]
        block.block_hash = None

    # -- invariants -----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the pool's own invariants (free queue and hash map); raise AssertionError."""
        queued = self.free_queue.blocks()
        ids = [b.block_id for b in queued]
        assert len(ids) == len(set(ids)), "a block appears twice in the free queue"
        assert len(ids) == self.free_queue.num_free_blocks, "free-queue count is off"
        prev: KVCacheBlock | None = None
        for block in queued:
            assert block.prev_free is prev, f"broken back link at {block}"
            assert self.blocks[block.block_id] is block, f"foreign block {block} in queue"
            prev = block
        assert self.free_queue.tail is prev, "free-queue tail is off"
        zero_ref = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert set(ids) == zero_ref, (
            f"free queue {sorted(ids)} != blocks with ref_cnt 0 {sorted(zero_ref)}"
        )
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref count on {block}"
            if block.ref_cnt > 0:
                assert block.prev_free is None and block.next_free is None
            if block.block_hash is not None:
                entry = self.cached_blocks.get(block.block_hash, {})
                assert entry.get(block.block_id) is block, f"{block} missing from hash map"
        for block_hash, entry in self.cached_blocks.items():
            assert entry, "empty hash-map entry"
            for block_id, block in entry.items():
                assert block.block_id == block_id and block.block_hash == block_hash, (
                    f"hash map entry for {block} is stale"
                )
