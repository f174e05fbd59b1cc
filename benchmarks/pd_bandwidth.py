"""P/D transfer bandwidth: MooncakeConnector vs a raw transfer-engine read vs NixlConnector.

Two child processes on 127.0.0.1, each with one KV pool registered with both a
MooncakeConnector and a NixlConnector (the same tensors: every path moves the same bytes
between the same two pools). The prefill child fills its pool and holds requests over the
same ``--blocks`` blocks; the decode child measures, alternating (the order rotates each
round):

* ``mooncake connector``: ``start_load_kv`` -> side-channel claim -> the connector's batched
  transfer-engine read with its completion notification -> ``get_finished``;
* ``mooncake raw``: ``batch_transfer_sync_read`` of the same entries (one per layer, K|V,
  run of consecutive blocks) between the same two transfer engines, nothing else;
* ``mooncake contiguous``: one ``transfer_sync_read`` of a contiguous buffer of the same
  size (the engine's ceiling here);
* ``nixl connector`` and ``nixl raw``: as ``benchmarks/nixl_bandwidth.py`` measures them.

The first read of each path (handshakes, connections) is a warm-up and checks the data
byte for byte; it is not counted. Reported: median GB/s per path, MooncakeConnector / raw
transfer engine (target >= 70%), and MooncakeConnector vs NixlConnector.

    .venv/bin/python benchmarks/pd_bandwidth.py --quick   # smoke run, a few MB
    .venv/bin/python benchmarks/pd_bandwidth.py           # full: 512 MiB per read (quiet machine)

Mooncake runs over TCP here (``--protocol rdma`` where the host has RDMA NICs); UCX chooses
NIXL's transport (on one host: usually a cross-memory-attach copy).
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

from benchmarks.harness import pd_bandwidth_pair as pair
from benchmarks.harness import pd_bandwidth_raw as raw
from benchmarks.harness.markdown import markdown_table, update_doc
from benchmarks.harness.paths import IMG_DIR
from benchmarks.harness.plots import bar_plot
from benchmarks.harness.quiet import read_loadavg, wait_until
from benchmarks.harness.results import result_path, run_header, write_results_json

MC_CONN, MC_RAW, MC_CONTIG = "mooncake connector", "mooncake raw", "mooncake contiguous"
NX_CONN, NX_RAW = "nixl connector", "nixl raw"
PATHS = {"mooncake": [MC_CONN, MC_RAW, MC_CONTIG], "nixl": [NX_CONN, NX_RAW]}
TARGET = 0.7


def run_prefill(args: argparse.Namespace) -> None:
    out = pair.private_stdout()
    caches = pair.make_caches(args, pair.geometry(args, "nixl", "prefill")[1], fill=True)
    conns = {f: pair.make_connector(args, f, "prefill", caches) for f in args.families}
    for conn in conns.values():
        pair.hold(conn, args.iters + 1, args.blocks, args.block_size)
    info: dict[str, Any] = {"ports": {f: c.connector_worker.port for f, c in conns.items()}}
    scratch = None
    if "mooncake" in conns:
        nbytes = pair.read_bytes(conns["mooncake"], args.blocks)
        pattern = raw.scratch_pattern(nbytes, pair.SEED)
        scratch = raw.register_scratch(conns["mooncake"], nbytes, args.device, pattern)
        info["scratch"] = scratch.data_ptr()
    print(json.dumps(info), file=out, flush=True)
    try:
        pair.serve_until_stdin_closes(list(conns.values()))
    finally:
        del scratch  # after the engines closed


class Decode:
    """The decode child: every path's reads, and their checks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        kvc = pair.geometry(args, "nixl", "decode")[1]
        self.caches = pair.make_caches(args, kvc, fill=False)
        self.expected = pair.make_caches(args, kvc, fill=True)
        self.conns = {f: pair.make_connector(args, f, "decode", self.caches) for f in args.families}
        self.ports: dict[str, int] = args.peer["ports"]
        self.blocks = list(range(args.blocks))
        self.next_req = dict.fromkeys(self.conns, 0)
        first = next(iter(self.conns.values()))
        self.nbytes = pair.read_bytes(first, args.blocks)
        self.scratch: Any = None
        if "mooncake" in self.conns:
            self.scratch = raw.register_scratch(self.conns["mooncake"], self.nbytes, args.device)

    def read(self, path: str) -> float:
        family = path.split()[0]
        conn, peer = self.conns[family], pair.engine_id("prefill", family)
        if path in (MC_CONN, NX_CONN):
            i = self.next_req[family]
            self.next_req[family] += 1
            return pair.connector_read(conn, i, family, self.ports[family], self.args)
        if path == NX_RAW:
            return raw.nixl_raw_read(conn, peer, self.blocks)
        if path == MC_RAW:
            return raw.mooncake_raw_read(conn, peer, self.blocks)
        session = raw.mooncake_session(conn, peer)
        addr = self.scratch.data_ptr()
        return raw.mooncake_contiguous_read(
            conn, session, addr, self.args.peer["scratch"], self.nbytes
        )

    def checked_read(self, path: str) -> bool:
        """A warm-up read into zeroed memory; did the right bytes arrive?"""
        if path == MC_CONTIG:
            self.scratch.zero_()
            self.read(path)
            want = raw.scratch_pattern(self.nbytes, pair.SEED)
            return bytes(self.scratch.cpu().numpy().tobytes()) == want
        for t in self.caches.values():
            t.zero_()
        self.read(path)
        return pair.caches_equal(self.caches, self.expected, self.args.blocks)

    def run(self) -> dict[str, Any]:
        paths = [p for f in self.args.families for p in PATHS[f]]
        # Connector paths first: their first read loads the peer the raw paths use.
        verified = {p: self.checked_read(p) for p in paths}
        times: dict[str, list[float]] = {p: [] for p in paths}
        for i in range(self.args.iters):
            k = i % len(paths)
            for p in paths[k:] + paths[:k]:
                times[p].append(self.read(p))
        return {"bytes": self.nbytes, "times_s": times, "verified": verified}

    def close(self) -> None:
        if self.scratch is not None:
            raw.unregister_scratch(self.conns["mooncake"], self.scratch)
        for conn in self.conns.values():
            conn.shutdown()


def run_decode(args: argparse.Namespace) -> None:
    out = pair.private_stdout()
    decode = Decode(args)
    try:
        result = decode.run()
    finally:
        decode.close()
    print(json.dumps(result), file=out, flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: a few MB per read")
    pair.add_geometry_args(ap)
    ap.add_argument("--families", default="mooncake,nixl", help="mooncake, nixl or both")
    ap.add_argument("--protocol", choices=["tcp", "rdma"], default="tcp", help="Mooncake's")
    ap.add_argument("--backends", default="UCX", help="NIXL's")
    ap.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--allow-noise", action="store_true", help="measure on a busy machine")
    args = ap.parse_args()
    if args.quick:
        pair.quick_geometry(args)
        args.iters = min(args.iters, 3)
    pair.check_geometry(ap, args)
    families = [f for f in args.families.split(",") if f]
    if not families or set(families) - set(pair.FAMILIES) or len(set(families)) < len(families):
        ap.error(f"--families takes a comma-separated subset of {sorted(pair.FAMILIES)}")
    args.families = families
    return args


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    gb = res["bytes"] / 1e9
    gbps = {p: gb / statistics.median(t) for p, t in res["times_s"].items()}
    ratios: dict[str, float] = {}
    for name, (a, b) in {
        "mooncake_connector_vs_raw": (MC_CONN, MC_RAW),
        "mooncake_connector_vs_contiguous": (MC_CONN, MC_CONTIG),
        "mooncake_raw_vs_contiguous": (MC_RAW, MC_CONTIG),
        "mooncake_connector_vs_nixl_connector": (MC_CONN, NX_CONN),
        "mooncake_raw_vs_nixl_raw": (MC_RAW, NX_RAW),
        "nixl_connector_vs_raw": (NX_CONN, NX_RAW),
    }.items():
        if a in gbps and b in gbps:
            ratios[name] = gbps[a] / gbps[b]
    return {"gbps": gbps, "ratios": ratios}


def _headline(res: dict[str, Any], s: dict[str, Any], mib: str) -> tuple[str, str]:
    g, r = s["gbps"], s["ratios"]
    rows: list[list[Any]] = []
    verdict = "not measured"
    if "mooncake_connector_vs_raw" in r:
        ok = r["mooncake_connector_vs_raw"] >= TARGET
        verdict = "met" if ok else "NOT met"
        rows.append(
            [
                f"KV read through MooncakeConnector, {mib}",
                f"{g[MC_CONN]:.2f} GB/s: **{r['mooncake_connector_vs_raw']:.0%}** of raw",
                f"a raw transfer-engine batch read of the same entries ({g[MC_RAW]:.2f} GB/s)",
            ]
        )
        rows.append(
            [
                "the same",
                f"{r['mooncake_connector_vs_contiguous']:.0%}",
                f"one contiguous transfer-engine read of {mib} ({g[MC_CONTIG]:.2f} GB/s)",
            ]
        )
    if "mooncake_connector_vs_nixl_connector" in r:
        rows.append(
            [
                "KV read through MooncakeConnector vs NixlConnector, same bytes",
                f"{r['mooncake_connector_vs_nixl_connector']:.2f}x",
                f"NixlConnector ({g[NX_CONN]:.2f} GB/s; raw NIXL {g[NX_RAW]:.2f} GB/s)",
            ]
        )
    return markdown_table(["what", "how much", "vs whom"], rows), verdict


def report(res: dict[str, Any], s: dict[str, Any], args: argparse.Namespace) -> str:
    mib = f"{res['bytes'] / 2**20:.1f} MiB"
    times = res["times_s"]
    table = markdown_table(
        ["path", "median GB/s", "data verified", "reads (s)"],
        [
            [p, s["gbps"][p], res["verified"][p], ", ".join(f"{t:.4f}" for t in times[p])]
            for p in times
        ],
    )
    print(f"read size {mib} ({args.blocks} blocks x {args.layers} layers x K,V), "
          f"{args.iters} reads per path, device {args.device}")  # fmt: skip
    print(table)
    for name, value in s["ratios"].items():
        print(f"{name}: {value:.0%}")
    if args.no_docs:
        return table
    quick = args.quick
    cmd = f"benchmarks/pd_bandwidth.py{' --quick' if quick else ''}"
    headline, verdict = _headline(res, s, mib)
    if quick:
        verdict = f"{verdict} here; the target applies to the full run, not to this smoke run"
    plot = bar_plot(
        IMG_DIR / f"pd_bandwidth{'_quick' if quick else ''}.png",
        list(times),
        {"median GB/s": [s["gbps"][p] for p in times]},
        f"P/D read of {mib}, two processes on one host",
        "GB/s",
    )
    m = res["machine"]
    machine = (
        f"{m.get('cpu_model', m.get('processor', '?'))}, {m.get('cpu_count')} cores, "
        f"{m.get('memory_gib', '?')} GiB, load average {m.get('loadavg')}, "
        f"torch {m.get('torch', '?')}, commit {m.get('git_commit', '?')}"
    )
    title = "P/D transfer bandwidth: MooncakeConnector, raw transfer engine, NixlConnector"
    update_doc(
        "pd_bandwidth" + ("_quick" if quick else ""),
        f"### {title}{' (smoke run)' if quick else ''}\n\n{headline}\n\n"
        f"Target: MooncakeConnector >= 70% of a raw transfer-engine read ({verdict}).\n\n"
        f"`.venv/bin/python {cmd}` ({res['date']}; {machine}): two processes on 127.0.0.1, "
        f"one KV pool each in {args.device} memory registered with both connectors; every "
        f"path reads the same {mib} ({args.blocks} of {args.num_blocks} blocks x "
        f"{args.layers} layers x K,V, {args.dtype}) between the same two pools, except the "
        f"contiguous read (a separate registered buffer of the same size). Mooncake over "
        f"{args.protocol.upper()}, NIXL over {args.backends}. {args.iters} reads per path, "
        f"alternating (order rotated each round), after a checked warm-up read; median.\n\n"
        f"{table}\n\n![P/D bandwidth](img/{plot.name})\n",
    )
    return table


def main() -> None:
    args = parse_args()
    if args.role == "prefill":
        return run_prefill(args)
    if args.role == "decode":
        return run_decode(args)
    if not args.quick and not args.allow_noise:
        wait_until(read_loadavg, 1.0, 300, "1-minute load average", lambda s: print(s))
    header = run_header()
    t0 = time.perf_counter()
    res = {**header, **pair.run_pair(__file__, args)}
    s = summarize(res)
    payload = {**res, **s, "wall_s": time.perf_counter() - t0, "args": vars(args)}
    write_results_json(result_path("pd_bandwidth", args.quick), payload)
    report(res, s, args)
    if not all(res["verified"].values()):
        raise SystemExit("the data read does not match the prefill side's")


if __name__ == "__main__":
    main()
