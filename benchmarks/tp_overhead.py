"""The per-step cost of the tensor-parallel engine/worker boundary (target: <= 1 ms at 64
running requests).

What is timed is ``MultiprocExecutor.execute_model`` with stand-in workers that answer at once
with a prebuilt output: pickling the SchedulerOutput once, writing it to every rank's pipe,
each rank unpickling it and pickling its reply, reading and unpickling the replies and
aggregating the ranks' KV-connector outputs. No forward runs, so this is the boundary alone,
as the engine pays it on top of the model every step. Cases: decode steps of R running
requests (a new block for one in 16), and one prefill step of R new 512-token prompts.
With ``--engine`` the full run also times real TP=1 and TP=N engines on a bench model
(``--model``, default ``mid``; sizes up to the core count) decoding 64 requests, launches
alternating (the difference includes the all-reduces, not just the boundary).

    .venv/bin/python benchmarks/tp_overhead.py --quick      # smoke run
    .venv/bin/python benchmarks/tp_overhead.py --engine --docs   # full run, quiet machine
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


def engine_decode(model: str, tp: int, running: int, tokens: int, dtype: str) -> dict[str, float]:
    """Decode ``tokens`` tokens for ``running`` requests of 64-token prompts on one engine:
    seconds per step and output tokens/s (prefill excluded: it runs in a first pass)."""
    from kvferry import LLM

    llm = LLM(model=model, dtype=dtype, max_model_len=512, tensor_parallel_size=tp)
    try:
        prompts = [
            {"prompt_token_ids": [5 + (i * 7 + j) % 200 for j in range(64)]} for i in range(running)
        ]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        # Prefill (and cache) the prompts first, so the timed pass is decode steps only.
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return {"s_per_step": seconds / tokens, "tok_per_s": running * tokens / seconds}
    finally:
        llm.shutdown()


def engine_rows(args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    """TP=1 and each TP size on the bench model, launches alternating over ``args.rounds``."""
    from benchmarks.harness.models import bench_model
    from benchmarks.harness.timing import alternating

    model = str(bench_model(args.model))
    runs: dict[int, list[dict[str, float]]] = {tp: [] for tp in [1, *sizes]}
    for i in range(args.rounds):
        for tp in alternating(list(runs), i):
            r = engine_decode(model, tp, args.engine_running, args.engine_tokens, args.dtype)
            runs[tp].append(r)
            print(
                f"engine {args.model} TP={tp}: {r['s_per_step'] * 1e3:.1f} ms per decode step, "
                f"{r['tok_per_s']:.1f} tok/s at {args.engine_running} running",
                flush=True,
            )
    return {
        str(tp): {
            "s_per_step": statistics.median(x["s_per_step"] for x in rs),
            "tok_per_s": statistics.median(x["tok_per_s"] for x in rs),
            "runs": rs,
        }
        for tp, rs in runs.items()
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    from benchmarks.harness.markdown import markdown_table

    rows = [
        [
            r["tp"],
            r["running"],
            r["decode"]["median_us"] / 1e3,
            r["decode"]["p90_us"] / 1e3,
            r["prefill_step_us"] / 1e3,
        ]
        for r in result["boundary"]
    ]
    out = [
        "Engine/worker boundary per step (stand-in workers, no forward):",
        "",
        markdown_table(
            ["TP", "running", "decode step median ms", "p90 ms", "prefill step ms (512 tok each)"],
            rows,
        ),
    ]
    engine = result.get("engine")
    if engine:
        base = engine["1"]["tok_per_s"]
        erows = [
            [f"TP={tp}", e["s_per_step"] * 1e3, e["tok_per_s"], e["tok_per_s"] / base]
            for tp, e in engine.items()
        ]
        out += [
            "",
            f"Engines on `{args.model}` {args.dtype}, {args.engine_running} running requests, "
            f"{args.engine_tokens} decode steps, median of {args.rounds} alternating launches:",
            "",
            markdown_table(["engine", "ms per decode step", "tok/s", "vs TP=1"], erows),
        ]
    m = result["machine"]
    cpu = m.get("kvferry_cpu") or {}
    out += [
        "",
        f"Machine: {m.get('cpu_model', m.get('processor', '?'))}, {m.get('cpu_count')} CPUs, "
        f"ISA flags {', '.join(m.get('isa', [])) or '-'}, kvferry CPU path {cpu.get('isa', '?')}; "
        f"torch {m.get('torch', '?')}; commit {m.get('git_commit', '?')}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}. Command: `benchmarks/tp_overhead.py --engine "
        f"--model {args.model} --docs`.",
    ]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: few steps, TP=2 only")
    ap.add_argument("--tp", type=int, nargs="*", default=None, help="sizes (default 2 4)")
    ap.add_argument("--running", type=int, nargs="*", default=None, help="default 16 64 256")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 500)")
    ap.add_argument("--engine", action="store_true", help="also time real TP=1 / TP=N engines")
    ap.add_argument("--model", default="mid", help="bench model for --engine (default mid)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2, help="--engine: launches per TP size")
    ap.add_argument("--engine-running", type=int, default=64)
    ap.add_argument("--engine-tokens", type=int, default=32)
    ap.add_argument("--docs", action="store_true", help="write the tables into docs/benchmarks.md")
    ap.add_argument("--allow-noise", action="store_true", help="measure on a busy machine")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    sizes = args.tp or ([2] if args.quick else [2, 4])
    running = args.running or ([64] if args.quick else [16, 64, 256])
    steps = args.steps or (50 if args.quick else 500)
    if not args.quick and not args.allow_noise:
        from benchmarks.harness.cli import log
        from benchmarks.harness.quiet import read_loadavg, wait_until

        wait_until(read_loadavg, 1.0, 300, "1-minute load average", log)
    if not (MODEL_DIR / "config.json").is_file():
        make_tiny_model(MODEL_DIR, arch="llama", heads=4, kv_heads=4)
    from benchmarks.harness.machine import machine_info

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
    result: dict[str, Any] = {"boundary": rows, "machine": machine_info()}
    if args.engine and not args.quick:
        result["engine"] = engine_rows(args, [t for t in sizes if t <= (os_cpus() or 1)])
    text = report(result, args)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    if args.docs and not args.quick:
        from benchmarks.harness.markdown import update_doc

        update_doc("tp-overhead", text)
    return 0


def os_cpus() -> int | None:
    import os

    return os.cpu_count()


if __name__ == "__main__":
    sys.exit(main())
