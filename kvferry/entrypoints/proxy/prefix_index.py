"""PrefixIndex: which instance holds which prompt prefix, in which tier, learned from KV events.

Per instance it keeps the blocks announced by ``BlockStored`` (with the media holding each
one) until ``BlockRemoved`` / ``AllBlocksCleared`` take them away. Only blocks of the
instance's main-attention KV cache groups count (full attention, by ``kv_cache_spec_kind``;
group 0 when events do not name kinds): on a hybrid model a prompt's reusable prefix is
bounded by full attention, and a sliding-window group's blocks, announced and withdrawn
under the same hashes, must neither inflate a match nor withdraw a full-attention block
(Dynamo's router filters vLLM's events the same way). A request is matched by
walking its token blocks from the first: block ``i`` is found through the token ids and the
parent hash the events carried (``(parent, tokens) -> hash``), which works whatever hash
algorithm and seed the instance uses; when the proxy knows the algorithm it also recomputes
the hashes, which finds blocks announced without token ids (placeholder events of some
connector tiers) and salted prompts. The walk stops at the first block the instance lacks.

Memory is bounded: at most ``max_blocks`` blocks per instance, the least recently stored or
matched dropped first (a dropped entry only costs a missed routing hint). Thread-safe: the
event thread writes while request handlers read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kvferry.kv_events import (
    MAIN_ATTENTION_KINDS,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
)

# Routing value of a block by where it lives: the engine pool serves it at once, host memory
# after a copy, disk or a remote store after a slower read.
TIER_WEIGHTS: dict[str, float] = {MEDIUM_GPU: 1.0, MEDIUM_CPU: 0.5, MEDIUM_STORAGE: 0.25}
_BITS = {MEDIUM_GPU: 1, MEDIUM_CPU: 2, MEDIUM_STORAGE: 4}
_BIT_WEIGHTS = {bit: TIER_WEIGHTS[m] for m, bit in _BITS.items()}
# A block's media are kept per main-attention group (vLLM can split full attention into
# several groups, each announcing and withdrawing the same hash): one set of medium bits per
# group, the groups from the 8th on sharing the last set.
_MEDIUM_BITS = 3
_GROUP_SLOTS = 8

TokenKey = tuple[ExternalBlockHash | None, tuple[int, ...]]


def medium_bit(medium: str | None, group_idx: int | None = None) -> int:
    # No medium: vLLM's block pool before tiers existed, i.e. the engine pool. An unknown tier
    # ranks with the slowest one.
    bit = _BITS[MEDIUM_GPU] if medium is None else _BITS.get(medium.upper(), _BITS[MEDIUM_STORAGE])
    return bit << (_MEDIUM_BITS * min(max(group_idx or 0, 0), _GROUP_SLOTS - 1))


def best_weight(media: int) -> float:
    """The best tier weight among ``media`` (any group's)."""
    mask = (1 << _MEDIUM_BITS) - 1
    tiers = 0
    while media:
        tiers |= media & mask
        media >>= _MEDIUM_BITS
    return max((w for bit, w in _BIT_WEIGHTS.items() if tiers & bit), default=0.0)


def is_main_attention(kind: str | None) -> bool | None:
    """Whether a block event's group bounds prompt reuse: by its ``kv_cache_spec_kind``, or
    None when the event names no kind."""
    if kind is None:
        return None
    return kind in MAIN_ATTENTION_KINDS


@dataclass(slots=True)
class _Block:
    key: TokenKey | None
    media: int = 0


@dataclass
class _Instance:
    blocks: OrderedDict[ExternalBlockHash, _Block] = field(default_factory=OrderedDict)
    by_tokens: dict[TokenKey, ExternalBlockHash] = field(default_factory=dict)
    block_size: int | None = None
    # Per KV cache group: whether it is a main-attention group, as its BlockStored events
    # named it (BlockRemoved names no kind, so removals are judged by what stores taught).
    main_groups: dict[int | None, bool] = field(default_factory=dict)

    def is_main(self, group_idx: int | None, kind: str | None = None) -> bool:
        main = is_main_attention(kind)
        if main is not None:
            self.main_groups[group_idx] = main
            return main
        learned = self.main_groups.get(group_idx)
        # Events without kinds (vLLM before 0.33, connector tiers) describe group 0, the
        # only group vLLM published then.
        return learned if learned is not None else group_idx in (None, 0)


@dataclass(frozen=True)
class Match:
    """The longest indexed prefix of a prompt on one instance."""

    blocks: int = 0
    tokens: int = 0
    # Tokens weighted by the best tier holding each block (TIER_WEIGHTS).
    weighted_tokens: float = 0.0


NO_MATCH = Match()
# Recomputed hashes of a prompt's blocks for one block size (both published forms).
HashLookup = Sequence[tuple[ExternalBlockHash, ...]]


class PrefixIndex:
    def __init__(self, max_blocks: int = 200_000, shared_media: Collection[str] = ()) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        # Exact strings: vLLM's MooncakeStoreConnector announces its store as "cpu", its
        # (and kvferry's) own host tiers as "CPU".
        self.shared_media = frozenset(shared_media)
        self._lock = threading.Lock()
        self._instances: dict[str, _Instance] = {}
        self._shared = _Instance()

    # -- writing (the event thread) -----------------------------------------------------------

    def apply(self, instance: str, batch: KVEventBatch) -> None:
        with self._lock:
            inst = self._instances.setdefault(instance, _Instance())
            for ev in batch.events:
                # The publishing instance knows its groups, also for blocks kept shared.
                if isinstance(ev, BlockStored):
                    if inst.is_main(ev.group_idx, ev.kv_cache_spec_kind):
                        self._stored(self._target(inst, ev.medium), ev)
                elif isinstance(ev, BlockRemoved):
                    if inst.is_main(ev.group_idx):
                        self._removed(self._target(inst, ev.medium), ev)
                elif isinstance(ev, AllBlocksCleared):
                    inst.blocks.clear()
                    inst.by_tokens.clear()

    def _target(self, inst: _Instance, medium: str | None) -> _Instance:
        shared = medium is not None and medium in self.shared_media
        return self._shared if shared else inst

    def drop(self, instance: str) -> None:
        """Forget everything ``instance`` announced (it restarted, or events were lost)."""
        with self._lock:
            self._instances.pop(instance, None)

    def _stored(self, inst: _Instance, ev: BlockStored) -> None:
        # Only a non-LoRA model is routable by prompt tokens.
        if ev.lora_id is not None:
            return
        bs, tokens, bit = ev.block_size, ev.token_ids, medium_bit(ev.medium, ev.group_idx)
        with_tokens = bs > 0 and len(tokens) == bs * len(ev.block_hashes)
        if with_tokens:
            inst.block_size = bs
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            # A block with extra keys (salt, LoRA) must not match a plain prompt's tokens.
            extra = ev.extra_keys[i] if ev.extra_keys and i < len(ev.extra_keys) else None
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs])) if with_tokens else None
            if extra is not None:
                key = None
            block = inst.blocks.get(h)
            if block is None:
                block = inst.blocks[h] = _Block(key)
            else:
                inst.blocks.move_to_end(h)
                block.key = block.key or key
            block.media |= bit
            if key is not None:
                inst.by_tokens[key] = h
            parent = h
        while len(inst.blocks) > self.max_blocks:
            h, old = inst.blocks.popitem(last=False)
            self._unlink(inst, h, old)

    def _removed(self, inst: _Instance, ev: BlockRemoved) -> None:
        bit = medium_bit(ev.medium, ev.group_idx)
        for h in ev.block_hashes:
            block = inst.blocks.get(h)
            if block is None:
                continue
            block.media &= ~bit
            if not block.media:
                del inst.blocks[h]
                self._unlink(inst, h, block)

    @staticmethod
    def _unlink(inst: _Instance, h: ExternalBlockHash, block: _Block) -> None:
        if block.key is not None and inst.by_tokens.get(block.key) == h:
            del inst.by_tokens[block.key]

    # -- reading (request handlers) -----------------------------------------------------------

    def block_size(self, instance: str) -> int | None:
        inst = self._instances.get(instance)
        return inst.block_size if inst else None

    def size(self, instance: str) -> int:
        inst = self._instances.get(instance)
        return len(inst.blocks) if inst else 0

    def match(
        self,
        instance: str,
        token_ids: Sequence[int],
        block_size: int | None = None,
        hashes: HashLookup | None = None,
        use_tokens: bool = True,
    ) -> Match:
        """The longest prefix of ``token_ids`` that ``instance`` holds.

        ``block_size`` defaults to the one its events carried; ``hashes[i]`` are the
        recomputed forms of block ``i``'s hash (optional); ``use_tokens=False`` skips the
        token walk (a salted prompt, which only recomputed hashes can match).
        """
        with self._lock:
            own = self._instances.get(instance)
            held = [i for i in (own, self._shared) if i is not None and i.blocks]
            if not held:
                return NO_MATCH
            bs = block_size or (own.block_size if own else None) or self._shared.block_size
            if not bs:
                return NO_MATCH
            parent: ExternalBlockHash | None = None
            n, weighted = 0, 0.0
            for i in range(len(token_ids) // bs):
                tokens = tuple(token_ids[i * bs : (i + 1) * bs])
                forms = hashes[i] if hashes is not None and i < len(hashes) else ()
                found = [
                    f
                    for inst in held
                    if (f := self._find(inst, parent, tokens, forms, use_tokens)) is not None
                ]
                if not found:
                    break
                parent = found[0][0]
                n += 1
                weighted += max(best_weight(block.media) for _, block in found) * bs
            return Match(n, n * bs, weighted) if n else NO_MATCH

    @staticmethod
    def _find(
        inst: _Instance,
        parent: ExternalBlockHash | None,
        tokens: tuple[int, ...],
        forms: Sequence[ExternalBlockHash],
        use_tokens: bool,
    ) -> tuple[ExternalBlockHash, _Block] | None:
        """Block ``tokens`` (after ``parent``) in ``inst``, by token walk, then by hash."""
        if use_tokens:
            h = inst.by_tokens.get((parent, tokens))
            block = inst.blocks.get(h) if h is not None else None
            if h is not None and block is not None:
                inst.blocks.move_to_end(h)
                return h, block
        for h in forms:
            if (block := inst.blocks.get(h)) is not None:
                inst.blocks.move_to_end(h)
                return h, block
        return None
