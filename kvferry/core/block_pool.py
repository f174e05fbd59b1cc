"""The paged KV pool as the scheduler sees it: blocks, ref counts, LRU reuse, prefix cache.

The pool never touches KV tensors; a block is just an id into the workers' caches. A block
is either *in use* (``ref_cnt > 0``: one or more requests hold it) or *free* (``ref_cnt == 0``,
sitting in the free queue). A free block may still carry a hash: its KV is intact and a later
request with the same prefix can revive it, until the pool hands it out again and drops the
hash ("eviction").

With KV cache events on, the pool also reports what its prefix cache gains and loses, for
routers (:mod:`kvferry.kv_events`, medium ``GPU`` as vLLM names the engine pool): a hash is
announced when its first copy in a group is published and withdrawn when the group's last
copy loses it, so a subscriber that keeps a set of hashes per group is always exact.

Hybrid models (several KV cache groups, e.g. full and sliding-window attention) share one
pool: a block id belongs to one group at a time. The prefix cache is kept per group (the same
tokens have different KV in each group's layers, under the same hash), and every group's
gains and losses are events carrying its ``group_idx``, as vLLM publishes them. A pool made
with ``reserve_null_block`` sets block 0 aside as the *null block*: it stands in a
sliding-window table for blocks that left the window, is never handed out, freed, cached or
written, and no attention path reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvferry.kv_events.block_runs import blocks_removed, blocks_stored
from kvferry.kv_events.events import MEDIUM_GPU, AllBlocksCleared, KVCacheEvent
from kvferry.request import BlockHash

# Hashes whose last copy a group lost in one call, per group (insertion-ordered).
_Removed = dict[int, list[BlockHash]]


class KVCacheBlock:
    """Metadata of one KV block.

    ``block_hash`` is set once the block is full and published to the prefix cache, and
    cleared when the block is evicted. ``prev_free``/``next_free`` link the block into the
    free queue; both are None while the block is not in the queue (or is at an end of it).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # The KV cache group whose prefix cache holds the block (while block_hash is set).
        self.group_id = 0
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

    Events (``enable_kv_cache_events``; ``block_size`` is then required): ``BlockStored``
    per run of consecutive blocks of one :meth:`cache_full_blocks` call whose hashes were
    not cached yet in that group, ``BlockRemoved`` per group and call that drops the group's
    last copy of some hashes, ``AllBlocksCleared`` per successful
    :meth:`reset_prefix_cache`; :meth:`take_events` hands them over in order. Block events
    carry their group's ``group_idx`` and, from ``group_event_specs`` (per group: vLLM's
    ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``), its attention type. Off,
    the pool records nothing.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        block_size: int = 0,
        num_groups: int = 1,
        reserve_null_block: bool = False,
        group_event_specs: Sequence[tuple[str | None, int | None]] = (),
    ) -> None:
        if num_blocks <= int(reserve_null_block):
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if enable_kv_cache_events and block_size <= 0:
            raise ValueError("KV cache events need the pool's block_size")
        if group_event_specs and len(group_event_specs) != num_groups:
            raise ValueError("group_event_specs needs one (kind, window) per group")
        self.group_event_specs = list(group_event_specs) or [(None, None)] * num_groups
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events and enable_caching
        self.block_size = block_size
        self.kv_event_queue: list[KVCacheEvent] = []
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = self.blocks[0] if reserve_null_block else None
        self.free_queue = FreeBlockQueue(self.blocks[int(reserve_null_block) :])
        # Blocks that can ever be handed out (all but the null block).
        self.num_usable_blocks = num_blocks - int(reserve_null_block)
        # Per group: several blocks can hold the same content (e.g. two requests computed the
        # same prefix before either was published), so each hash maps to blocks keyed by id.
        self.cached_by_group: list[dict[BlockHash, dict[int, KVCacheBlock]]] = [
            {} for _ in range(num_groups)
        ]
        self.cached_blocks = self.cached_by_group[0]

    # -- lookup ---------------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVCacheBlock | None:
        """Any block of group ``group_id`` holding ``block_hash``'s content, or None."""
        entry = self.cached_by_group[group_id].get(block_hash)
        if not entry:
            return None
        return next(iter(entry.values()))

    # -- allocation -----------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the LRU end, evicting their cached content."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, only {self.get_num_free_blocks()} free"
            )
        out = []
        removed = self._removed_list()
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0
            self._drop_hash(block, removed)
            block.ref_cnt = 1
            out.append(block)
        self._emit_removed(removed)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (prefix-cache hit); revives free ones. The
        null block is skipped."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue's tail
        in the given order, so the first ones given are the first to be evicted later. The
        null block is skipped."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
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
        token_ids: Sequence[int] = (),
        cache_salt: str | None = None,
        group_id: int = 0,
    ) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes, in group
        ``group_id``'s prefix cache.

        ``block_hashes[i]`` is the hash of ``blocks[i]``'s content. Blocks that already carry
        a hash (prefix-cache hits) are left as they are, null blocks too. ``token_ids`` (the
        sequence's tokens from its start) and ``cache_salt`` are only read for events.
        """
        if not self.enable_caching:
            return
        assert num_full_blocks <= min(len(blocks), len(block_hashes))
        events = self.enable_kv_cache_events
        cached = self.cached_by_group[group_id]
        run_start: int | None = None  # first block of the run of new hashes being built
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block is self.null_block:
                # Not held by this group (it left a sliding window): a run of announced
                # blocks never spans it, so each event's tokens are its blocks' own.
                new_hash = False
            elif block.block_hash is not None:
                assert block.block_hash == block_hashes[i], "block content changed under its hash"
                new_hash = False
            else:
                block.block_hash = block_hashes[i]
                block.group_id = group_id
                entry = cached.setdefault(block.block_hash, {})
                # Another block may already hold this content (two requests computed the
                # same prefix); subscribers heard of the hash then.
                new_hash = not entry
                entry[block.block_id] = block
            if not events:
                continue
            if new_hash and run_start is None:
                run_start = i
            elif not new_hash and run_start is not None:
                self._emit_stored(block_hashes, token_ids, run_start, i, cache_salt, group_id)
                run_start = None
        if run_start is not None:
            self._emit_stored(
                block_hashes, token_ids, run_start, num_full_blocks, cache_salt, group_id
            )

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Remove the blocks' hashes so no later lookup hits them (e.g. their KV is known bad).

        Holders keep their references; the blocks just stop being shareable.
        """
        removed = self._removed_list()
        for block_id in block_ids:
            if self.blocks[block_id] is not self.null_block:
                self._drop_hash(self.blocks[block_id], removed)
        self._emit_removed(removed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use,
        because running requests rely on their published blocks staying consistent."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        for cached in self.cached_by_group:
            cached.clear()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def _drop_hash(self, block: KVCacheBlock, removed: _Removed | None = None) -> None:
        """Unpublish ``block``; its hash goes to ``removed`` (under its group) if no other
        block of its group holds it."""
        if block.block_hash is None:
            return
        cached = self.cached_by_group[block.group_id]
        entry = cached.get(block.block_hash)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del cached[block.block_hash]
                if removed is not None:
                    removed.setdefault(block.group_id, []).append(block.block_hash)
        block.block_hash = None

    # -- events ---------------------------------------------------------------------------

    def _emit_stored(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        start: int,
        end: int,
        cache_salt: str | None,
        group_id: int,
    ) -> None:
        assert len(token_ids) >= end * self.block_size, "cache_full_blocks needs the tokens"
        kind, window = self.group_event_specs[group_id]
        self.kv_event_queue.append(
            blocks_stored(
                block_hashes,
                token_ids,
                start,
                end,
                self.block_size,
                MEDIUM_GPU,
                cache_salt,
                group_idx=group_id,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
            )
        )

    def _removed_list(self) -> _Removed | None:
        return {} if self.enable_kv_cache_events else None

    def _emit_removed(self, removed: _Removed | None) -> None:
        # One event per group, groups in the order their first removal happened.
        for group_id, hashes in (removed or {}).items():
            self.kv_event_queue.append(blocks_removed(hashes, MEDIUM_GPU, group_id))

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first (always [] with events off)."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

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
        null = self.null_block
        if null is not None:
            assert null.ref_cnt == 0 and null.block_hash is None, "the null block is in use"
            assert (
                null.prev_free is None
                and null.next_free is None
                and self.free_queue.head is not null
            )
        zero_ref = {b.block_id for b in self.blocks if b.ref_cnt == 0 and b is not null}
        assert set(ids) == zero_ref, (
            f"free queue {sorted(ids)} != blocks with ref_cnt 0 {sorted(zero_ref)}"
        )
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref count on {block}"
            if block.ref_cnt > 0:
                assert block.prev_free is None and block.next_free is None
            if block.block_hash is not None:
                entry = self.cached_by_group[block.group_id].get(block.block_hash, {})
                assert entry.get(block.block_id) is block, f"{block} missing from hash map"
        for group_id, cached in enumerate(self.cached_by_group):
            for block_hash, entry in cached.items():
                assert entry, "empty hash-map entry"
                for block_id, block in entry.items():
                    assert block.block_id == block_id and block.block_hash == block_hash, (
                        f"hash map entry for {block} is stale"
                    )
                    assert block.group_id == group_id, f"{block} cached in the wrong group"
