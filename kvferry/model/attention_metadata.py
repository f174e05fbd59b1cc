"""Per-step attention metadata, built once per step and KV cache group and shared by the
group's attention layers.

Beyond the vLLM-style fields (slot mapping, block table, query/sequence lengths) the builder
precomputes an execution plan, so each layer only runs tensor ops:

* decode requests (one new token) are batched: per group of similar lengths, one gather of
  their KV blocks and one attention call with a length mask;
* prefill requests with no cached context attend only to their own new tokens, so they use
  causal attention on the fresh q/k/v directly, without touching the cache;
* prefill chunks with cached context (chunked prefill, prefix-cache hits, KV loaded by a
  connector) gather their blocks and use an explicit causal mask offset by the context length;
* where the runner's workspace has a prefill kernel, every prefill instead reads its blocks
  in place, with or without context.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch

from kvferry.model.long_tensor import long_tensor


@dataclass
class DecodePlan:
    """Requests with exactly one new token and similar lengths, attended together: one gather
    of their blocks and one SDPA call (on CPU, a few requests at a time; see attention.py)."""

    req_indices: list[int]
    # Flat-batch rows of their tokens: a (start, stop) range when they are contiguous,
    # otherwise an index tensor on the device.
    token_range: tuple[int, int] | None
    token_index: torch.Tensor | None
    # [num_decodes, num_blocks] block ids, padded with block 0 (masked out).
    block_table: torch.Tensor
    # [num_decodes] int64 sequence lengths (new token included), on the device.
    seq_lens: torch.Tensor
    # Key positions covered by block_table (num_blocks * block_size), and whether some
    # decode uses fewer (then the torch path needs a mask).
    width: int
    padded: bool
    _float_masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    _window_masks: dict[int, torch.Tensor | None] = field(default_factory=dict, repr=False)
    _float_window_masks: dict[tuple[torch.dtype, int], torch.Tensor | None] = field(
        default_factory=dict, repr=False
    )

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[num_decodes, 1, 1, width] True where a key position is valid; None when every
        decode uses every position. Built on first use: only the gather + SDPA path reads
        it (a decode kernel reads ``seq_lens``)."""
        if not self.padded:
            return None
        n = self.seq_lens.shape[0]
        positions = torch.arange(self.width, device=self.seq_lens.device)
        return (positions[None, :] < self.seq_lens[:, None]).view(n, 1, 1, self.width)

    def window_mask(self, window: int | None) -> torch.Tensor | None:
        """:attr:`mask` for a sliding-window layer: also False for the keys that have left
        the window (position below ``seq_len - window``). Built once per window."""
        if window is None:
            return self.mask
        if window not in self._window_masks:
            n = self.seq_lens.shape[0]
            positions = torch.arange(self.width, device=self.seq_lens.device)[None, :]
            lens = self.seq_lens[:, None]
            m = (positions < lens) & (positions >= lens - window)
            self._window_masks[window] = None if bool(m.all()) else m.view(n, 1, 1, self.width)
        return self._window_masks[window]

    def additive_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor | None:
        """The mask as 0 / -inf in ``dtype``, converted once per step rather than per layer."""
        if window is not None:
            key = (dtype, window)
            if key not in self._float_window_masks:
                wm = self.window_mask(window)
                self._float_window_masks[key] = None if wm is None else _additive(wm, dtype)
            return self._float_window_masks[key]
        mask = self.mask
        if mask is None:
            return None
        m = self._float_masks.get(dtype)
        if m is None:
            m = _additive(mask, dtype)
            self._float_masks[dtype] = m
        return m


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    m.masked_fill_(~mask, float("-inf"))
    return m


@dataclass
class PrefillPlan:
    """One request with more than one new token."""

    req_index: int
    token_start: int
    token_stop: int
    context_len: int  # tokens already in the cache before this step
    seq_len: int
    # The blocks holding the whole sequence (a prefill kernel reads them in place; the torch
    # path gathers them when context_len > 0).
    block_ids: torch.Tensor

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """The ``[q, seq_len]`` boolean mask (True = attend) of a causal mask shifted by
        ``context_len``; None without context. Built on first use: only the gather + SDPA
        path reads it."""
        if self.context_len == 0:
            return None
        return self.window_mask(None)

    def window_mask(self, window: int | None) -> torch.Tensor:
        """The causal mask over the whole sequence, for a sliding-window layer (``window``
        keys up to and including each query's own position) or, with None, a full one."""
        device = self.block_ids.device
        q = self.token_stop - self.token_start
        # Query row r sits at position ctx + r and may see keys 0 .. ctx + r.
        keys = torch.arange(self.seq_len, device=device)[None, :]
        pos = (torch.arange(q, device=device) + self.context_len)[:, None]
        if window is None:
            return keys <= pos
        return (keys <= pos) & (keys > pos - window)

    def needs_window(self, window: int | None) -> bool:
        """Whether some query of the chunk has keys outside a window of ``window``."""
        return window is not None and self.seq_len > window


@dataclass
class AttentionMetadata:
    """What attention layers need for one step of a flattened, mixed batch.

    Requests are in batch order; request ``i`` owns flat rows
    ``query_start_loc_list[i] .. query_start_loc_list[i + 1] - 1``, which hold its tokens at
    positions ``seq_lens_list[i] - query_lens[i] .. seq_lens_list[i] - 1``.

    The fields connectors written for vLLM read have vLLM's names and types:
    ``num_actual_tokens``, ``max_query_len``, ``max_seq_len`` (ints), ``slot_mapping``,
    ``block_table``, and ``query_start_loc`` / ``seq_lens`` (int32 tensors on the device,
    made on first read: attention itself reads the plans).
    """

    num_reqs: int
    num_actual_tokens: int
    query_start_loc_list: list[int]
    query_lens: list[int]
    seq_lens_list: list[int]
    # [num_tokens] long, where each new token's K/V goes: block_id * block_size + offset.
    slot_mapping: torch.Tensor
    # [num_reqs, max_blocks] long, padded with 0.
    block_table: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    decodes: list[DecodePlan]
    prefills: list[PrefillPlan]

    @functools.cached_property
    def query_start_loc(self) -> torch.Tensor:
        """vLLM's ``[num_reqs + 1]`` int32 offsets of each request's first flat row."""
        return self._int32(self.query_start_loc_list)

    @functools.cached_property
    def seq_lens(self) -> torch.Tensor:
        """vLLM's ``[num_reqs]`` int32 sequence lengths, this step's tokens included."""
        return self._int32(self.seq_lens_list)

    def _int32(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(self.slot_mapping.device)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    group_decodes: bool = True,
) -> AttentionMetadata:
    """Build the metadata and per-step attention plan for one step.

    ``block_tables[i]`` must cover ``seq_lens[i]`` tokens (it may hold more blocks);
    ``query_lens[i]`` must be in ``1 .. seq_lens[i]``. Raises ``ValueError`` otherwise.
    ``group_decodes=False`` puts all decodes in one plan: for a decode kernel that reads each
    request's own length from the pool, padding costs nothing and each plan is one call.
    """
    num_reqs = len(query_lens)
    if not (len(seq_lens) == len(block_tables) == num_reqs):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per request")
    for i, (q, s, bt) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 0 < q <= s:
            raise ValueError(f"request {i}: query_len {q} must be in 1..seq_len ({s})")
        if len(bt) * block_size < s:
            raise ValueError(
                f"request {i}: {len(bt)} blocks of {block_size} cannot hold {s} tokens"
            )

    starts = list(itertools.accumulate(query_lens, initial=0))
    num_tokens = starts[-1]
    max_blocks = max((len(bt) for bt in block_tables), default=0)
    padded = itertools.chain.from_iterable(bt + [0] * (max_blocks - len(bt)) for bt in block_tables)
    block_table_cpu = long_tensor(padded).view(num_reqs, max_blocks)
    slots = long_tensor(_slot_mapping(query_lens, seq_lens, block_tables, block_size))

    decode_idx = [i for i, q in enumerate(query_lens) if q == 1]
    if group_decodes:
        groups = _group_decodes(decode_idx, seq_lens, block_size)
    else:
        groups = [decode_idx] if decode_idx else []
    decodes = [
        _plan_decodes(group, starts, seq_lens, block_table_cpu, block_size, device)
        for group in groups
    ]
    prefills = [
        _plan_prefill(i, starts, query_lens[i], seq_lens[i], block_tables[i], block_size, device)
        for i, q in enumerate(query_lens)
        if q > 1
    ]
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        query_start_loc_list=starts,
        query_lens=list(query_lens),
        seq_lens_list=list(seq_lens),
        slot_mapping=slots.to(device),
        block_table=block_table_cpu.to(device),
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        decodes=decodes,
        prefills=prefills,
    )


# A decode group's padded width may grow to this multiple of its shortest member's before a
# new group starts: padding costs gather bandwidth and attention work, while each group adds
# a handful of kernel launches per layer.
_GROUP_WIDTH_RATIO = 1.5
# Bounds the gather workspace (tokens per group, K and V of one layer).
_GROUP_MAX_TOKENS = 32768


def _group_decodes(idx: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Split decode requests into groups of similar length; each group keeps batch order."""
    if not idx:
        return []
    by_len = sorted(idx, key=lambda i: seq_lens[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    first_blocks = 0
    for i in by_len:
        nblocks = -(-seq_lens[i] // block_size)
        if cur and (
            nblocks > _GROUP_WIDTH_RATIO * first_blocks
            or (len(cur) + 1) * nblocks * block_size > _GROUP_MAX_TOKENS
        ):
            groups.append(sorted(cur))
            cur = []
        if not cur:
            first_blocks = nblocks
        cur.append(i)
    groups.append(sorted(cur))
    return groups


def _slot_mapping(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> list[int]:
    """Where each new token's K/V goes, in batch order: one ``range`` per block touched, so
    the cost follows blocks, not tokens (plain Python beats a dozen small tensor ops here)."""
    slots: list[int] = []
    for q, seq_len, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
        pos = seq_len - q
        while pos < seq_len:
            block, offset = divmod(pos, block_size)
            n = min(seq_len - pos, block_size - offset)
            base = blocks[block] * block_size + offset
            slots.extend(range(base, base + n))
            pos += n
    return slots


def _plan_decodes(
    idx: list[int],
    starts: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> DecodePlan:
    rows = [starts[i] for i in idx]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    lens = [seq_lens[i] for i in idx]
    nblocks = -(-max(lens) // block_size)
    everyone = len(idx) == block_table.shape[0]  # idx is sorted: all requests, in order
    table = block_table[:, :nblocks] if everyone else block_table[idx, :nblocks]
    return DecodePlan(
        req_indices=idx,
        token_range=(rows[0], rows[0] + len(rows)) if contiguous else None,
        token_index=None if contiguous else long_tensor(rows, device),
        block_table=table.to(device),
        seq_lens=long_tensor(lens, device),
        width=nblocks * block_size,
        padded=any(n != nblocks * block_size for n in lens),
    )


def _plan_prefill(
    i: int,
    starts: list[int],
    q: int,
    seq_len: int,
    blocks: list[int],
    block_size: int,
    device: torch.device,
) -> PrefillPlan:
    nblocks = -(-seq_len // block_size)
    return PrefillPlan(
        req_index=i,
        token_start=starts[i],
        token_stop=starts[i + 1],
        context_len=seq_len - q,
        seq_len=seq_len,
        block_ids=long_tensor(blocks[:nblocks], device),
    )
