"""KV shared across engine instances through a Mooncake Store (MooncakeStoreConnector).

Every part starts its own ``mooncake_master`` on 127.0.0.1 with a standalone storage client
(``MooncakeMaster``: the store's memory outlives any engine) and stops it at the end.

* ``ttft``: two ``kvferry serve`` processes, A and B, on one master, the ``mid`` model in
  bf16, ``--prompt-len`` tokens, ``max_tokens=1``, TTFT of a streamed request. **store**: A
  computes a new prompt (and stores it); once A's counters (``put_chunks`` +
  ``store_dedup_chunks``) show every chunk in the store, B serves the same prompt from the
  store. **recompute**: B gets a fresh prompt of the same length (a lookup miss: the whole
  prompt is prefilled). The modes alternate per repetition; median and spread. Target:
  store >= 10x faster.
  Why separate server processes: that is how a second instance runs (no memory or KV pool
  in common, only the store), and a streamed request measures the TTFT a client sees.
* ``bandwidth``: the connector's worker half driven directly (no model) on a pool of the
  model's KV shape: a load of ``--bw-tokens`` tokens' chunks (get + checks + copy into the
  pool) vs a raw ``MooncakeDistributedStore.batch_get_into`` of the same values into a
  registered buffer, alternating in one process (see ``harness/store_bandwidth.py``).
  Target: connector >= 70% of raw.
* ``workload``: two instances with the store and two without, the same shared-prefix
  workload on each pair (``--systems`` system prompts, ``--requests`` requests with their
  own suffixes, round robin over the pair so that each system prompt is used on both
  instances, Poisson arrivals), rounds alternating on/off, fresh system prompts per round;
  mean TTFT and total time.

    .venv/bin/python benchmarks/shared_store.py                 # full run, writes docs
    .venv/bin/python benchmarks/shared_store.py --quick         # smoke run: tiny model
    .venv/bin/python benchmarks/shared_store.py --parts ttft,bandwidth
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.cli import fill_quick_defaults, log
from benchmarks.harness.models import bench_model, model_vocab_size
from benchmarks.harness.prompts import random_tokens
from benchmarks.harness.quiet import read_loadavg, wait_until
from benchmarks.harness.results import result_path, run_header, write_results_json
from benchmarks.harness.store_bandwidth import KVGeometry, measure_bandwidth
from benchmarks.harness.store_report import load_previous, write_report
from benchmarks.harness.store_serving import (
    run_workload,
    serve_flags,
    start_instances,
    store_kv,
    totals,
    ttft,
    wait_ready,
    wait_settled,
    wait_stored,
)
from benchmarks.harness.timing import alternating
from kvferry.entrypoints.demo import Instance, stop
from kvferry.kv_transfer.stores.master import MooncakeMaster

PARTS = ("ttft", "bandwidth", "workload")
BLOCK = 16


def _master(args: argparse.Namespace, logs: Path, part: str) -> MooncakeMaster:
    return MooncakeMaster(segment_bytes=args.segment_mib << 20, log_dir=str(logs / f"{part}-mc"))


def ttft_part(args: argparse.Namespace, model: Path, vocab: int, logs: Path) -> dict[str, Any]:
    n = args.prompt_len
    ct = BLOCK * args.blocks_per_chunk
    chunks = n // ct  # a computed prompt stores every whole chunk
    expected_hit = (n - 1) // ct * ct  # the last token is never offered
    flags = serve_flags(args.dtype, n + 64, args.batch_tokens, 2 * (n + 64) // BLOCK + 16)
    rng = random.Random("shared-store-ttft")
    stored = {"A": 0.0, "B": 0.0}
    times: dict[str, list[float]] = {"recompute": [], "store": []}
    hits: dict[str, list[float]] = {"recompute": [], "store": []}
    with _master(args, logs, "ttft") as master:
        insts: list[Instance] = []
        try:
            a, b = start_instances(insts, ["ttft-A", "ttft-B"], model, logs, flags,
                                   store_kv(master, args.blocks_per_chunk))  # fmt: skip
            wait_ready(insts)

            def on_b(prompt: list[int]) -> tuple[float, float]:
                before = totals(b).get("hit_tokens", 0.0)
                t = ttft(b, prompt)

                def target(stats: dict[str, float]) -> float:
                    # B stores the chunks it computed (a hit's last chunk is a dedup put).
                    hit = stats.get("hit_tokens", 0.0) - before
                    return stored["B"] + chunks - hit // ct

                stats = wait_stored(b, target)  # its puts must not run into the next rep
                stored["B"] = target(stats)
                return t, stats.get("hit_tokens", 0.0) - before

            def measure(mode: str) -> tuple[float, float]:
                prompt = random_tokens(rng, n, vocab)
                if mode == "store":
                    ttft(a, prompt)
                    stored["A"] += chunks
                    wait_stored(a, stored["A"])  # every chunk is in the store now
                return on_b(prompt)

            for mode in ("store", "recompute"):  # warm-up of both paths, not counted
                measure(mode)
            for i in range(args.reps):
                for mode in alternating(("recompute", "store"), i):
                    t, hit = measure(mode)
                    times[mode].append(t)
                    hits[mode].append(hit)
                    log(f"ttft rep {i + 1}/{args.reps} {mode:>9}: {t * 1e3:8.1f} ms, "
                        f"{hit:.0f} hit tokens")  # fmt: skip
        finally:
            stop(insts)
    return {
        **run_header(),
        "prompt_tokens": n,
        "expected_hit_tokens": expected_hit,
        "ttft_s": times,
        "hit_tokens": hits,
        "median_s": {m: statistics.median(v) for m, v in times.items()},
    }


def bandwidth_part(args: argparse.Namespace, model: Path, logs: Path) -> dict[str, Any]:
    geo = KVGeometry.of_model(model, args.dtype, args.blocks_per_chunk)
    with _master(args, logs, "bandwidth") as master:
        res = measure_bandwidth(master, geo, args.bw_tokens, args.bw_iters)
    gb = res["bytes"] / 1e9
    res.update(
        {
            **run_header(),
            "tokens": args.bw_tokens,
            "geometry": asdict(geo),
            "connector_gbps": gb / statistics.median(res["connector_s"]),
            "connector_get_gbps": gb / statistics.median(res["connector_get_s"]),
            "raw_gbps": res["raw_bytes"] / 1e9 / statistics.median(res["raw_s"]),
        }
    )
    res["ratio"] = res["connector_gbps"] / res["raw_gbps"]
    log(f"bandwidth: connector {res['connector_gbps']:.2f} GB/s, raw {res['raw_gbps']:.2f} GB/s")
    if not res["verified"]:
        raise RuntimeError("the connector's load does not match the stored blocks")
    return res


def _workload_prompts(args: argparse.Namespace, vocab: int, seed: str) -> list[list[int]]:
    """Fresh system prompts (every round starts cold), in waves that each use every system
    prompt once, each request with a suffix of its own. Request ``i`` goes to instance
    ``i % 2``: with an even number of system prompts each wave is rotated by one against the
    last, so that a system prompt's next use lands on the other instance (its first use on
    each instance is a store hit with the store on, a recompute without; later uses are
    local prefix hits either way)."""
    rng = random.Random(f"shared-store-workload-{seed}")
    n = args.systems
    systems = [random_tokens(rng, args.system_len, vocab) for _ in range(n)]
    prompts = []
    for i in range(args.requests):
        s = (i + (i // n if n % 2 == 0 else 0)) % n
        prompts.append(systems[s] + random_tokens(rng, args.suffix_len, vocab))
    return prompts


def workload_part(args: argparse.Namespace, model: Path, vocab: int, logs: Path) -> dict[str, Any]:
    per_inst = -(-args.requests // 2)
    length = args.system_len + args.suffix_len + args.max_tokens
    blocks = args.systems * args.system_len // BLOCK + per_inst * (length // BLOCK + 1) + 64
    flags = serve_flags(args.dtype, length + BLOCK, args.batch_tokens, blocks)
    # Two instances compute at once: half the cores each, so they do not oversubscribe.
    threads = max(1, (os.cpu_count() or 2) // 2)
    res: dict[str, dict[str, list[Any]]] = {
        m: {"ttft_s": [], "total_s": [], "hit_tokens": []} for m in ("on", "off")
    }
    with _master(args, logs, "workload") as master:
        insts: list[Instance] = []
        try:
            pairs = {
                "on": start_instances(insts, ["wl-on-0", "wl-on-1"], model, logs, flags,
                                      store_kv(master, args.blocks_per_chunk), threads),
                "off": start_instances(insts, ["wl-off-0", "wl-off-1"], model, logs, flags,
                                       None, threads),
            }  # fmt: skip
            wait_ready(insts)
            warm = _workload_prompts(args, vocab, "warm-up")[:4]
            for pair in pairs.values():
                run_workload(pair, warm, args.rate, args.max_tokens, "warm-up")
            wait_settled(pairs["on"])
            for r in range(args.rounds):
                prompts = _workload_prompts(args, vocab, str(r))
                for mode in alternating(("on", "off"), r):
                    pair = pairs[mode]
                    before = (
                        sum(totals(i).get("hit_tokens", 0.0) for i in pair) if mode == "on" else 0.0
                    )
                    ttfts, total = run_workload(pair, prompts, args.rate, args.max_tokens, str(r))
                    hit = 0.0
                    if mode == "on":
                        hit = sum(totals(i).get("hit_tokens", 0.0) for i in pair) - before
                        wait_settled(pair)  # its puts must not run into the next round
                    res[mode]["ttft_s"].append(ttfts)
                    res[mode]["total_s"].append(total)
                    res[mode]["hit_tokens"].append(hit)
                    log(f"workload round {r + 1}/{args.rounds} store {mode:>3}: mean TTFT "
                        f"{statistics.fmean(ttfts) * 1e3:.1f} ms, total {total:.2f} s, "
                        f"{hit:.0f} store hit tokens")  # fmt: skip
        finally:
            stop(insts)
    summary = {
        m: {
            "ttft_mean_s": statistics.fmean(t for r in v["ttft_s"] for t in r),
            "total_s_mean": statistics.fmean(v["total_s"]),
            "hit_tokens_mean": statistics.fmean(v["hit_tokens"]),
        }
        for m, v in res.items()
    }
    settings = {k: getattr(args, k) for k in ("systems", "system_len", "suffix_len", "requests",
                                              "max_tokens", "rate", "rounds")}  # fmt: skip
    return {**run_header(), "settings": settings, "threads_per_instance": threads, "raw": res,
            "summary": summary}  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, short prompts, 2 reps")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ",".join(PARTS))
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--blocks-per-chunk", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=2048, help="--max-num-batched-tokens")
    ap.add_argument("--segment-mib", type=int, default=None, help="store memory (MiB)")
    ap.add_argument("--prompt-len", type=int, default=None, help="ttft: prompt tokens")
    ap.add_argument("--reps", type=int, default=None, help="ttft: repetitions per mode")
    ap.add_argument("--bw-tokens", type=int, default=None, help="bandwidth: tokens per load")
    ap.add_argument("--bw-iters", type=int, default=None, help="bandwidth: loads per path")
    ap.add_argument("--systems", type=int, default=None, help="workload: system prompts")
    ap.add_argument("--system-len", type=int, default=None, help="workload: system tokens")
    ap.add_argument("--suffix-len", type=int, default=None, help="workload: suffix tokens")
    ap.add_argument("--requests", type=int, default=None, help="workload: requests per round")
    ap.add_argument("--rate", type=float, default=None, help="workload: requests per second")
    ap.add_argument("--max-tokens", type=int, default=16, help="workload: output tokens")
    ap.add_argument("--rounds", type=int, default=None, help="workload: rounds per mode")
    ap.add_argument("--allow-noise", action="store_true", help="measure on a busy machine")
    ap.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()
    fill_quick_defaults(
        args, model=("tiny", "mid"), segment_mib=(512, 4096), prompt_len=(512, 4096),
        reps=(2, 5), bw_tokens=(512, 4096), bw_iters=(2, 10), systems=(4, 8),
        system_len=(256, 1024), suffix_len=(32, 128), requests=(8, 32), rate=(4.0, 2.0),
        rounds=(1, 3),
    )  # fmt: skip
    args.parts = [p for p in args.parts.split(",") if p]
    if not args.parts or set(args.parts) - set(PARTS):
        ap.error(f"--parts takes a comma-separated subset of {','.join(PARTS)}")
    return args


def main() -> None:
    args = parse_args()
    if not args.quick and not args.allow_noise:
        wait_until(read_loadavg, 1.0, 300, "1-minute load average", log)
    model = bench_model(args.model, max(args.prompt_len, args.system_len + args.suffix_len) + 128)
    vocab = model_vocab_size(model)
    logs = Path(tempfile.mkdtemp(prefix="kvferry-shared-store-"))
    log(f"logs: {logs}")
    out = result_path("shared_store", args.quick)
    res = load_previous(out)  # parts not run this time keep their last results
    res.update({"model": args.model, "dtype": args.dtype, "args": vars(args)})
    t0 = time.monotonic()
    if "ttft" in args.parts:
        res["ttft"] = ttft_part(args, model, vocab, logs)
    if "bandwidth" in args.parts:
        res["bandwidth"] = bandwidth_part(args, model, logs)
    if "workload" in args.parts:
        res["workload"] = workload_part(args, model, vocab, logs)
    log(f"done in {time.monotonic() - t0:.0f} s")
    write_results_json(out, res)
    print(write_report(res, args, write_docs=not args.no_docs))


if __name__ == "__main__":
    main()
