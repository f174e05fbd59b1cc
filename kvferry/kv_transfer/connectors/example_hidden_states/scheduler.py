"""The ExampleHiddenStatesConnector's scheduler half: which request's file is complete when.

It never offers KV (every lookup is a miss). For each request it keeps the file name and,
from each step's plan, the request's blocks and progress; it plans a save when the file's
tokens all have hidden states in the worker's per-slot buffer:

* prompt only (the default, as vLLM): in the step that computes the last prompt token, so
  the file is being written before the request's first output token comes back, and
  ``request_finished`` frees the blocks at once;
* ``kv_transfer_params["include_output_tokens"]``: every token that went through a forward
  (the prompt and the outputs but the last one, which was sampled and never fed back), known
  only when the request ends: ``request_finished`` keeps the blocks and the save goes to the
  worker with the next step, which reports the request in ``finished_sending`` when the rows
  are copied out.

Either way the final output's ``kv_transfer_params`` carry ``{"hidden_states_path": file}``;
a request that ends before its prompt was computed gets no file and no path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvferry.kv_transfer.base import KVConnectorMetadata
from kvferry.kv_transfer.connectors.example_hidden_states.files import hidden_states_filename
from kvferry.kv_transfer.connectors.example_hidden_states.metadata import (
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
)
from kvferry.kv_transfer.connectors.example_hidden_states.options import HiddenStatesOptions
from kvferry.kv_transfer.connectors.split import SchedulerHalf
from kvferry.logger import init_logger

if TYPE_CHECKING:
    from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView
    from kvferry.request import Request
    from kvferry.step_types.kv_connector_output import KVConnectorOutput
    from kvferry.step_types.scheduler_output import SchedulerOutput

logger = init_logger(__name__)

PATH_PARAM = "hidden_states_path"
OUTPUT_TOKENS_PARAM = "include_output_tokens"


@dataclass
class _Tracked:
    filename: str
    include_output: bool
    prompt_token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    announced: bool = False  # the worker was told the file name (and took its lock)
    saved: bool = False  # prompt-only: the save is planned


class HiddenStatesScheduler(SchedulerHalf):
    def __init__(self, opts: HiddenStatesOptions, block_size: int, group: int, owner: str) -> None:
        self.opts = opts
        self.block_size = block_size
        self.group = group  # the KV cache group whose block ids index the worker's buffer
        self.owner = owner
        self._reqs: dict[str, _Tracked] = {}
        self._pending: list[PendingSave] = []  # delayed saves for the next step
        self._held: set[str] = set()  # finished requests whose blocks a save keeps

    # -- intake ---------------------------------------------------------------------------
    def validate_kv_transfer_params(self, params: dict[str, Any]) -> None:
        flag = params.get(OUTPUT_TOKENS_PARAM)
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"kv_transfer_params[{OUTPUT_TOKENS_PARAM!r}] must be a boolean")
        path = params.get(PATH_PARAM)
        if path is not None and not (isinstance(path, str) and path):
            raise ValueError(f"kv_transfer_params[{PATH_PARAM!r}] must be a non-empty string")

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params or {}
        filename = hidden_states_filename(self.opts.shared_storage_path, request.request_id)
        custom = params.get(PATH_PARAM)
        if custom is not None:
            if self.opts.allow_custom_save_path:
                filename = str(custom)
            else:
                logger.warning(
                    "%s: request %s asks for hidden_states_path, but allow_custom_save_path "
                    "is off; writing %s instead",
                    self.owner,
                    request.request_id,
                    filename,
                )
        self._reqs[request.request_id] = _Tracked(
            filename=filename,
            include_output=bool(params.get(OUTPUT_TOKENS_PARAM, False)),
            prompt_token_ids=list(request.prompt_token_ids),
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False  # store-only: nothing is ever loaded

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        return None

    # -- every step -----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ExampleHiddenStatesConnectorMetadata(pending_saves=self._pending)
        self._pending = []
        progress: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:  # new, or resumed after preemption
            t = self._reqs.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[self.group])
            if not t.announced:
                t.announced = True
                meta.new_req_filenames[new.req_id] = t.filename
            progress.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            t = self._reqs.get(req_id)
            if t is None:
                continue
            if new_blocks is not None:
                t.block_ids.extend(new_blocks[self.group])
            progress.append((req_id, computed))
        for req_id, computed in progress:
            t = self._reqs[req_id]
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if t.include_output or t.saved or done < len(t.prompt_token_ids):
                continue
            t.saved = True
            n = len(t.prompt_token_ids)
            meta.pending_saves.append(
                PendingSave(req_id, t.filename, t.prompt_token_ids, self._blocks(t.block_ids, n))
            )
        return meta

    def _blocks(self, block_ids: list[int], num_tokens: int) -> list[int]:
        return list(block_ids[: -(-num_tokens // self.block_size)])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._held.difference_update(connector_output.finished_sending or ())

    def has_pending_block_frees(self) -> bool:
        return bool(self._held)  # released by the next step's output

    # -- request end ----------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        t = self._reqs.pop(request.request_id, None)
        if t is None:
            return False, None
        if not t.include_output:
            return False, ({PATH_PARAM: t.filename} if t.saved else None)
        # Every token that went through a forward has its hidden state; the last sampled
        # token never did.
        n = request.num_computed_tokens
        if n < request.num_prompt_tokens:
            return False, None  # ended before its prompt was computed: no file
        tokens = list(request.all_token_ids[:n])
        save = PendingSave(
            request.request_id, t.filename, tokens, self._blocks(block_ids, n), delayed_free=True
        )
        self._pending.append(save)
        self._held.add(request.request_id)
        return True, {PATH_PARAM: t.filename}

    def num_tracked_requests(self) -> int:
        """Requests with state here (running, or finished with a save in flight); 0 when idle."""
        return len(self._reqs) + len(self._held)
