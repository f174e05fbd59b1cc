"""KV-aware routing: round_robin vs kv_aware over three instances, and what events cost.

Two parts:

1. **Routing**: three ``kvferry serve`` instances publishing KV events, behind two proxies
   over the same instances, ``--policy round_robin`` and ``--policy kv_aware``. A round is a
   shared-prefix workload: ``--systems`` system prompts of ``--system-len`` tokens, each
   request one of them plus a user part of its own, sent at ``--rate`` requests per second
   (Poisson arrivals, streamed). Rounds alternate between the policies, each with system
   prompts of its own (so every round starts cold and neither policy inherits the other's
   cache). Reported per policy: mean and p90 TTFT and the prefix hit rate (cached prompt
   tokens the instances report / prompt tokens), beside the ideal hit rate (each system
   prompt computed once, in full blocks). Targets: kv_aware mean TTFT <= 0.5x round_robin's,
   hit rate >= 80% of the ideal. By default each instance's KV pool (``--kv-blocks 700``)
   holds about 10 of the 24 system prompts: the working set is larger than one instance's
   cache but fits in the three together, which is where routing by prefix pays (round robin
   needs every prompt on every instance). ``--kv-blocks 0`` keeps the engines' default pools
   (everything fits everywhere). The three instances run one compute thread each.
2. **Events cost**: one instance with events on and one with them off, bursts of
   ``--concurrency`` fresh shared-prefix prompts sent to one and then the other (order
   alternating); output tokens/s and the median of the per-pair ratios (target: <= 1% loss).

    .venv/bin/python benchmarks/kv_routing.py            # defaults: several minutes
    .venv/bin/python benchmarks/kv_routing.py --quick    # smoke run, about a minute
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.cli import fill_quick_defaults, log
from benchmarks.harness.kv_events import EventCounter
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.models import get_model, model_vocab_size
from benchmarks.harness.paths import REPO_ROOT
from benchmarks.harness.plots import bar_plot
from benchmarks.harness.prompts import random_tokens
from benchmarks.harness.quiet import read_loadavg, wait_until
from benchmarks.harness.results import result_path, run_header, write_json
from benchmarks.harness.serving import http_client, serve_env, stream_completion
from benchmarks.harness.timing import alternating
from kvferry.entrypoints.demo import Instance, start, stop, wait_healthy, wait_listening

FLAGS = ["--dtype", "float32", "--max-model-len", "2048"]
BLOCK = 16
POLICIES = ("round_robin", "kv_aware")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_instance(
    name: str,
    model: Path,
    logs: Path,
    events: bool,
    kv_blocks: int | None = None,
    batched_tokens: int = 2048,
) -> tuple[Instance, dict]:
    argv = ["serve", str(model), "--port", "0", "--served-model-name", "m", *FLAGS]
    argv += ["--max-num-batched-tokens", str(batched_tokens)]
    env = serve_env()
    if kv_blocks is not None:
        argv += ["--num-kv-blocks", str(kv_blocks)]
        # Three routed instances share this machine's cores: one compute thread each, so
        # they do not oversubscribe the cores and slow each other down.
        env["OMP_NUM_THREADS"] = "1"
    cfg: dict[str, Any] = {}
    if events:
        cfg = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{_free_port()}",
            "replay_endpoint": f"tcp://127.0.0.1:{_free_port()}",
        }
        argv += ["--kv-events-config", json.dumps(cfg)]
    return start(name, argv, logs, env=env), cfg


def start_proxy(
    policy: str, model: Path, logs: Path, insts: list[tuple[Instance, dict]]
) -> Instance:
    argv = ["proxy", "--port", "0", "--policy", policy, "--instance", *(i.url for i, _ in insts)]
    if policy == "kv_aware":
        argv += ["--tokenizer", str(model), "--load-poll-interval", "0.5"]
        argv += ["--kv-events-endpoint", *(c["endpoint"] for _, c in insts)]
        argv += ["--kv-replay-endpoint", *(c["replay_endpoint"] for _, c in insts)]
    return start(f"proxy-{policy}", argv, logs, env=serve_env())


def request(url: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One streamed greedy completion: TTFT, and the prompt / cached tokens from the usage."""
    body = {
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    out = {"ttft": float("nan"), "prompt": float(len(prompt)), "cached": 0.0}
    with http_client().stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and out["ttft"] != out["ttft"]:
                out["ttft"] = time.perf_counter() - t0
            usage = chunk.get("usage")
            if usage:
                out["cached"] = float(
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                )
    return out


def workload(args: argparse.Namespace, vocab: int, seed: int) -> tuple[list[list[int]], float]:
    """The round's prompts (in arrival order) and its ideal cached tokens."""
    rng = random.Random(f"kv-routing-{seed}")
    systems = [random_tokens(rng, args.system_len, vocab) for _ in range(args.systems)]
    prompts, seen, ideal = [], set(), 0.0
    for _ in range(args.requests):
        s = rng.randrange(args.systems)
        prompts.append(systems[s] + random_tokens(rng, args.user_len, vocab))
        if s in seen:
            ideal += (args.system_len // BLOCK) * BLOCK
        seen.add(s)
    return prompts, ideal


def run_round(
    url: str, prompts: list[list[int]], args: argparse.Namespace, seed: int
) -> list[dict]:
    """Send ``prompts`` at ``args.rate`` per second (Poisson arrivals); all results."""
    rng = random.Random(f"arrivals-{seed}")
    with ThreadPoolExecutor(max(8, int(args.rate * 8))) as pool:
        futures = []
        for p in prompts:
            futures.append(pool.submit(request, url, p, args.max_tokens))
            time.sleep(rng.expovariate(args.rate))
        return [f.result() for f in futures]


def p90(values: list[float]) -> float:
    return sorted(values)[max(0, int(round(0.9 * len(values))) - 1)]


def routing_part(args: argparse.Namespace, model: Path, logs: Path, vocab: int) -> dict[str, Any]:
    insts = [
        start_instance(f"serve{i}", model, logs, True, args.kv_blocks, args.max_num_batched_tokens)
        for i in range(3)
    ]
    procs = [i for i, _ in insts]
    try:
        for inst in procs:
            wait_listening(inst)
        proxies = {p: start_proxy(p, model, logs, insts) for p in POLICIES}
        procs += list(proxies.values())
        for inst in procs:
            wait_healthy(wait_listening(inst), inst=inst)
        per: dict[str, dict[str, list[float]]] = {
            p: {"ttft": [], "prompt": [], "cached": [], "ideal": []} for p in POLICIES
        }
        for r in range(args.rounds):
            for j, policy in enumerate(alternating(POLICIES, r)):
                seed = 2 * r + j
                prompts, ideal = workload(args, vocab, seed)
                log(f"round {r + 1}/{args.rounds}: {policy}, {len(prompts)} requests")
                results = run_round(proxies[policy].url, prompts, args, seed)
                for key in ("ttft", "prompt", "cached"):
                    per[policy][key] += [x[key] for x in results]
                per[policy]["ideal"].append(ideal)
        return per
    finally:
        stop(procs)


def _burst(url: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tokens per second of ``prompts`` sent all at once."""
    outs: list[dict[str, Any]] = [{} for _ in prompts]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        args = [(url, p, max_tokens, o) for p, o in zip(prompts, outs, strict=True)]
        list(pool.map(lambda a: stream_completion(*a), args))
    return sum(o["tokens"] for o in outs) / (time.perf_counter() - t0)


def events_part(
    args: argparse.Namespace, model: Path, logs: Path, vocab: int
) -> dict[str, list[float]]:
    on, cfg = start_instance("events-on", model, logs, True)
    insts = {"on": on, "off": start_instance("events-off", model, logs, False)[0]}
    counter = EventCounter(cfg["endpoint"])
    try:
        for inst in insts.values():
            wait_healthy(wait_listening(inst), inst=inst)
        rng = random.Random("events-cost")
        shared = random_tokens(rng, args.system_len, vocab)
        tput: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(args.bursts):
            burst = [shared[: rng.randrange(BLOCK, args.system_len)] + random_tokens(rng, 256, vocab)
                     for _ in range(args.concurrency)]  # fmt: skip
            for mode in alternating(("off", "on"), i):
                tput[mode].append(_burst(insts[mode].url, burst, args.events_max_tokens))
        log(f"events part: the subscriber received {counter.batches} event batches")
        if counter.batches == 0:
            raise RuntimeError("the events-on instance published nothing")
        return tput
    finally:
        counter.close()
        stop(list(insts.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--quick", action="store_true", help="smoke run with tiny settings")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per policy")
    ap.add_argument("--requests", type=int, default=None, help="requests per round")
    ap.add_argument("--rate", type=float, default=None, help="requests per second")
    ap.add_argument("--systems", type=int, default=None, help="shared system prompts per round")
    ap.add_argument("--system-len", type=int, default=None, help="tokens per system prompt")
    ap.add_argument("--user-len", type=int, default=64, help="tokens of each user part")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--bursts", type=int, default=None, help="events on/off pairs")
    ap.add_argument("--concurrency", type=int, default=16, help="requests per events burst")
    ap.add_argument("--events-max-tokens", type=int, default=64, help="output tokens, events part")
    ap.add_argument(
        "--parts", default="routing,events", help="which parts to run: routing, events or both"
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget per step of the routed instances (smaller: shorter prefill chunks)",
    )
    ap.add_argument("--allow-noise", action="store_true", help="measure on a busy machine")
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV blocks per routed instance (default 700: about 10 of the 24 system prompts; "
        "0: the engine's default 1 GiB pool, which holds every prompt)",
    )
    args = ap.parse_args()
    default_pool = args.kv_blocks == 0
    fill_quick_defaults(
        args, rounds=(1, 3), requests=(12, 120), rate=(3.0, 3.0), system_len=(256, 1024),
        bursts=(2, 30), systems=(4, 24), kv_blocks=(700, 700),
    )  # fmt: skip
    if default_pool:
        args.kv_blocks = None
    if not args.allow_noise:
        wait_until(read_loadavg, 1.0, 300, "1-minute load average", log)
    model = get_model(args.model)
    vocab = model_vocab_size(model)
    logs = Path(tempfile.mkdtemp(prefix="kvferry-kv-routing-"))
    parts = set(args.parts.split(","))
    if not parts or parts - {"routing", "events"}:
        ap.error("--parts takes routing, events or routing,events")
    per = routing_part(args, model, logs, vocab) if "routing" in parts else None
    tput = events_part(args, model, logs, vocab) if "events" in parts else None
    result: dict[str, Any] = {**run_header(), "model": model.name, "args": vars(args), "raw": {}}
    if per is not None:
        result["routing"] = {
            p: {
                "ttft_mean_s": statistics.fmean(v["ttft"]),
                "ttft_p90_s": p90(v["ttft"]),
                "hit_rate": sum(v["cached"]) / sum(v["prompt"]),
                "ideal_hit_rate": sum(v["ideal"]) / sum(v["prompt"]),
            }
            for p, v in per.items()
        }
        result["raw"]["routing"] = per
    if tput is not None:
        ratios = [b / a for a, b in zip(tput["off"], tput["on"], strict=True)]
        result["events_tokens_per_s_median"] = {m: statistics.median(v) for m, v in tput.items()}
        result["events_on_off_ratio_median"] = statistics.median(ratios)
        result["events_on_off_ratio_ci95"] = bootstrap_ci(ratios)
        result["raw"]["events_tokens_per_s"] = tput
    out = write_json(result_path("kv_routing", args.quick), result)
    if per is not None:
        plot(result["routing"], args)
    print(report(result, args))
    print(f"results: {out}")


def bootstrap_ci(values: list[float], n: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``values``."""
    rng = random.Random("bootstrap")
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def plot(summary: dict[str, Any], args: argparse.Namespace) -> None:
    img = REPO_ROOT / "docs" / "img" / ("kv_routing_quick.png" if args.quick else "kv_routing.png")
    bar_plot(
        img,
        ["TTFT mean (ms)", "TTFT p90 (ms)", "prefix hit rate (%)"],
        {
            p: [
                1000 * summary[p]["ttft_mean_s"],
                1000 * summary[p]["ttft_p90_s"],
                100 * summary[p]["hit_rate"],
            ]
            for p in POLICIES
        },
        f"3 instances, {args.systems} shared system prompts, {args.rate:g} req/s",
        "ms / %",
    )
    log(f"plot: {img}")


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    parts = []
    if "routing" in result:
        s = result["routing"]
        rows = []
        for p in POLICIES:
            r = s[p]
            of_ideal = r["hit_rate"] / r["ideal_hit_rate"] if r["ideal_hit_rate"] else None
            rows.append(
                [
                    p,
                    f"{1000 * r['ttft_mean_s']:.1f}",
                    f"{1000 * r['ttft_p90_s']:.1f}",
                    f"{100 * r['hit_rate']:.1f}%",
                    f"{100 * r['ideal_hit_rate']:.1f}%",
                    "-" if of_ideal is None else f"{100 * of_ideal:.0f}%",
                ]
            )
        ratio = s["kv_aware"]["ttft_mean_s"] / s["round_robin"]["ttft_mean_s"]
        table = markdown_table(
            ["policy", "TTFT mean (ms)", "TTFT p90 (ms)", "prefix hit rate", "ideal", "of ideal"],
            rows,
        )
        pools = "default KV pools" if args.kv_blocks is None else f"{args.kv_blocks} KV blocks"
        parts.append(
            f"## KV-aware routing, 3 instances ({result['model']}, fp32; {args.systems} system "
            f"prompts of {args.system_len} tokens + {args.user_len}-token user parts, "
            f"{args.rate:g} req/s, {args.requests} requests x {args.rounds} round(s) per "
            f"policy, {pools} per instance)\n\n"
            f"{table}\n\nkv_aware / round_robin mean TTFT: {ratio:.2f}x (target <= 0.5x)"
        )
    if "events_tokens_per_s_median" in result:
        ev = result["events_tokens_per_s_median"]
        lo, hi = result["events_on_off_ratio_ci95"]
        change = f"{100 * (result['events_on_off_ratio_median'] - 1):+.1f}%"
        ev_table = markdown_table(
            ["events", "tok/s (median)", "on / off, median of pairs [95% bootstrap]"],
            [
                ["off", f"{ev['off']:.1f}", ""],
                [
                    "on",
                    f"{ev['on']:.1f}",
                    f"{change} [{100 * (lo - 1):+.1f}%, {100 * (hi - 1):+.1f}%]",
                ],
            ],
        )
        parts.append(
            f"## KV events on vs off, one instance ({args.bursts} pairs of {args.concurrency}-"
            f"request bursts, {args.events_max_tokens} output tokens)\n\n{ev_table}"
        )
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
