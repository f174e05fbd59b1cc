"""What KV cache events cost the engine: throughput with events on vs off, in one process.

Two offline engines on the same model, one with ``kv_events_config`` on (ZMQ publisher on
127.0.0.1 with a subscriber reading the stream, as a router would) and one without. Every
round runs the same fresh shared-prefix prompts on both (so blocks enter and leave the prefix
cache and events flow), in alternating order, after a prefix-cache reset. Reported: the median
over rounds of the paired throughput loss with a 95% bootstrap interval, the paired
engine-thread CPU change, and the publisher thread's CPU as a share of the run (these two do
not depend on machine noise). Target: <= 1% loss.

    .venv/bin/python benchmarks/kv_events_cost.py              # tiny and mid, fp32
    .venv/bin/python benchmarks/kv_events_cost.py --quick      # smoke run
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.cli import fill_quick_defaults, log
from benchmarks.harness.connector_cost import paired_summary, side_cpu_delta, side_thread_cpu
from benchmarks.harness.engines import make_llm
from benchmarks.harness.kv_events import EventCounter
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.models import get_model, model_vocab_size
from benchmarks.harness.prompts import random_tokens
from benchmarks.harness.quiet import read_loadavg, wait_until
from benchmarks.harness.results import result_path, run_header, write_json
from benchmarks.harness.timing import alternating

ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 2048,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompts(n: int, prefixes: int, prefix_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"events-cost-{seed}")
    shared = [random_tokens(rng, prefix_len, vocab) for _ in range(prefixes)]
    return [shared[i % prefixes] + random_tokens(rng, 64, vocab) for i in range(n)]


def _run(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from kvferry import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def measure(model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    model = get_model(model_name)
    vocab = model_vocab_size(model)
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    events = {"enable_kv_cache_events": True, "endpoint": endpoint}
    engines = {
        "off": make_llm(model, "float32", **ENGINE_ARGS),
        "on": make_llm(model, "float32", kv_events_config=events, **ENGINE_ARGS),
    }
    counter = EventCounter(endpoint)
    try:
        for llm in engines.values():  # warm-up
            _run(llm, _prompts(args.prompts, args.prefixes, args.prefix_len, vocab, -1), 8)
        times: dict[str, list[float]] = {m: [] for m in engines}
        cpu: dict[str, list[float]] = {m: [] for m in engines}
        side = dict.fromkeys(engines, 0.0)
        identical = True
        for r in range(args.rounds):
            prompts = _prompts(args.prompts, args.prefixes, args.prefix_len, vocab, r)
            ref = None
            for mode in alternating(list(engines), r):
                llm = engines[mode]
                llm.engine.scheduler.reset_prefix_cache()
                s0, c0 = side_thread_cpu(), time.thread_time()
                elapsed, out = _run(llm, prompts, args.max_tokens)
                cpu[mode].append(time.thread_time() - c0)
                side[mode] += side_cpu_delta(s0, side_thread_cpu())
                times[mode].append(elapsed)
                identical = identical and (ref is None or out == ref)
                ref = out if ref is None else ref
        time.sleep(0.5)
        batches = counter.batches
    finally:
        counter.close()
        for llm in engines.values():
            llm.shutdown()
    if batches == 0:
        raise RuntimeError("the events-on engine published nothing")
    off_s = sum(times["off"])
    return {
        "model": model_name,
        "loss": paired_summary([1 - o / n for n, o in zip(times["on"], times["off"], strict=True)]),
        "engine_cpu": paired_summary(
            [n / o - 1 for n, o in zip(cpu["on"], cpu["off"], strict=True)]
        ),
        "side_cpu_share_delta": (side["on"] - side["off"]) / off_s,
        "tok_s": {
            m: args.prompts * args.max_tokens / statistics.median(t) for m, t in times.items()
        },
        "batches_received": batches,
        "identical_outputs": identical,
        "seconds": times,
    }


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    table = []
    for r in rows:
        lo, hi = r["loss"]["ci95"]
        table.append(
            [
                f"{r['model']} fp32",
                f"{r['tok_s']['off']:.1f}",
                f"{r['tok_s']['on']:.1f}",
                f"{_pct(r['loss']['median'])} [{_pct(lo)}, {_pct(hi)}]",
                _pct(r["engine_cpu"]["median"]),
                _pct(r["side_cpu_share_delta"]),
                str(r["batches_received"]),
                str(r["identical_outputs"]),
            ]
        )
    head = [
        "model", "tok/s off", "tok/s on", "loss: median of paired rounds [95% bootstrap]",
        "engine-thread CPU on vs off", "other threads' CPU (publisher), share of run",
        "batches received", "identical outputs",
    ]  # fmt: skip
    return (
        f"## KV events cost ({args.rounds} paired rounds; {args.prompts} prompts = "
        f"{args.prefixes} shared {args.prefix_len}-token prefixes + 64 own tokens, "
        f"{args.max_tokens} output tokens)\n\n{markdown_table(head, table)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None, help="comma-separated (default tiny,mid)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--allow-noise", action="store_true")
    args = ap.parse_args()
    fill_quick_defaults(
        args, models=("tiny", "tiny,mid"), rounds=(2, 8), prompts=(16, 64), max_tokens=(8, 64)
    )
    if not args.allow_noise:
        wait_until(read_loadavg, 1.0, 300, "1-minute load average", log)
    rows = []
    for name in args.models.split(","):
        log(f"{name}: {args.rounds} rounds")
        rows.append(measure(name, args))
    out = write_json(result_path("kv_events_cost", args.quick), {**run_header(), "rows": rows})
    print(report(rows, args))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
