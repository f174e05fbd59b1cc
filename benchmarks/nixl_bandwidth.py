"""NixlConnector transfer bandwidth vs a raw NIXL READ of the same bytes, same two processes.

Two child processes each own a KV pool and the worker side of a NixlConnector (no model: the
connector is driven directly with the metadata the scheduler would send; the shared parts
live in ``benchmarks/harness/pd_bandwidth_pair.py``). The prefill child fills its pool and
holds ``--iters`` + 1 "requests" over the same blocks; the decode child measures, interleaved:

* **connector**: a read through the connector's full path: ``start_load_kv`` -> side-channel
  claim -> READ of one descriptor per (layer, K|V, block) -> completion seen by
  ``get_finished`` (the prefill side frees on the notification). The first read (handshake,
  NIXL metadata load, UCX connection set-up) is a warm-up and not counted.
* **raw**: ``make_prepped_xfer`` + ``transfer`` + polling ``check_xfer_state`` of the same
  local/remote descriptors between the same two agents, no side channel.

Reported: median GB/s of each and connector/raw (target >= 70%). The data read is verified
once against the prefill side's fill pattern. ``benchmarks/pd_bandwidth.py`` measures the
same next to MooncakeConnector.

    .venv/bin/python benchmarks/nixl_bandwidth.py --quick        # smoke run, a few MB
    .venv/bin/python benchmarks/nixl_bandwidth.py                # full: 512 MiB per read
    .venv/bin/python benchmarks/nixl_bandwidth.py --device cuda  # device memory (VRAM)

UCX chooses the transport (UCX_TLS, UCX_NET_DEVICES); on one host without RDMA it usually
copies host memory with cross-memory attach, between hosts it uses TCP or RDMA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import pd_bandwidth_pair as pair
from benchmarks.harness.pd_bandwidth_raw import nixl_raw_read

PEER = pair.engine_id("prefill", "nixl")


def run_prefill(args: argparse.Namespace) -> None:
    out = pair.private_stdout()
    caches = pair.make_caches(args, pair.geometry(args, "nixl", "prefill")[1], fill=True)
    conn = pair.make_connector(args, "nixl", "prefill", caches)
    pair.hold(conn, args.iters + 1, args.blocks, args.block_size)
    print(json.dumps({"ports": {"nixl": conn.connector_worker.port}}), file=out, flush=True)
    pair.serve_until_stdin_closes([conn])


def run_decode(args: argparse.Namespace) -> None:
    out = pair.private_stdout()
    kvc = pair.geometry(args, "nixl", "decode")[1]
    caches = pair.make_caches(args, kvc, fill=False)
    conn = pair.make_connector(args, "nixl", "decode", caches)
    port = args.peer["ports"]["nixl"]
    blocks = list(range(args.blocks))
    nbytes = pair.read_bytes(conn, args.blocks)
    try:
        pair.connector_read(conn, 0, "nixl", port, args)  # warm-up: handshake, connection
        ok = pair.caches_equal(caches, pair.make_caches(args, kvc, fill=True), args.blocks)
        nixl_raw_read(conn, PEER, blocks)  # warm-up of the raw path
        conn_s, raw_s = [], []
        for i in range(1, args.iters + 1):
            conn_s.append(pair.connector_read(conn, i, "nixl", port, args))
            raw_s.append(nixl_raw_read(conn, PEER, blocks))
    finally:
        conn.shutdown()
    result = {"bytes": nbytes, "connector_s": conn_s, "raw_s": raw_s, "verified": ok}
    print(json.dumps(result), file=out, flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: a few MB per read")
    pair.add_geometry_args(ap)
    ap.add_argument("--backends", default="UCX")
    ap.add_argument("--out", help="also write the result as JSON here")
    args = ap.parse_args()
    if args.quick:
        pair.quick_geometry(args)
    pair.check_geometry(ap, args)
    return args


def main() -> None:
    args = parse_args()
    if args.role == "prefill":
        return run_prefill(args)
    if args.role == "decode":
        return run_decode(args)
    res = pair.run_pair(__file__, args)
    gb = res["bytes"] / 1e9
    conn_bw = gb / statistics.median(res["connector_s"])
    raw_bw = gb / statistics.median(res["raw_s"])
    ratio = conn_bw / raw_bw
    print(
        f"read size {res['bytes'] / 2**20:.1f} MiB ({args.blocks} blocks x {args.layers} layers x "
        f"K,V), {args.iters} reads each, device {args.device}, data verified: {res['verified']}"
    )
    print("| path | median GB/s | reads (s) |\n|---|---|---|")
    for name, bw, times in (
        ("connector", conn_bw, res["connector_s"]),
        ("raw NIXL READ", raw_bw, res["raw_s"]),
    ):
        print(f"| {name} | {bw:.2f} | {', '.join(f'{t:.4f}' for t in times)} |")
    verdict = "meets" if ratio >= 0.7 else "MISSES"
    print(f"connector / raw = {ratio:.0%} ({verdict} the >= 70% target)")
    if args.out:
        payload: dict[str, Any] = {
            **res,
            "connector_gbps": conn_bw,
            "raw_gbps": raw_bw,
            "ratio": ratio,
            "args": vars(args),
        }
        Path(args.out).write_text(json.dumps(payload, indent=2))
    if not res["verified"]:
        raise SystemExit("the data read does not match the prefill side's")


if __name__ == "__main__":
    main()
