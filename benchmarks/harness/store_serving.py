"""``kvferry serve`` instances sharing a Mooncake Store, for the shared-store benchmark.

Each instance is its own process (as in a deployment: nothing is shared but the store's
master and its storage client), configured with the MooncakeStoreConnector on one
``MooncakeMaster``. What the connector did is read from each server's ``/metrics``
(``kvferry_kv_connector_total{stat=...}``: ``put_chunks``, ``hit_tokens``, ...), which is
also how the benchmark knows that one instance's stores completed before another asks
(:func:`stored_chunks`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.harness.serving import serve_env, start_serve, stream_completion
from kvferry.entrypoints.demo import Instance, connector_stats, scrape, wait_healthy, wait_listening

CONNECTOR = "MooncakeStoreConnector"


def store_kv(master: Any, blocks_per_chunk: int, **extra: Any) -> dict[str, Any]:
    """A kv_transfer_config for ``master`` (its client settings given as extra_config; the
    engines lend no memory: the master's storage client holds the store)."""
    options: dict[str, Any] = dict(master.config(global_segment_size=0))
    options.update(
        {
            "blocks_per_chunk": blocks_per_chunk,
            "lookup_timeout_s": 10.0,
            "load_timeout_s": 60.0,
            # A burst of requests must not skip stores because the put queue is "full".
            "max_pending_store_chunks": 8192,
        }
    )
    options.update(extra)
    return {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": options,
    }


def serve_flags(dtype: str, max_model_len: int, batch_tokens: int, kv_blocks: int) -> list[str]:
    return [
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--max-num-batched-tokens", str(batch_tokens),
        "--num-kv-blocks", str(kv_blocks),
    ]  # fmt: skip


def start_instances(
    into: list[Instance],
    names: list[str],
    model: Path,
    logs: Path,
    flags: list[str],
    kv: dict[str, Any] | None,
    threads: int | None = None,
) -> list[Instance]:
    """Start one server per name (all with ``kv``), each with ``threads`` compute threads
    (None: torch's default); each is appended to ``into`` as soon as it started, so that the
    caller's ``finally: stop(into)`` stops them even when a later one fails. Returns the new
    instances (not yet ready: see :func:`wait_ready`)."""
    env = serve_env()
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    started = []
    for name in names:
        started.append(start_serve(name, model, logs, flags, kv, env))
        into.append(started[-1])
    return started


def wait_ready(insts: list[Instance]) -> None:
    for inst in insts:
        wait_listening(inst, timeout=600)
    for inst in insts:
        wait_healthy(inst.url, timeout=600, inst=inst)


def totals(inst: Instance) -> dict[str, float]:
    """The instance's connector stats since it started (counters, and sums of samples)."""
    return connector_stats(scrape(inst.url))


def stored_chunks(stats: dict[str, float]) -> float:
    """Chunks the instance's worker confirmed in the store: put, or found already there.

    (Worker counters, not the scheduler's ``stored_chunks``: the worker's are taken in the
    step that reports the store job done, the scheduler's only in the step after it, which
    an engine that went idle does not run.)"""
    return stats.get("put_chunks", 0.0) + stats.get("store_dedup_chunks", 0.0)


def wait_stored(
    inst: Instance,
    at_least: float | Callable[[dict[str, float]], float],
    timeout_s: float = 300.0,
) -> dict[str, float]:
    """Wait until ``inst`` confirmed ``at_least`` chunks in the store (see
    :func:`stored_chunks`; a callable computes the target from each reading of the stats);
    its stats then. RuntimeError when puts failed or it times out."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = totals(inst)
        if stats.get("put_failed_chunks", 0) or stats.get("store_skipped_chunks", 0):
            raise RuntimeError(f"{inst.name}: stores failed or were skipped: {stats}")
        target = at_least(stats) if callable(at_least) else at_least
        if stored_chunks(stats) >= target:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{inst.name}: {stored_chunks(stats):.0f} chunks stored after "
                f"{timeout_s:.0f} s, expected {target:.0f}"
            )
        time.sleep(0.02)


def ttft(inst: Instance, prompt: list[int]) -> float:
    """Time to the first token of a streamed ``max_tokens=1`` greedy completion."""
    out: dict[str, Any] = {}
    stream_completion(inst.url, prompt, 1, out)
    return float(out["ttft"])


_STORE_KEYS = ("put_chunks", "store_dedup_chunks", "put_failed_chunks", "get_chunks")


def wait_settled(insts: list[Instance], quiet_s: float = 1.0, timeout_s: float = 300.0) -> None:
    """Wait until no instance's store counters changed for ``quiet_s`` (the background puts
    of the last requests are done, so they do not run into the next measurement)."""
    deadline = time.monotonic() + timeout_s
    last: list[tuple[float, ...]] = []
    since = time.monotonic()
    while time.monotonic() < deadline:
        now = [tuple(totals(i).get(k, 0.0) for k in _STORE_KEYS) for i in insts]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the instances' stores did not settle in {timeout_s:.0f} s")


def run_workload(
    insts: list[Instance], prompts: list[list[int]], rate: float, max_tokens: int, seed: str
) -> tuple[list[float], float]:
    """Send ``prompts`` round robin over ``insts`` at ``rate`` requests per second (Poisson
    arrivals, seeded), each a streamed greedy completion of ``max_tokens``; every request's
    TTFT (in prompt order) and the time from the first send to the last token."""
    rng = random.Random(f"arrivals-{seed}")
    outs: list[dict[str, Any]] = [{} for _ in prompts]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
            url = insts[i % len(insts)].url
            futures.append(pool.submit(stream_completion, url, prompt, max_tokens, out))
            if i + 1 < len(prompts):
                time.sleep(rng.expovariate(rate))
        for f in futures:
            f.result()
    return [float(o["ttft"]) for o in outs], time.perf_counter() - t0
