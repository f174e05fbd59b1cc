"""The ExampleHiddenStatesConnector's worker half: a per-slot buffer of hidden states, and
the writers that turn a request's rows into its file.

vLLM keeps the hidden states in a KV cache group of their own (a cache-only attention layer
after the model), so they live in the request's paged blocks like KV. kvferry keeps the same
idea without a second group: a host buffer with one row per KV slot of the engine's pool,
``[num_blocks * block_size, num_layer_ids, hidden_size]``, written at the KV slots of the
step's tokens. So the hidden states of a block travel with its KV: a prefix-cache hit reuses
the rows the block's first computation wrote (the tokens skipped are not recomputed, and
their hidden states are still right), a preempted request recomputes (or hits) its tokens
like their KV, and chunked prefill needs nothing special.

Per step: ``start_load_kv`` puts a :class:`HiddenStatesCapture` on the forward context; the
model records the chosen layers' residual stream; ``wait_for_save`` copies the step's rows to
their slots, then gathers each planned save's rows (a copy, so the blocks may be reused at
once) and hands them to a writer thread. The buffer is a private anonymous memory map: the
OS zero-fills a page when it is first written, so the memory in use grows with the slots
used, up to ``num_blocks * block_size * num_layer_ids * hidden_size * dtype size`` bytes.

Under tensor parallelism every rank computes the same hidden states; only rank 0 keeps the
buffer and writes (the facade's ``get_finished_count`` is 1).
"""

from __future__ import annotations

import math
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

import torch

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import KVConnectorMetadata
from kvferry.kv_transfer.connectors.example_hidden_states.files import (
    take_write_lock,
    write_hidden_states,
)
from kvferry.kv_transfer.connectors.example_hidden_states.metadata import (
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
)
from kvferry.kv_transfer.connectors.example_hidden_states.options import HiddenStatesOptions
from kvferry.kv_transfer.connectors.split import WorkerHalf
from kvferry.logger import init_logger
from kvferry.model.hidden_states_capture import HiddenStatesCapture

if TYPE_CHECKING:
    from kvferry.model.forward_context import ForwardContext

logger = init_logger(__name__)


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, owner: str) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > avail:
        raise ConfigError(
            f"{owner}: the hidden-states buffer needs {nbytes / 1024**2:.0f} MiB of host "
            f"memory ({shape[0]} KV slots x {shape[1]} layers x {shape[2]} x {dtype}), more "
            f"than this machine has; save fewer layers or use a smaller KV pool"
        )
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


class HiddenStatesWorker(WorkerHalf):
    def __init__(
        self,
        opts: HiddenStatesOptions,
        layer_ids: tuple[int, ...],
        hidden_size: int,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        slots_layer: str,
        is_writer: bool,
        owner: str,
    ) -> None:
        self.opts = opts
        self.layer_ids = layer_ids
        self.block_size = block_size
        # A layer of the KV cache group whose block ids index the buffer.
        self.slots_layer = slots_layer
        self.is_writer = is_writer
        self.owner = owner
        self._shape = (num_blocks * block_size, len(layer_ids), hidden_size)
        self._dtype = dtype
        self._buffer: torch.Tensor | None = None
        self._capture: HiddenStatesCapture | None = None
        self._slots: torch.Tensor | None = None  # this step's KV slots, on the host
        self._lock_fds: dict[str, int] = {}  # request -> held lock of its file
        self._sent: set[str] = set()  # delayed-free saves copied out since the last report
        self._writes: dict[str, Future[None]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self.failed_writes = 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.is_writer:
            self._buffer = _host_buffer(self._shape, self._dtype, self.owner)
            self._executor = ThreadPoolExecutor(
                max_workers=self.opts.num_writer_threads, thread_name_prefix="kvferry-hs-save"
            )

    # -- before the forward -----------------------------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        if not self.is_writer or not self.opts.use_synchronization_lock:
            return
        assert isinstance(metadata, ExampleHiddenStatesConnectorMetadata)
        # Before this step's output can carry a path to anyone, its lock is held.
        for req_id, filename in metadata.new_req_filenames.items():
            if req_id not in self._lock_fds:
                self._lock_fds[req_id] = take_write_lock(filename)

    def start_load_kv(self, metadata: KVConnectorMetadata, forward_context: ForwardContext) -> None:
        attn = forward_context.metadata_for(self.slots_layer)
        if not self.is_writer or attn is None:
            return
        self._capture = HiddenStatesCapture(self.layer_ids)
        forward_context.hidden_states_capture = self._capture
        self._slots = attn.slot_mapping.to("cpu")

    # -- after the forward ------------------------------------------------------------------
    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, ExampleHiddenStatesConnectorMetadata)
        capture, slots = self._capture, self._slots
        self._capture = self._slots = None
        if not self.is_writer:
            return
        buf = self._buffer
        assert buf is not None, "register_kv_caches was not called"
        if capture is not None and slots is not None:
            missing = capture.missing()
            if missing:
                raise RuntimeError(
                    f"{self.owner}: the model recorded no hidden states for layer ids "
                    f"{missing}; its family has no hidden-states capture hook"
                )
            for j, layer_id in enumerate(self.layer_ids):
                buf[slots, j] = capture.states[layer_id].to("cpu", buf.dtype)
        for save in metadata.pending_saves:
            self._submit(buf, save)

    def _submit(self, buf: torch.Tensor, save: PendingSave) -> None:
        n = len(save.token_ids)
        blocks = torch.tensor(save.block_ids, dtype=torch.long)
        offsets = torch.arange(self.block_size, dtype=torch.long)
        rows = (blocks[:, None] * self.block_size + offsets[None, :]).reshape(-1)[:n]
        if rows.numel() != n:
            raise RuntimeError(
                f"{self.owner}: request {save.req_id} has {n} tokens to save but its "
                f"{len(save.block_ids)} blocks hold {rows.numel()}"
            )
        hidden = buf[rows]  # a copy: the blocks may hold other tokens from the next step on
        lock_fd = self._lock_fds.pop(save.req_id, None)
        if self.opts.use_synchronization_lock and lock_fd is None:
            lock_fd = take_write_lock(save.filename)
        assert self._executor is not None
        previous = self._writes.get(save.req_id)
        if previous is not None:  # the same id again: keep its files in order
            previous.result()
        future = self._executor.submit(
            write_hidden_states, save.filename, hidden, save.token_ids, self.layer_ids, lock_fd
        )
        self._writes[save.req_id] = future
        future.add_done_callback(partial(self._on_written, save.filename))
        if save.delayed_free:
            self._sent.add(save.req_id)

    def _on_written(self, filename: str, future: Future[None]) -> None:
        # On the writer thread: only counts and logs (the step thread prunes ``_writes``).
        error = future.exception()
        if error is not None:
            self.failed_writes += 1
            logger.error("%s: writing %s failed: %r", self.owner, filename, error)

    def get_finished(
        self, finished_req_ids: set[str], metadata: KVConnectorMetadata | None
    ) -> tuple[set[str] | None, set[str] | None]:
        # A request that ended without a save (aborted before its prompt was computed)
        # releases its lock: a waiting reader then finds no file.
        for req_id in finished_req_ids:
            fd = self._lock_fds.pop(req_id, None)
            if fd is not None:
                os.close(fd)
        self._writes = {r: f for r, f in self._writes.items() if not f.done()}
        sent, self._sent = self._sent, set()
        return sent or None, None

    def wait_for_writes(self) -> None:
        """Block until every submitted file is in place (tests, shutdown)."""
        for future in list(self._writes.values()):
            future.exception()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for fd in self._lock_fds.values():
            os.close(fd)
        self._lock_fds.clear()
