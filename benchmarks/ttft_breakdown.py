"""Where a request's time before its first token goes, under online load (issue #13).

Starts ``kvferry serve`` (the serving benchmark's settings, ``KVFERRY_LOG_LEVEL=DEBUG`` so the
engine writes its ``kvferry.timeline`` lines, see :mod:`kvferry.core.timeline`), sends
streaming completions of random token-id prompts at Poisson arrivals (greedy, ``ignore_eos``)
from its own client, and lines up per request:

    send (client) -> submit (server handed it to the engine thread: HTTP + tokenization)
    -> added (engine thread enqueued it: waited for the step in flight)
    -> scheduled (first step that plans its prefill) -> each prefill chunk's step
    -> first (first token handed to its stream) -> recv (client got the first chunk)

and prints the mean / p50 / p90 of each gap, and what the steps that ran its prefill held.

    .venv/bin/python benchmarks/ttft_breakdown.py --model mid --rate 0.5 --num 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.harness.models import bench_model
from benchmarks.harness.paths import RESULTS_DIR
from benchmarks.harness.vllm_env import default_vllm_python
from benchmarks.harness.vllm_server import ServerSettings, serving

_FIELD = re.compile(r"(\w+)=(\S+)")


@dataclass
class Timing:
    send: float = 0.0
    recv: float = 0.0
    rid: str = ""


@dataclass
class Step:
    sched: float
    t0: float
    t1: float
    prefill: dict[str, int]
    decodes: int
    tokens: int


@dataclass
class Trace:
    added: dict[str, tuple[float, float]] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)


def parse_log(text: str) -> Trace:
    """The ``tl`` lines of a server log (a ``sched`` line is followed by its ``step`` line)."""
    trace, pending = Trace(), None
    for line in text.splitlines():
        if "] tl " not in line:
            continue
        event = line.split("] tl ", 1)[1].split(" ", 1)[0]
        f = dict(_FIELD.findall(line))
        if event == "added":
            trace.added[f["id"]] = (float(f["submit"]), float(f["added"]))
        elif event == "first":
            trace.first[f["id"]] = float(f["t"])
        elif event == "sched":
            chunks = (
                {}
                if f["prefill"] == "-"
                else dict(
                    (c.split(":")[0], int(c.split(":")[1].split("@")[0]))
                    for c in f["prefill"].split(",")
                )
            )
            pending = (float(f["t"]), chunks, int(f["decodes"]), int(f["tokens"]))
        elif event == "step" and pending is not None:
            t, chunks, dec, tok = pending
            trace.steps.append(Step(t, float(f["t0"]), float(f["t1"]), chunks, dec, tok))
            pending = None
    return trace


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], out_len: int, timing: Timing
) -> None:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": out_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    timing.send = time.time()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not timing.rid:
                timing.rid = f"{chunk['id']}-0"
            # As vllm bench serve: the first chunk with a choice counts, text or not.
            if timing.recv == 0.0 and chunk.get("choices"):
                timing.recv = time.time()


async def drive(url: str, args: argparse.Namespace, vocab: int) -> list[Timing]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num)]
    timings = [Timing() for _ in prompts]
    async with httpx.AsyncClient(timeout=600.0) as client:
        # Warm-up, not counted (its own prompt: no prefix-cache hit for the measured ones).
        warm = [rng.randrange(10, vocab) for _ in range(64)]
        await one_request(client, url, warm, 4, Timing())
        tasks = []
        for p, t in zip(prompts, timings, strict=True):
            tasks.append(asyncio.create_task(one_request(client, url, p, args.output_len, t)))
            if args.rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    return timings


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    if not xs:
        return "-"
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return f"{1e3 * statistics.mean(xs):8.1f} {1e3 * statistics.median(xs):8.1f} {1e3 * p90:8.1f}"


def report(timings: list[Timing], trace: Trace) -> dict[str, list[float]]:
    gaps: dict[str, list[float]] = {
        k: []
        for k in (
            "http+tokenize (send->submit)",
            "engine pickup (submit->added)",
            "queued (added->first sched)",
            "prefill steps (first sched->last chunk end)",
            "  of which: own prefill tokens' share",
            "to stream (step end->first)",
            "to client (first->recv)",
            "TTFT (send->recv)",
        )
    }
    names = list(gaps)
    mixes: list[str] = []
    for t in timings:
        if t.rid not in trace.added or t.rid not in trace.first:
            continue
        submit, added = trace.added[t.rid]
        mine = [s for s in trace.steps if t.rid in s.prefill]
        if not mine:
            continue
        own = sum(s.prefill[t.rid] / max(1, s.tokens) * (s.t1 - s.t0) for s in mine)
        vals = [
            submit - t.send,
            added - submit,
            mine[0].sched - added,
            mine[-1].t1 - mine[0].sched,
            own,
            trace.first[t.rid] - mine[-1].t1,
            t.recv - trace.first[t.rid],
            t.recv - t.send,
        ]
        for k, v in zip(names, vals, strict=True):
            gaps[k].append(v)
        mixes.append(
            " | ".join(
                f"{len(s.prefill)}pf/{s.decodes}dec/{s.tokens}tok {1e3 * (s.t1 - s.t0):.0f}ms"
                for s in mine
            )
        )
    print(f"{'ms':46s} {'mean':>8s} {'p50':>8s} {'p90':>8s}")
    for name, samples in gaps.items():
        print(f"{name:46s} {_stats(samples)}")
    steps = trace.steps
    pf = [s.t1 - s.t0 for s in steps if s.prefill]
    dec = [s.t1 - s.t0 for s in steps if not s.prefill and s.decodes]
    print(f"steps with a prefill chunk: {len(pf)}, ms {_stats(pf)}")
    # Against an offline lone prefill of the same length: what serving costs a step (threads
    # of the HTTP side and of the client competing with the kernels for the cores).
    lone = [s.t1 - s.t0 for s in steps if len(s.prefill) == 1 and not s.decodes]
    mixed = [s.t1 - s.t0 for s in steps if len(s.prefill) == 1 and s.decodes]
    print(f"  one prefill, no decodes:  {len(lone)}, ms {_stats(lone)}")
    print(f"  one prefill + decodes:    {len(mixed)}, ms {_stats(mixed)}")
    print(f"decode-only steps:          {len(dec)}, ms {_stats(dec)}")
    gaps_between = [b.sched - a.t1 for a, b in zip(steps, steps[1:], strict=False)]
    print(f"engine-thread gap step end -> next sched, ms {_stats(gaps_between)}")
    print("prefill steps per request (prefills/decodes/tokens duration):")
    for m in mixes:
        print("  " + m)
    return gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="mid")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--num", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--json", type=Path, default=None, help="write the per-gap samples here")
    args = ap.parse_args()
    max_len = max(2048, args.input_len + args.output_len)  # as serving.py sizes it
    model_dir = bench_model(args.model, max_len)
    cfg = json.loads((model_dir / "config.json").read_text())
    settings = ServerSettings(
        model_dir=model_dir,
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    os.environ["KVFERRY_LOG_LEVEL"] = "DEBUG"
    logs = RESULTS_DIR / "ttft_breakdown"
    with serving("kvferry", settings, logs, default_vllm_python()) as server:
        timings = asyncio.run(drive(server.url, args, int(cfg["vocab_size"])))
        time.sleep(0.5)  # let the last log lines reach the file
        text = (logs / "kvferry.log").read_text(errors="replace")
    gaps = report(timings, parse_log(text))
    if args.json:
        args.json.write_text(json.dumps(gaps))


if __name__ == "__main__":
    main()
