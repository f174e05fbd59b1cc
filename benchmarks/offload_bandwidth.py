"""Bandwidth of the offload connector's copies vs a raw tensor copy of the same bytes.

The transfer engine the offload connectors use (``kvferry.kv_transfer.offload``) moves
blocks between an engine-shaped KV pool and its host tier, and between the host tier or the
engine and chunk files. Each job is timed by the engine itself (copy time, from the first
byte to the last). The reference is a plain ``Tensor.copy_`` of the same number of bytes
between two contiguous tensors per layer, measured in the same run, so the ratio does not
depend on how busy the machine is at that moment as much as absolute numbers do.

Every timed copy, reference or job, starts with cold caches (a 2x-last-level-cache buffer is
written first): a KV load reads host blocks nobody touched lately, and a reference copied
from a hot cache would make jobs that fit in the cache (3-12 MiB here) look twice as slow as
they are.

Engine block ids are either *contiguous* (a fresh pool hands out adjacent blocks) or
*scattered* (random ids, as after a long time of churn); host blocks are adjacent per chunk.
KV shape of the ~140M ``mid`` model: 12 layers, 4 KV heads of 64, block 16, bf16.

    .venv/bin/python benchmarks/offload_bandwidth.py          # full run, writes docs
    .venv/bin/python benchmarks/offload_bandwidth.py --quick  # smoke run
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.harness.cli import fill_quick_defaults
from benchmarks.harness.markdown import markdown_table, update_doc
from benchmarks.harness.paths import IMG_DIR, OFFLOAD_SCRATCH
from benchmarks.harness.plots import bar_plot
from benchmarks.harness.results import result_path, write_results_json
from benchmarks.harness.timing import best_time
from kvferry.kv_transfer.offload.disk import DiskStore
from kvferry.kv_transfer.offload.host_buffer import HostKVBuffer
from kvferry.kv_transfer.offload.jobs import JobKind, TransferJob
from kvferry.kv_transfer.offload.transfer import JobResult, TransferEngine

LAYERS, HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16


# Written before every timed copy to push the data out of the last-level cache (32 MiB on
# the machines measured); twice that for margin.
EVICT_BYTES = 64 << 20


class Evictor:
    def __init__(self) -> None:
        self._buf = torch.zeros(EVICT_BYTES, dtype=torch.uint8)

    def __call__(self) -> None:
        self._buf.add_(1)


def raw_copy_gbps(nbytes_per_layer: int, reps: int, evict: Evictor) -> float:
    """Best of ``reps`` cold contiguous copies of the same bytes, per layer like the
    engine's (a first one, which also faults the pages in, is not counted)."""
    src = [torch.ones(nbytes_per_layer, dtype=torch.uint8) for _ in range(LAYERS)]
    dst = [torch.empty_like(s) for s in src]

    def copy() -> None:
        for s, d in zip(src, dst, strict=True):
            d.copy_(s)

    return nbytes_per_layer * LAYERS / best_time(copy, reps, before=evict) / 1e9


def memcpy_gbps(nbytes_per_layer: int, reps: int, evict: Evictor) -> float:
    """The same bytes with numpy's single-threaded memcpy (no OpenMP team: steady on a busy
    machine, where a parallel ``copy_`` can stall on a descheduled thread)."""
    import numpy as np

    src = [np.ones(nbytes_per_layer, dtype=np.uint8) for _ in range(LAYERS)]
    dst = [np.empty_like(s) for s in src]

    def copy() -> None:
        for s, d in zip(src, dst, strict=True):
            np.copyto(d, s)

    return nbytes_per_layer * LAYERS / best_time(copy, reps, before=evict) / 1e9


def run_job(engine: TransferEngine, job: TransferJob) -> JobResult:
    engine.submit(job)
    engine.wait([job.job_id])
    (result,) = engine.poll()
    assert result.ok, result.error
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    num_blocks = max(args.sizes) * 4
    kv = {
        f"layer{i}": torch.randn(2, num_blocks, BLOCK, HEADS, HEAD_DIM).to(torch.bfloat16)
        for i in range(LAYERS)
    }
    host = HostKVBuffer(kv, max(args.sizes) * 2, pin_memory=False)
    chunk = args.blocks_per_chunk
    folder = OFFLOAD_SCRATCH / "bandwidth"
    shutil.rmtree(folder, ignore_errors=True)
    disk = DiskStore(folder, "ab" * 16, chunk * host.bytes_per_block, fsync=False)
    engine = TransferEngine(kv, host, disk)
    evict = Evictor()
    ids = iter(range(1 << 30))
    rows: list[dict[str, Any]] = []
    for n in args.sizes:
        nbytes = n * host.bytes_per_block
        for pattern in ("contiguous", "scattered"):
            if pattern == "contiguous":
                engine_ids = list(range(n, 2 * n))
            else:
                engine_ids = torch.randperm(num_blocks)[:n].tolist()
            host_ids = list(range(n))
            # Interleave the reference and the connector's jobs, so both see the same
            # machine (other processes, caches); keep the best of each.
            speeds: dict[str, list[float]] = {"raw": [], "memcpy": [], "store": [], "load": []}
            for _ in range(args.reps):
                speeds["raw"].append(raw_copy_gbps(nbytes // LAYERS, 2, evict))
                speeds["memcpy"].append(memcpy_gbps(nbytes // LAYERS, 2, evict))
                for kind in (JobKind.STORE, JobKind.LOAD):
                    evict()
                    r = run_job(engine, TransferJob(next(ids), kind, engine_ids, host_ids))
                    speeds[kind.value].append(r.nbytes / r.seconds / 1e9)
            # The reference is the faster of the two plain copies: a parallel copy_ can
            # stall when another process holds a core, a one-thread memcpy cannot.
            row = {"blocks": n, "mib": nbytes / 2**20, "pattern": pattern}
            row["raw_gbps"], row["memcpy_gbps"] = max(speeds["raw"]), max(speeds["memcpy"])
            raw = max(row["raw_gbps"], row["memcpy_gbps"])
            for kind in ("store", "load"):
                row[f"{kind}_gbps"] = max(speeds[kind])
                row[f"{kind}_ratio"] = max(speeds[kind]) / raw
            if pattern == "scattered" and n % chunk == 0:
                # Disk: the blocks as chunk files written from the engine, then read back.
                keys = [f"{next(ids):064x}" for _ in range(n // chunk)]
                t0 = time.perf_counter()
                for i, key in enumerate(keys):
                    blocks = engine_ids[i * chunk : (i + 1) * chunk]
                    engine.submit(TransferJob(next(ids), JobKind.DISK_STORE, blocks, [], key))
                while engine.num_in_flight():
                    time.sleep(0.0005)
                assert all(r.ok for r in engine.poll())
                row["disk_write_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
                loads = [
                    (key, 0, engine_ids[i * chunk : (i + 1) * chunk]) for i, key in enumerate(keys)
                ]
                r = run_job(engine, TransferJob(next(ids), JobKind.LOAD, disk_loads=loads))
                row["disk_read_gbps"] = r.nbytes / r.seconds / 1e9
            rows.append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    engine.shutdown()
    shutil.rmtree(folder, ignore_errors=True)
    return {"shape": [LAYERS, 2, BLOCK, HEADS, HEAD_DIM], "dtype": "bfloat16", "rows": rows}


def report(res: dict[str, Any], write_docs: bool, quick: bool) -> str:
    rows = res["rows"]
    headers = ["blocks", "MiB", "engine ids", "copy_ GB/s", "1-thread memcpy GB/s"]
    headers += ["load GB/s", "load / best raw", "store GB/s", "store / best raw"]
    headers += ["file write GB/s", "file read GB/s"]
    table = markdown_table(
        headers,
        [
            [r["blocks"], r["mib"], r["pattern"], r["raw_gbps"], r["memcpy_gbps"]]
            + [r["load_gbps"], f"{r['load_ratio']:.0%}", r["store_gbps"]]
            + [f"{r['store_ratio']:.0%}", r.get("disk_write_gbps"), r.get("disk_read_gbps")]
            for r in rows
        ],
    )
    print(table)
    if write_docs:
        suffix = "_quick" if quick else ""
        cats = [f"{r['blocks']} {r['pattern'][:4]}" for r in rows]
        plot = bar_plot(
            IMG_DIR / f"offload_bandwidth{suffix}.png",
            cats,
            {k: [r[f"{k}_gbps"] for r in rows] for k in ("raw", "memcpy", "load", "store")},
            "Offload copy bandwidth vs raw copy (mid KV layout, bf16)",
            "GB/s",
        )
        worst = min(r["load_ratio"] for r in rows)
        update_doc(
            f"offload_bandwidth{suffix}",
            f"### Load and store bandwidth{' (smoke run)' if quick else ''}\n\n"
            f"`benchmarks/offload_bandwidth.py{' --quick' if quick else ''}`: best of the "
            f"repetitions per job; best raw = the faster of `Tensor.copy_` and a one-thread "
            f"`memcpy` of the same bytes, interleaved with the jobs in the same run. Every "
            f"timed copy (reference or job) starts with cold caches, as a KV load does.\n\n"
            f"{table}\n\nHost loads reach at least {worst:.0%} of the best "
            f"raw copy (target >= 70%{'; smoke run: 3 reps' if quick else ''}).\n\n![bandwidth](img/{plot.name})\n",
        )
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="*", default=None, help="blocks per job")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--blocks-per-chunk", type=int, default=4)
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    fill_quick_defaults(args, sizes=([16, 64], [16, 64, 256, 512]), reps=(3, 10))
    res = run(args)
    write_results_json(result_path("offload_bandwidth", args.quick), res)
    report(res, not args.no_docs, args.quick)


if __name__ == "__main__":
    main()
