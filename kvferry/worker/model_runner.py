"""ModelRunner: keeps the worker's copy of each request, builds the flattened batch of one
step, runs the model inside a forward context and samples.

The scheduler owns the truth about requests; the runner mirrors what it needs (token ids,
block table, sampling state) from each ``SchedulerOutput`` and appends its own sampled tokens,
so only block ids and counts travel from the scheduler for requests already known here.

A request the runner cannot serve (its seed fits no generator, or its row of the sampler finds
no valid distribution) still runs its forward, so its KV is valid for whoever saves or shares
it, but samples nothing: it is reported in ``ModelRunnerOutput.failed`` and the scheduler ends
it, while the rest of the batch goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvferry.model.attention_metadata import build_attention_metadata
from kvferry.model.attention_workspace import AttentionWorkspace
from kvferry.model.forward_context import ForwardContext, layer_metadata, set_forward_context
from kvferry.model.long_tensor import long_tensor
from kvferry.model.sampler import Sampler, SamplingRow
from kvferry.sampling_params import SamplingParams
from kvferry.step_types.runner_output import ModelRunnerOutput
from kvferry.step_types.scheduler_output import SchedulerOutput
from kvferry.worker.cpu_backend import CPUBackend
from kvferry.worker.kv_connector import KVConnectorDriver


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # One block table per KV cache group. A sliding-window group's table keeps the ids of
    # blocks that left the window (the scheduler nulls them); attention never reads them.
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    generator: torch.Generator | None
    logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class StepBatch:
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    # Batch rows whose last scheduled token is the request's last known token: they sample,
    # from the hidden state at flat token index sample_tokens[i].
    sample_rows: list[int]
    sample_tokens: list[int]


class ModelRunner:
    """Takes the freshly loaded model and applies the device's tuning to it (on CPU a
    :class:`~kvferry.worker.cpu_backend.CPUBackend`); the KV caches come later, through
    :meth:`initialize_kv_caches`, once the worker has sized the pool from what is left."""

    def __init__(self, model: Any, block_size: int, device: torch.device, seed: int) -> None:
        self.model = model
        self.kv_caches: dict[str, torch.Tensor] = {}
        # Layer names per KV cache group; empty: one group of every layer.
        self.layer_groups: list[tuple[str, ...]] = []
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}
        cpu = CPUBackend(model.dtype) if device.type == "cpu" else None
        if cpu is not None:
            cpu.prepare_model(model)
        # Kept for what it chose (``describe()``: CPU features and paths, for benchmarks).
        self.cpu_backend = cpu
        # Scratch memory and kernel choices every attention layer uses, reused across steps.
        self.attn_workspace = AttentionWorkspace() if cpu is None else cpu.attention_workspace()
        self.sampler = Sampler(
            torch.Generator(device="cpu").manual_seed(seed),
            argmax=None if cpu is None else cpu.argmax,
        )
        # Drives the worker-side KV connector around each step (None without a connector).
        self.kv_driver: KVConnectorDriver | None = None
        # Requests that can never be sampled (their seed fits no generator) -> why; reported
        # as failed every step they are in, until the scheduler has finished them.
        self.unservable: dict[str, str] = {}

    def initialize_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        layer_groups: list[tuple[str, ...]] | None = None,
    ) -> None:
        """``layer_groups``: the layers of each KV cache group (default: one group)."""
        self.kv_caches = kv_caches
        self.layer_groups = list(layer_groups or [])

    def update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
            self.unservable.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            gen, error = None, None
            if sp.seed is not None and not sp.greedy:
                try:
                    gen = torch.Generator(device="cpu").manual_seed(sp.seed)
                except Exception as e:  # e.g. a seed beyond 64 bits
                    error = f"seed {sp.seed!r} cannot seed a generator: {e}"
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=sp,
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=gen,
            )
            if error is not None:
                self.unservable[new.req_id] = error
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                for table, ids in zip(state.block_ids, new_blocks, strict=True):
                    table.extend(ids)
            if i < len(cached.num_output_tokens):
                # A recompute after a failed KV load discards the token sampled on bad KV.
                del state.token_ids[state.num_prompt_tokens + cached.num_output_tokens[i] :]

    def _prepare_batch(self, so: SchedulerOutput) -> StepBatch:
        req_ids = list(so.num_scheduled_tokens)
        ids: list[int] = []
        pos: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_tokens: list[int] = []
        for row, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            end = start + n
            ids.extend(state.token_ids[start:end])
            pos.extend(range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            if end >= len(state.token_ids):
                sample_rows.append(row)
                sample_tokens.append(len(ids) - 1)
        return StepBatch(
            req_ids=req_ids,
            input_ids=long_tensor(ids, self.device),
            positions=long_tensor(pos, self.device),
            query_lens=query_lens,
            seq_lens=seq_lens,
            sample_rows=sample_rows,
            sample_tokens=sample_tokens,
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(so)
        driver = self.kv_driver
        if so.total_num_scheduled_tokens == 0:
            if driver is None:
                return ModelRunnerOutput()
            return ModelRunnerOutput(kv_connector_output=driver.no_forward(so))
        batch = self._prepare_batch(so)
        # One metadata per KV cache group (its block tables); group 0's is the default.
        group_metadata = [
            build_attention_metadata(
                query_lens=batch.query_lens,
                seq_lens=batch.seq_lens,
                block_tables=[self.requests[r].block_ids[g] for r in batch.req_ids],
                block_size=self.block_size,
                device=self.device,
                # A decode kernel reads each request's blocks in place, so it takes all
                # decodes in one plan.
                group_decodes=self.attn_workspace.decode_kernel is None,
            )
            for g in range(max(1, len(self.layer_groups)))
        ]
        connector = driver.connector if driver is not None else None
        per_layer = layer_metadata(
            group_metadata[0],
            self.kv_caches,
            zip(self.layer_groups[1:], group_metadata[1:], strict=True),
        )
        ctx = ForwardContext(
            per_layer, self.kv_caches, connector, attn_workspace=self.attn_workspace
        )
        kv_output = None
        # Only the sampled rows' final hidden states are read (a decode step samples them all).
        rows = None
        if len(batch.sample_tokens) < batch.input_ids.shape[0]:
            rows = long_tensor(batch.sample_tokens, self.device)
        with set_forward_context(ctx):
            if driver is None:
                hidden = self.model(batch.input_ids, batch.positions, rows)
            else:
                driver.pre_forward(so, ctx)
                try:
                    hidden = self.model(batch.input_ids, batch.positions, rows)
                except BaseException:
                    driver.abort_step()
                    raise
                kv_output = driver.post_forward(so, ctx)
        output = self._sample(batch, hidden)
        output.kv_connector_output = kv_output
        return output

    def _sample(self, batch: StepBatch, hidden: torch.Tensor) -> ModelRunnerOutput:
        """``hidden``: the final hidden states of ``batch.sample_tokens``, one row each."""
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        logprobs: list[list[dict[int, float]] | None] = [None] * len(batch.req_ids)
        failed: dict[str, str] = {}
        if self.unservable:
            failed = {r: self.unservable[r] for r in batch.req_ids if r in self.unservable}
        sample_rows = batch.sample_rows
        if failed:
            keep = [i for i, r in enumerate(sample_rows) if batch.req_ids[r] not in failed]
            sample_rows = [sample_rows[i] for i in keep]
            hidden = hidden[long_tensor(keep, hidden.device)]
        if sample_rows:
            logits = self.model.compute_logits(hidden)
            states = [self.requests[batch.req_ids[r]] for r in sample_rows]
            rows = [SamplingRow(s.sampling_params, s.generator) for s in states]
            out = self.sampler(logits, rows)
            for i, (row, state, token, lp) in enumerate(
                zip(sample_rows, states, out.token_ids, out.logprobs, strict=True)
            ):
                if token is None:
                    failed[state.req_id] = out.errors[i]
                    continue
                state.token_ids.append(token)
                sampled[row] = [token]
                if lp is not None:
                    logprobs[row] = [lp]
        return ModelRunnerOutput(
            req_ids=batch.req_ids, sampled_token_ids=sampled, logprobs=logprobs, failed=failed
        )
