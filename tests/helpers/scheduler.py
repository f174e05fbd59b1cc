"""Helpers to drive the real Scheduler step by step without a model.

Build a scheduler with :func:`create_scheduler`, requests with :func:`create_request`, and
stand in for the workers with either :func:`make_runner_output` (stateless: reads the
scheduler's own request state) or :class:`FakeWorker` (stateful: mirrors the requests purely
from each ``SchedulerOutput``, like the real model runner, and checks the plan is coherent).
:func:`step` can attach a hand-made ``KVConnectorOutput`` to a step's runner output.
:func:`drive` steps until even the transfers are done; :func:`table`, :func:`is_cached` and
:func:`out_of` read the results.
End every lifecycle test with :func:`assert_no_leaks`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvferry.config import CacheConfig, KVEventsConfig, SchedulerConfig
from kvferry.core.block_hash import get_request_block_hasher
from kvferry.core.kv_event_publishing import KVEventPublisher
from kvferry.core.outputs import EngineCoreOutput
from kvferry.core.scheduler import Scheduler
from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvferry.kv_transfer.base import KVConnectorBase
from kvferry.request import Request
from kvferry.sampling_params import SamplingParams
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from kvferry.step_types.runner_output import ModelRunnerOutput
from kvferry.step_types.scheduler_output import SchedulerOutput

BLOCK_SIZE = 16
EOS_TOKEN = 2
# What the fake workers sample unless told otherwise; neither EOS nor a typical stop token.
SAMPLED_TOKEN = 7

# (request id, index of the output token being sampled) -> token id
TokenFn = Callable[[str, int], int]
TokenSpec = int | TokenFn

# A step's KVConnectorOutput, or a function of the step's SchedulerOutput that makes it.
KVOutputSpec = KVConnectorOutput | Callable[[SchedulerOutput], KVConnectorOutput | None] | None

_request_ids = itertools.count()


def make_kv_cache_config(
    num_blocks: int, block_size: int = BLOCK_SIZE, sliding_window: int | None = None
) -> KVCacheConfig:
    """One full-attention group; with ``sliding_window`` a second, sliding-window group (a
    hybrid model, whose pool then sets block 0 aside as the null block)."""
    group = KVCacheGroupSpec(
        layer_names=("model.layers.0.self_attn",),
        block_size=block_size,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.float32,
    )
    if sliding_window is None:
        return KVCacheConfig(num_blocks=num_blocks, groups=(group,))
    sliding = KVCacheGroupSpec(
        layer_names=("model.layers.1.self_attn",),
        block_size=block_size,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.float32,
        sliding_window=sliding_window,
    )
    return KVCacheConfig(num_blocks=num_blocks, groups=(group, sliding))


def create_scheduler(
    *,
    block_size: int = BLOCK_SIZE,
    num_blocks: int = 64,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    max_model_len: int = 256,
    log_stats: bool = True,
    connector: KVConnectorBase | None = None,
    kv_load_failure_policy: str = "fail",
    kv_events_config: KVEventsConfig | None = None,
    kv_event_publisher: KVEventPublisher | None = None,
    sliding_window: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        make_kv_cache_config(num_blocks, block_size, sliding_window),
        max_model_len=max_model_len,
        log_stats=log_stats,
        connector=connector,
        kv_load_failure_policy=kv_load_failure_policy,
        kv_events_config=kv_events_config,
        kv_event_publisher=kv_event_publisher,
    )


def create_request(
    num_tokens: int = 20,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    request_id: str | None = None,
    block_size: int = BLOCK_SIZE,
    max_tokens: int | None = 16,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (),
    eos_token_ids: tuple[int, ...] = (EOS_TOKEN,),
    cache_salt: str | None = None,
) -> Request:
    """A request with hashes for ``block_size``. Without ``prompt_token_ids`` the prompt is
    ``num_tokens`` ids unique to this request, so requests never share a prefix by accident."""
    n = next(_request_ids)
    if prompt_token_ids is None:
        base = 100_000 * (n + 1)
        prompt_token_ids = range(base, base + num_tokens)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=list(stop_token_ids),
    )
    return Request(
        request_id if request_id is not None else f"req-{n}",
        list(prompt_token_ids),
        params,
        eos_token_ids=eos_token_ids,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(block_size),
    )


def create_requests(count: int, num_tokens: int = 20, **kwargs: object) -> list[Request]:
    return [create_request(num_tokens, **kwargs) for _ in range(count)]  # type: ignore[arg-type]


def _pick(token: TokenSpec, req_id: str, index: int) -> int:
    return token if isinstance(token, int) else token(req_id, index)


def make_runner_output(
    scheduler: Scheduler, sched_out: SchedulerOutput, token: TokenSpec = SAMPLED_TOKEN
) -> ModelRunnerOutput:
    """What a model runner would return for ``sched_out``: one sampled token for each
    request whose scheduled tokens reach the end of its sequence, [] for partial prefill
    chunks. Call it after ``schedule()`` (which already advanced num_computed_tokens)."""
    req_ids = list(sched_out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        req = scheduler.requests[req_id]
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([_pick(token, req_id, req.num_output_tokens)] if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


@dataclass
class _WorkerReq:
    token_ids: list[int]
    block_ids: list[int]  # group 0's table
    num_computed_tokens: int
    num_prompt_tokens: int
    # Every group's table (groups[0] is block_ids).
    groups: list[list[int]] = field(default_factory=list)


class FakeWorker:
    """Mirrors requests from ``SchedulerOutput``s alone, as the real model runner does, and
    asserts the plan is self-consistent: known ids only, positions that line up with what it
    computed before, block tables that cover the scheduled tokens and equal the scheduler's.
    It must see every step of a scheduler from the first one on. Like the real runner it
    accepts a rewind (the scheduler recomputes after a failed KV load) and then drops the
    output tokens the scheduler discarded."""

    def __init__(self, scheduler: Scheduler | None = None, token: TokenSpec = SAMPLED_TOKEN):
        self.scheduler = scheduler
        self.token = token
        self.block_size = scheduler.block_size if scheduler is not None else BLOCK_SIZE
        self.reqs: dict[str, _WorkerReq] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new twice"
            tables = [list(ids) for ids in new.block_ids]
            self.reqs[new.req_id] = _WorkerReq(
                list(new.token_ids), tables[0], new.num_computed_tokens,
                new.num_prompt_tokens, tables,
            )  # fmt: skip
        cached = so.scheduled_cached_reqs
        for req_id, blocks, num_computed, num_output in zip(
            cached.req_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
            cached.num_output_tokens,
            strict=True,
        ):
            state = self.reqs[req_id]
            assert num_computed <= state.num_computed_tokens, f"{req_id}: position skips ahead"
            state.num_computed_tokens = num_computed
            del state.token_ids[state.num_prompt_tokens + num_output :]
            if blocks is not None:
                for table, ids in zip(state.groups, blocks, strict=True):
                    table.extend(ids)
        assert set(so.num_scheduled_tokens) == {r.req_id for r in so.scheduled_new_reqs} | set(
            cached.req_ids
        )
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            state = self.reqs[req_id]
            n = so.num_scheduled_tokens[req_id]
            assert n > 0
            end = state.num_computed_tokens + n
            assert end <= len(state.token_ids), f"{req_id}: scheduled past its tokens"
            assert len(state.block_ids) * self.block_size >= end, f"{req_id}: table too short"
            if self.scheduler is not None:
                self._check_tables(req_id, state, end - n)
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                tok = _pick(self.token, req_id, len(state.token_ids) - state.num_prompt_tokens)
                state.token_ids.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _check_tables(self, req_id: str, state: _WorkerReq, start: int) -> None:
        """Full-attention tables equal the scheduler's. A sliding-window table may keep ids
        the scheduler replaced with the null block, but only for blocks wholly before the
        window of the step's first token (``start``)."""
        assert self.scheduler is not None
        mgr = self.scheduler.kv_cache_manager
        null = mgr.block_pool.null_block
        for manager, ours in zip(mgr.managers, state.groups, strict=True):
            theirs = [b.block_id for b in manager.req_to_blocks[req_id]]
            window = manager.spec.sliding_window
            if window is None:
                assert theirs == ours, f"{req_id}: table differs"
                continue
            assert null is not None and len(theirs) == len(ours), f"{req_id}: table differs"
            first = max(0, start - window + 1) // self.block_size
            for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
                if i < first:
                    assert a in (b, null.block_id), f"{req_id}: block {i} differs"
                else:
                    assert a == b != null.block_id, f"{req_id}: window block {i} differs"


def step(
    scheduler: Scheduler,
    worker: FakeWorker | None = None,
    token: TokenSpec = SAMPLED_TOKEN,
    kv_output: KVOutputSpec = None,
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step: schedule, fake the forward (attaching ``kv_output``, the workers'
    aggregated connector output, or what it returns for the step's plan), update. Checks
    the scheduler's integrity after."""
    so = scheduler.schedule()
    ro = worker.execute(so) if worker is not None else make_runner_output(scheduler, so, token)
    ro.kv_connector_output = kv_output(so) if callable(kv_output) else kv_output
    outs = scheduler.update_from_output(so, ro)
    scheduler.check_integrity()
    return so, outs


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    stop_reasons: dict[str, int | str | None] = field(default_factory=dict)
    sched_outputs: list[SchedulerOutput] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.sched_outputs)


def run_until_done(
    scheduler: Scheduler,
    worker: FakeWorker | None = None,
    token: TokenSpec = SAMPLED_TOKEN,
    max_steps: int = 10_000,
) -> RunResult:
    """Step until no request is left; collect every output. Fails if it does not converge."""
    result = RunResult()
    while scheduler.has_unfinished_requests():
        assert result.num_steps < max_steps, "scheduler made no progress"
        so, outs = step(scheduler, worker, token)
        result.sched_outputs.append(so)
        for out in outs:
            result.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason is not None
                result.finish_reasons[out.request_id] = out.finish_reason
                result.stop_reasons[out.request_id] = out.stop_reason
    return result


def drive(
    s: Scheduler, worker: FakeWorker, sim: Callable[[SchedulerOutput], KVConnectorOutput]
) -> dict[str, EngineCoreOutput]:
    """Step until the scheduler has nothing left (transfers included), ``sim`` making each
    step's connector output; final outputs by id."""
    final: dict[str, EngineCoreOutput] = {}
    for _ in range(200):
        if not s.has_requests():
            return final
        _, outs = step(s, worker, kv_output=sim)
        final.update({o.request_id: o for o in outs if o.finished})
    raise AssertionError("scheduler made no progress")


def out_of(outs: list[EngineCoreOutput], req: Request) -> EngineCoreOutput:
    """``req``'s one output among a step's."""
    (out,) = [o for o in outs if o.request_id == req.request_id]
    return out


def table(s: Scheduler, req: Request) -> list[int]:
    """``req``'s block table (its single KV cache group)."""
    return s.kv_cache_manager.get_block_ids(req.request_id)[0]


def is_cached(s: Scheduler, block_id: int) -> bool:
    """Whether the block is published in the prefix cache."""
    return s.kv_cache_manager.block_pool.blocks[block_id].block_hash is not None


def assert_no_leaks(scheduler: Scheduler) -> None:
    """Leak check for the end of every lifecycle test."""
    mgr = scheduler.kv_cache_manager
    scheduler.check_integrity()
    assert mgr.get_num_free_blocks() == mgr.num_usable_blocks, "blocks still held"
    assert not mgr.req_to_blocks, f"block tables left: {sorted(mgr.req_to_blocks)}"
    assert not scheduler.requests, f"requests left: {sorted(scheduler.requests)}"
    assert not scheduler.waiting and not scheduler.kv_holding and not scheduler.running
    assert not scheduler.has_unfinished_requests()
