"""The conformance kit's engine harness: a tiny random model, engines with the protocol trace
on, reference runs without a connector, stepping, draining and the block-leak check."""

from __future__ import annotations

import heapq
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvferry.engine.arg_utils import EngineArgs
from kvferry.engine.llm_engine import LLMEngine
from kvferry.kv_transfer.trace import read_runs
from kvferry.model.tiny import make_tiny_model
from kvferry.outputs import RequestOutput
from kvferry.sampling_params import SamplingParams

BLOCK_SIZE = 16
# Seconds a drain may take before the kit calls it a hang (delayed loads and lazy stores
# included).
DRAIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Profile:
    """How much work each scenario does: ``quick`` for CI, ``full`` for a connector's author."""

    name: str
    max_tokens: int
    prompts: int
    pool_blocks: int  # the engine's KV pool; the preemption scenarios use a smaller one
    small_pool_blocks: int


PROFILES = {
    "quick": Profile("quick", max_tokens=4, prompts=2, pool_blocks=48, small_pool_blocks=10),
    "full": Profile("full", max_tokens=24, prompts=4, pool_blocks=96, small_pool_blocks=10),
}


@contextmanager
def _trace_env(path: Path) -> Iterator[None]:
    """The protocol trace is switched on by environment when connectors are built. Each
    engine gets a file of its own; it is appended to, never truncated, so that the run markers
    of a tensor-parallel engine's worker processes (which open it before the scheduler side
    does) survive."""
    saved = {k: os.environ.get(k) for k in ("KVFERRY_TRACE_CONNECTOR", "KVFERRY_TRACE_FILE",
                                            "KVFERRY_TRACE_APPEND")}  # fmt: skip
    path.unlink(missing_ok=True)  # a reused workdir: start the engine's file anew
    os.environ.update(KVFERRY_TRACE_CONNECTOR="1", KVFERRY_TRACE_FILE=str(path),
                      KVFERRY_TRACE_APPEND="1")  # fmt: skip
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class Finished:
    """One request's end as the kit saw it."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    external_tokens: int
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class EngineRun:
    """One engine under test: its trace file, the requests it finished, and what it observed
    while stepping (preempted request ids)."""

    engine: LLMEngine
    trace_path: Path | None
    finished: dict[str, Finished] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    steps: int = 0

    def add(self, prompt: list[int], params: SamplingParams, request_id: str) -> None:
        self.engine.add_request({"prompt_token_ids": prompt}, params, request_id=request_id)

    def step(self) -> list[RequestOutput]:
        outs = self.engine.step()
        self.steps += 1
        for rid, req in self.engine.scheduler.requests.items():
            if req.num_preemptions > 0:
                self.preempted.add(rid)
        for out in outs:
            if out.finished:
                c = out.outputs[0]
                m = out.metrics
                self.finished[out.request_id] = Finished(
                    out.request_id, list(c.token_ids), c.finish_reason,
                    m.num_external_cached_tokens if m else 0, out.error, out.kv_transfer_params,
                )  # fmt: skip
        return outs

    def run(
        self,
        prompts: dict[str, list[int]],
        params: SamplingParams,
        on_step: Callable[[EngineRun], None] | None = None,
    ) -> dict[str, Finished]:
        for rid, prompt in prompts.items():
            self.add(prompt, params, rid)
        return self.wait(list(prompts), on_step)

    def wait(
        self, request_ids: list[str], on_step: Callable[[EngineRun], None] | None = None
    ) -> dict[str, Finished]:
        """Step until the requests added as ``request_ids`` finished."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while any(rid not in self.finished for rid in request_ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests unfinished after {DRAIN_TIMEOUT_S:.0f}s")
            self.step()
            if on_step is not None:
                on_step(self)
        return {rid: self.finished[rid] for rid in request_ids}

    def drain(self) -> None:
        """Step until no request is left and the connector has no pending work."""
        connector = self.engine.scheduler.connector
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.engine.has_unfinished_requests() or (
            connector is not None and connector.has_pending_work()
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not drain within {DRAIN_TIMEOUT_S:.0f}s")
            if not self.engine.has_unfinished_requests():
                time.sleep(0.002)  # the connector's transfers run on its own threads
            self.step()

    def leaks(self) -> list[str]:
        """What is left over once drained: blocks not back in the free pool, requests."""
        sched = self.engine.scheduler
        problems = []
        try:
            sched.kv_cache_manager.check_integrity()
        except AssertionError as e:
            problems.append(f"KV cache manager integrity: {e}")
        free = sched.kv_cache_manager.get_num_free_blocks()
        total = self.engine.kv_cache_config.num_blocks
        if free != total:
            problems.append(f"{total - free} of {total} blocks not returned to the free pool")
        if sched.requests:
            problems.append(f"requests still held: {sorted(sched.requests)}")
        return problems

    def shutdown(self) -> None:
        self.engine.shutdown()

    @property
    def world_size(self) -> int:
        return int(getattr(self.engine.executor, "world_size", 1))

    def records(self) -> list[dict[str, Any]]:
        """The whole trace in time order; a tensor-parallel engine's worker-side records carry
        their ``rank``."""
        return list(heapq.merge(*self._by_process().values(), key=lambda r: r.get("t", 0.0)))

    def rank_records(self) -> dict[int, list[dict[str, Any]]]:
        """Per rank, the scheduler side's records and that rank's worker-side ones in time
        order: what one worker's connector and the scheduler's saw, as in a one-worker run."""
        procs = self._by_process()
        scheduler = [r for recs in procs.values() for r in recs if r.get("rank") is None]
        ranks = sorted({r["rank"] for recs in procs.values() for r in recs if "rank" in r})
        if not ranks:
            return {0: self.records()}
        return {
            rank: list(heapq.merge(scheduler, [r for recs in procs.values() for r in recs
                                               if r.get("rank") == rank],
                                   key=lambda r: r.get("t", 0.0)))
            for rank in ranks
        }  # fmt: skip

    def _by_process(self) -> dict[Any, list[dict[str, Any]]]:
        """The trace's records per writing process (each list in its own order), worker-side
        records of a tensor-parallel engine tagged with their rank (from the run marker's pid
        and the executor's worker pids)."""
        if self.trace_path is None or not self.trace_path.exists():
            return {}
        pids = list(getattr(self.engine.executor, "worker_pids", []))
        out: dict[Any, list[dict[str, Any]]] = {}
        for n, run in enumerate(read_runs(self.trace_path)):
            pid = run.marker.get("pid") if run.marker else None
            rank = pids.index(pid) if pid in pids else None
            recs = out.setdefault(pid if pid is not None else f"run{n}", [])
            for r in run.records:
                recs.append({**r, "rank": rank} if rank is not None and
                            r.get("role") == "worker" else r)  # fmt: skip
        return out


class Harness:
    """Builds engines on one tiny model; caches reference (no-connector) outputs."""

    def __init__(self, profile: str = "quick", workdir: str | Path | None = None) -> None:
        self.profile = PROFILES[profile]
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="kvferry-conf-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir = make_tiny_model(
            self.workdir / "model", hidden=64, layers=2, heads=4, kv_heads=2, vocab=512,
            intermediate=128,
        )  # fmt: skip
        self.params = SamplingParams(
            temperature=0.0, max_tokens=self.profile.max_tokens, ignore_eos=True
        )
        self._refs: dict[tuple[tuple[int, ...], int | None, int], list[int]] = {}
        self._tp_refs: dict[int, EngineRun] = {}  # tensor-parallel reference engines, by size
        self._n = 0

    def engine_args(self, kv: dict[str, Any] | None, **overrides: Any) -> EngineArgs:
        args: dict[str, Any] = {
            "model": str(self.model_dir), "dtype": "float32", "max_model_len": 256,
            "max_num_batched_tokens": 256, "block_size": BLOCK_SIZE,
            "num_kv_blocks": self.profile.pool_blocks, "log_stats": False,
        }  # fmt: skip
        args.update(overrides)
        if kv is not None:
            args["kv_transfer_config"] = kv
        return EngineArgs(**args)

    def engine(self, kv: dict[str, Any] | None, **overrides: Any) -> EngineRun:
        args = self.engine_args(kv, **overrides)
        if kv is None:
            return EngineRun(LLMEngine.from_engine_args(args), None)
        self._n += 1
        path = self.workdir / "traces" / f"engine-{self._n}.jsonl"
        with _trace_env(path):
            engine = LLMEngine.from_engine_args(args)
        return EngineRun(engine, path)

    def reference(
        self, prompts: dict[str, list[int]], params: SamplingParams, tensor_parallel_size: int = 1
    ) -> dict[str, list[int]]:
        """Greedy outputs of an engine without a connector (computed once per prompt). With
        ``tensor_parallel_size`` > 1, of an engine of that many workers, started once and kept
        until :meth:`close` (its start-up costs more than its runs)."""
        tp = tensor_parallel_size
        todo = {r: p for r, p in prompts.items()
                if (tuple(p), params.max_tokens, tp) not in self._refs}  # fmt: skip
        if todo:
            if tp == 1:
                run = self.engine(None)
            else:
                if tp not in self._tp_refs:
                    self._tp_refs[tp] = self.engine(None, tensor_parallel_size=tp)
                run = self._tp_refs[tp]
                run.engine.scheduler.kv_cache_manager.reset_prefix_cache()
            for rid, fin in run.run({f"ref{self._n}-{r}": p for r, p in todo.items()},
                                    params).items():  # fmt: skip
                self._refs[(tuple(todo[rid.split("-", 1)[1]]), params.max_tokens, tp)] = (
                    fin.token_ids
                )
            self._n += 1
            if tp == 1:
                run.shutdown()
        return {r: self._refs[(tuple(p), params.max_tokens, tp)] for r, p in prompts.items()}

    def close(self) -> None:
        for run in self._tp_refs.values():
            run.shutdown()
        self._tp_refs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
