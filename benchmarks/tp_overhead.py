"""The per-step cost of the tensor-parallel engine/worker boundary (target: <= 1 ms at 64
running requests).

What is timed is ``MultiprocExecutor.execute_model`` with stand-in workers that answer at once
with a prebuilt output: pickling the SchedulerOutput once, writing it to every rank's pipe,
each rank unpickling it and pickling its reply, reading and unpickling the replies and
aggregating the ranks' KV-connector outputs. No forward runs, so this is the boundary alone,
as the engine pays it on top of the model every step. Cases: decode steps of R running
requests (a new block for one in 16), and one prefill step of R new 512-token prompts.
With ``--engine`` the full run also times real tiny TP=1 and TP=2 engines decoding R requests
(the difference includes the all-reduces, not just the boundary).

    .venv/bin/python benchmarks/tp_overhead.py --quick      # smoke run
    .venv/bin/python benchmarks/tp_overhead.py --engine     # full run, on a quiet machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvferry.config import EngineConfig
from kvferry.engine.arg_utils import EngineArgs
from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvferry.model.tiny import make_tiny_model
from kvferry.sampling_params import SamplingParams
from kvferry.step_types.runner_output import ModelRunnerOutput
from kvferry.step_types.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / ".bench" / "models" / "tp-overhead-tiny"


class EchoWorker:
    """Stands in for a Worker: answers each step with an output shaped like a real one."""

    kv_connector = None

    def __init__(self, config: EngineConfig, rank: int) -> None:
        import torch

        self.rank = rank
        group = KVCacheGroupSpec(("l0",), 16, 1, 64, torch.float32)
        self.kv_cache_config = KVCacheConfig(num_blocks=1024, groups=(group,))

    def get_kv_connector_handshake_metadata(self) -> None:
        return None

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=[[7] for _ in ids], logprobs=[None] * len(ids)
        )

    def shutdown(self) -> None:
        pass


def decode_step(n: int, step: int) -> SchedulerOutput:
    ids = [f"cmpl-{i:08x}-0" for i in range(n)]
    new_blocks: list[tuple[list[int], ...] | None] = [
        ([step * n + i],) if (i + step) % 16 == 0 else None for i in range(n)
    ]
    cached = CachedRequestData(
        req_ids=ids,
        new_block_ids=new_blocks,
        num_computed_tokens=[600 + step] * n,
        num_output_tokens=[88 + step] * n,
    )
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=n,
    )


def prefill_step(n: int, prompt_len: int = 512) -> SchedulerOutput:
    sp = SamplingParams(temperature=0.0, max_tokens=128)
    news = [
        NewRequestData(
            req_id=f"cmpl-{i:08x}-0",
            token_ids=list(range(prompt_len)),
            num_prompt_tokens=prompt_len,
            sampling_params=sp,
            block_ids=(list(range(i * 32, i * 32 + 32)),),
            num_computed_tokens=0,
        )
        for i in range(n)
    ]
    return SchedulerOutput(
        scheduled_new_reqs=news,
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={r.req_id: prompt_len for r in news},
        total_num_scheduled_tokens=n * prompt_len,
    )


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median_us": statistics.median(s) * 1e6,
        "p90_us": s[int(0.9 * (len(s) - 1))] * 1e6,
        "max_us": s[-1] * 1e6,
    }


def boundary(config: EngineConfig, running: int, steps: int) -> dict[str, Any]:
    from kvferry.worker.multiproc_executor import MultiprocExecutor

    ex = MultiprocExecutor(config, worker_factory=EchoWorker)
    try:
        plans = [decode_step(running, s) for s in range(steps)]
        for so in plans[:20]:  # warm-up
            ex.execute_model(so)
        times = []
        for so in plans:
            t0 = time.perf_counter()
            out = ex.execute_model(so)
            times.append(time.perf_counter() - t0)
            assert len(out.req_ids) == running
        pre = prefill_step(running)
        t0 = time.perf_counter()
        ex.execute_model(pre)
        prefill_s = time.perf_counter() - t0
    finally:
        ex.shutdown()
    return {"running": running, "decode": _stats(times), "prefill_step_us": prefill_s * 1e6}


def engine_decode(model: str, tp: int, running: int, tokens: int) -> float:
    from kvferry import LLM

    llm = LLM(model=model, dtype="float32", max_model_len=256, tensor_parallel_size=tp)
    try:
        prompts = [{"prompt_token_ids": [5 + i % 100, 6, 7, 8]} for i in range(running)]
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts[:2], sp, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return (time.perf_counter() - t0) / tokens
    finally:
        llm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: few steps, TP=2 only")
    ap.add_argument("--tp", type=int, nargs="*", default=None, help="sizes (default 2 4)")
    ap.add_argument("--running", type=int, nargs="*", default=None, help="default 16 64 256")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 500)")
    ap.add_argument("--engine", action="store_true", help="also time real tiny engines")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    sizes = args.tp or ([2] if args.quick else [2, 4])
    running = args.running or ([64] if args.quick else [16, 64, 256])
    steps = args.steps or (50 if args.quick else 500)
    if not (MODEL_DIR / "config.json").is_file():
        make_tiny_model(MODEL_DIR, arch="llama", heads=4, kv_heads=4)
    rows = []
    for tp in sizes:
        config = EngineArgs(
            model=str(MODEL_DIR), dtype="float32", max_model_len=256, tensor_parallel_size=tp
        ).create_engine_config()
        for r in running:
            row = {"tp": tp, **boundary(config, r, steps)}
            rows.append(row)
            d = row["decode"]
            print(
                f"TP={tp} running={r:4d}: decode step boundary median {d['median_us']:7.1f} us "
                f"p90 {d['p90_us']:7.1f} us max {d['max_us']:7.1f} us; "
                f"prefill step of {r} x 512 tokens {row['prefill_step_us']:8.1f} us",
                flush=True,
            )
    result: dict[str, Any] = {"boundary": rows}
    if args.engine and not args.quick:
        per_token = {tp: engine_decode(str(MODEL_DIR), tp, 64, 64) for tp in [1, *sizes]}
        result["engine_s_per_step_64_running"] = per_token
        for tp, s in per_token.items():
            print(f"engine TP={tp}: {s * 1e3:.2f} ms per decode step at 64 running", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
