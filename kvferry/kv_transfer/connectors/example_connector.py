"""ExampleConnector: KV of prompt prefixes in a shared folder, one safetensors file per layer.

A stored prefix lives in ``<path>/<layout>/<key>/`` where ``key`` is the SHA-256 of exactly
the token ids it holds (int64, little endian) and ``layout`` fingerprints the model's KV shape
and dtype, so two models never read each other's files. Each folder holds ``<layer>.safetensors``
(one tensor ``kv`` of shape ``(2, tokens, kv_heads, head_dim)``) and ``meta.json``, written last
through an atomic rename: a folder without it is never offered.

Lookups are synchronous: the longest stored block-aligned prefix (below the last prompt token)
is loaded in ``start_load_kv`` before the forward. A request stores the longest block-aligned
prefix that excludes its last prompt token (what a lookup of the same prompt can use) once
its prefill has computed it. A file that is missing or does not match is reported as a
load error, so the engine's ``kv_load_failure_policy`` applies.

With the engine's KV cache events on, each prefix this engine writes is announced as
``BlockStored`` with medium ``STORAGE`` (its blocks not announced before, by the engine's
block hashes and tokens) once the step that wrote it is over. Files are never deleted, so
nothing is withdrawn.

Under tensor parallelism (N ranks) each rank stores and loads its own KV heads, in
``<path>/<layout>-tp<N>/rank<r>/<key>/`` (``layout`` names the per-rank head count); a prefix
is offered only once every rank's folder holds it.

Hybrid models (``SupportsHMA``): a sliding-window layer's file holds only the blocks the
window of the prefix's next token reads (its earlier blocks may be gone from the pool by the
time the prefix is stored), and a load fills only those; the null block is never touched.

Extra config: ``shared_storage_path`` (default ``/tmp/kvferry-example``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvferry.kv_events.block_runs import blocks_stored
from kvferry.kv_events.events import KV_CACHE_SPEC_FULL_ATTENTION, MEDIUM_STORAGE, KVCacheEvent
from kvferry.kv_transfer.base import (
    CacheHitSource,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from kvferry.kv_transfer.options import parse_options
from kvferry.logger import init_logger
from kvferry.model.parallel import tp_rank

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView
    from kvferry.model.forward_context import ForwardContext
    from kvferry.request import Request
    from kvferry.step_types.scheduler_output import SchedulerOutput

logger = init_logger(__name__)


@dataclass
class ExampleOptions:
    shared_storage_path: str = "/tmp/kvferry-example"


@dataclass
class PrefixJob:
    """Load or store tokens ``[start, num_tokens)`` of the stored prefix ``key`` (which holds
    the request's first ``num_tokens`` tokens) in the request's blocks ``block_ids`` (group
    0's; ``group_block_ids`` has every group's, empty meaning group 0 only)."""

    req_id: str
    key: str
    num_tokens: int
    block_ids: list[int]
    start: int = 0
    group_block_ids: tuple[list[int], ...] = ()


@dataclass
class ExampleConnectorMetadata(KVConnectorMetadata):
    loads: list[PrefixJob] = field(default_factory=list)
    stores: list[PrefixJob] = field(default_factory=list)


@dataclass
class _ReqState:
    request: Request
    block_ids: tuple[list[int], ...]  # per KV cache group
    store_len: int
    stored: bool = False


def prefix_keys(token_ids: list[int], block_size: int, limit: int) -> dict[int, str]:
    """SHA-256 key of every block-aligned prefix of ``token_ids`` up to ``limit`` tokens."""
    h = hashlib.sha256()
    keys: dict[int, str] = {}
    for end in range(block_size, limit + 1, block_size):
        chunk = torch.tensor(token_ids[end - block_size : end], dtype=torch.int64)
        h.update(chunk.numpy().astype("<i8").tobytes())
        keys[end] = h.copy().hexdigest()
    return keys


class ExampleConnector(KVConnectorBase, SupportsHMA):
    _cache_hit_source = CacheHitSource.DISK  # its KV files
    # Extra-config keys a subclass consumes itself (not ExampleConnector options).
    subclass_options: tuple[str, ...] = ()

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        opts = parse_options(
            ExampleOptions,
            self._kv_transfer_config.kv_connector_extra_config,
            type(self).__name__,
            ignore=self.subclass_options,
        )
        group = kv_cache_config.groups[0]
        self.block_size = group.block_size
        layout = f"{group.num_kv_heads}x{group.head_dim}-{str(group.dtype).removeprefix('torch.')}"
        layout += f"-{len(group.layer_names)}l"
        for g in kv_cache_config.groups[1:]:
            layout += f"-{len(g.layer_names)}w{g.sliding_window}"
        # Per layer: its group, and the window of its group (None: full attention).
        self._layer_group = {
            name: i for i, g in enumerate(kv_cache_config.groups) for name in g.layer_names
        }
        self._windows = [g.sliding_window for g in kv_cache_config.groups]
        self._num_groups = len(kv_cache_config.groups)
        self._null_block_id = kv_cache_config.null_block_id
        base = Path(opts.shared_storage_path) / layout
        world = getattr(getattr(config, "parallel_config", None), "tensor_parallel_size", 1)
        # Every rank's folder (the scheduler checks them all); a worker uses its own.
        self._roots = (
            [base]
            if world == 1
            else [base.parent / f"{layout}-tp{world}" / f"rank{r}" for r in range(world)]
        )
        self.root = self._roots[tp_rank()]
        self._reqs: dict[str, _ReqState] = {}
        self._loads: list[PrefixJob] = []
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._staged: dict[str, Path] = {}  # store key -> temp folder being written
        self._load_errors: set[int] = set()
        events = getattr(config, "kv_events_config", None)
        self._kv_events = bool(events is not None and events.publishes)
        # Saves planned, announced once their folder is complete: (key, request, blocks).
        self._unconfirmed: list[tuple[str, Request, int]] = []
        self._announced: set[bytes] = set()  # block hashes announced in STORAGE

    # ---------------------------------------------------------------- scheduler side
    def _complete(self, key: str) -> bool:
        return all((root / key / "meta.json").is_file() for root in self._roots)

    def _lookup(self, request: Request, num_computed_tokens: int) -> tuple[int, str | None]:
        limit = (request.num_tokens - 1) // self.block_size * self.block_size
        if limit <= num_computed_tokens:
            return 0, None
        keys = prefix_keys(request.all_token_ids, self.block_size, limit)
        for n in sorted(keys, reverse=True):
            if n <= num_computed_tokens:
                break
            if self._complete(keys[n]):
                return n, keys[n]
        return 0, None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        n, _ = self._lookup(request, num_computed_tokens)
        return max(0, n - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        # The longest prefix a later lookup of this very prompt may use (it never offers the
        # last token), so a block-aligned prompt stores one block less than it computed.
        store_len = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
        state = self._reqs.get(request.request_id)
        if state is None:
            state = _ReqState(request, tuple([] for _ in range(self._num_groups)), store_len)
            self._reqs[request.request_id] = state
        if num_external_tokens > 0:
            # The longest stored prefix does not depend on the local hit, so the lookup that
            # granted these tokens finds the same key again.
            n, key = self._lookup(request, 0)
            if key is None or n < num_external_tokens:
                raise RuntimeError(
                    "ExampleConnector: stored prefix vanished between lookup and alloc"
                )
            tables = tuple(ids[: n // self.block_size] for ids in blocks.get_block_ids())
            job = PrefixJob(request.request_id, key, n, tables[0], n - num_external_tokens, tables)
            self._loads.append(job)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ExampleConnectorMetadata(loads=self._loads)
        self._loads = []
        progress: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.block_ids = tuple(list(ids) for ids in new.block_ids)
                progress.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self._reqs.get(req_id)
            if state is not None:
                if new_blocks is not None:
                    for table, ids in zip(state.block_ids, new_blocks, strict=True):
                        table.extend(ids)
                progress.append((req_id, computed))
        for req_id, computed in progress:
            state = self._reqs[req_id]
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if state.stored or state.store_len == 0 or done < state.store_len:
                continue
            state.stored = True
            tokens = state.request.all_token_ids[: state.store_len]
            key = prefix_keys(tokens, self.block_size, state.store_len)[state.store_len]
            if not self._complete(key):
                n = state.store_len // self.block_size
                tables = tuple(ids[:n] for ids in state.block_ids)
                meta.stores.append(
                    PrefixJob(req_id, key, state.store_len, tables[0], group_block_ids=tables)
                )
                blocks = tables[0]
                if self._kv_events:
                    self._unconfirmed.append((key, state.request, len(blocks)))
        return meta

    def take_events(self) -> list[KVCacheEvent]:
        # Called after the step's output came back: its saves are done (or failed) by now.
        saves, self._unconfirmed = self._unconfirmed, []
        events: list[KVCacheEvent] = []
        for key, request, num_blocks in saves:
            hashes = request.block_hashes[:num_blocks]
            first = next((i for i, h in enumerate(hashes) if h not in self._announced), None)
            if first is None or not self._complete(key):
                continue
            self._announced.update(hashes[first:])
            events.append(
                blocks_stored(
                    request.block_hashes,
                    request.all_token_ids,
                    first,
                    num_blocks,
                    self.block_size,
                    MEDIUM_STORAGE,
                    request.cache_salt,
                    # Only the full-attention group's blocks are announced.
                    kv_cache_spec_kind=KV_CACHE_SPEC_FULL_ATTENTION,
                )
            )
        return events

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Nothing per group to release: stores are written during the step that computed
        # them. Goes through request_finished, which subclasses extend.
        return self.request_finished(request, block_ids[0])

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def _first_stored(self, layer_name: str, num_tokens: int) -> int:
        """First position a layer's file of a ``num_tokens`` prefix holds: 0, or for a
        sliding-window layer the start of the first block the next token's window reads."""
        window = self._windows[self._layer_group.get(layer_name, 0)]
        if window is None:
            return 0
        return max(0, num_tokens - window + 1) // self.block_size * self.block_size

    def _slots(self, job: PrefixJob, device: torch.device, layer_name: str = "") -> torch.Tensor:
        """The pool slots of positions ``0 .. num_tokens - 1`` in ``layer_name``'s group."""
        group = self._layer_group.get(layer_name, 0)
        ids = job.group_block_ids[group] if job.group_block_ids else job.block_ids
        blocks = torch.tensor(ids, dtype=torch.long, device=device)
        offs = torch.arange(self.block_size, device=device)
        return (blocks[:, None] * self.block_size + offs[None, :]).reshape(-1)[: job.num_tokens]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        for job in meta.loads:
            try:
                self._load(job)
            except (OSError, SafetensorError, KeyError, ValueError, RuntimeError) as e:
                logger.warning("ExampleConnector: load of %s failed: %s", job.key[:12], e)
                for ids in job.group_block_ids or (job.block_ids,):
                    self._load_errors.update(ids[job.start // self.block_size :])
                self._load_errors.discard(self._null_block_id)

    def _load(self, job: PrefixJob) -> None:
        folder = self.root / job.key
        info = json.loads((folder / "meta.json").read_text())
        if info.get("num_tokens") != job.num_tokens:
            raise ValueError(
                f"stored prefix has {info.get('num_tokens')} tokens, expected {job.num_tokens}"
            )
        for name, cache in self._kv_caches.items():
            kv = load_file(str(folder / f"{name}.safetensors"))["kv"]
            first = self._first_stored(name, job.num_tokens)
            expected = (2, job.num_tokens - first, *cache.shape[3:])
            if tuple(kv.shape) != expected or kv.dtype != cache.dtype:
                raise ValueError(
                    f"{name}: stored {tuple(kv.shape)} {kv.dtype}, expected {expected}"
                )
            start = max(job.start, first)
            slots = self._slots(job, cache.device, name)[start:]
            # (block, offset) indexing follows the tensor's strides: NHD and HND pools alike.
            cache[:, slots // self.block_size, slots % self.block_size] = kv[:, start - first :].to(
                cache.device
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        for job in meta.stores:
            tmp = self._staged.get(job.key)
            if tmp is None:
                tmp = self.root / f".tmp-{job.key}-{uuid.uuid4().hex[:8]}"
                tmp.mkdir(parents=True, exist_ok=True)
                self._staged[job.key] = tmp
            first = self._first_stored(layer_name, job.num_tokens)
            slots = self._slots(job, kv_layer.device, layer_name)[first:]
            # Token rows in position order, whatever the pool's layout: files are portable.
            kv = kv_layer[:, slots // self.block_size, slots % self.block_size]
            kv = kv.to("cpu").contiguous()
            save_file({"kv": kv}, str(tmp / f"{layer_name}.safetensors"))

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, ExampleConnectorMetadata):
            return
        for job in meta.stores:
            tmp = self._staged.pop(job.key, None)
            if tmp is None:
                continue
            (tmp / "meta.json").write_text(json.dumps({"num_tokens": job.num_tokens}))
            try:
                os.rename(tmp, self.root / job.key)
            except OSError:  # another engine stored the same prefix first
                shutil.rmtree(tmp, ignore_errors=True)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
