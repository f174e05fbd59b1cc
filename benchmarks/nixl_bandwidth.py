"""NixlConnector transfer bandwidth vs a raw NIXL READ of the same bytes, same two processes.

Two child processes each own a KV pool and the worker side of a NixlConnector (no model: the
connector is driven directly with the metadata the scheduler would send). The prefill child
fills its pool and holds ``--iters`` + 1 "requests" over the same blocks; the decode child
measures, interleaved:

* **connector**: a read through the connector's full path: ``start_load_kv`` -> side-channel
  claim -> READ of one descriptor per (layer, K|V, block) -> completion seen by
  ``get_finished`` (the prefill side frees on the notification). The first read (handshake,
  NIXL metadata load, UCX connection set-up) is a warm-up and not counted.
* **raw**: ``make_prepped_xfer`` + ``transfer`` + polling ``check_xfer_state`` of the same
  local/remote descriptors between the same two agents, no side channel.

Reported: median GB/s of each and connector/raw (target >= 70%). The data read is verified
once against the prefill side's fill pattern.

    .venv/bin/python benchmarks/nixl_bandwidth.py --quick        # smoke run, a few MB
    .venv/bin/python benchmarks/nixl_bandwidth.py                # full: 512 MiB per read
    .venv/bin/python benchmarks/nixl_bandwidth.py --device cuda  # device memory (VRAM)

UCX chooses the transport (UCX_TLS, UCX_NET_DEVICES); on one host without RDMA it usually
copies host memory with cross-memory attach, between hosts it uses TCP or RDMA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SEED = 1234
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _geometry(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    from kvferry.config import KVTransferConfig
    from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec

    dtype = getattr(torch, args.dtype)
    group = KVCacheGroupSpec(
        layer_names=tuple(f"model.layers.{i}.self_attn" for i in range(args.layers)),
        block_size=args.block_size,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=dtype,
    )
    kvc = KVCacheConfig(num_blocks=args.num_blocks, groups=(group,))
    kvt = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_both",
        engine_id=f"bench-{args.role}",
        kv_connector_extra_config={
            "side_channel_port": 0,
            "kv_lease_duration": 600.0,
            "backends": args.backends.split(","),
            "transfer_timeout": 600.0,
        },
    )
    arch = SimpleNamespace(architecture="bench", layers=args.layers)  # only hashed
    config = SimpleNamespace(
        kv_transfer_config=kvt,
        model_config=SimpleNamespace(model="bench", arch=arch),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return config, kvc


def _caches(args: argparse.Namespace, kvc: Any, fill: bool) -> dict[str, Any]:
    import torch

    g = kvc.groups[0]
    shape = (2, kvc.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
    gen = torch.Generator().manual_seed(SEED)
    out = {}
    for name in g.layer_names:
        t = (
            torch.randn(shape, generator=gen).to(g.dtype)
            if fill
            else torch.zeros(shape, dtype=g.dtype)
        )
        out[name] = t.to(args.device)
    return out


def _connector(args: argparse.Namespace, fill: bool) -> tuple[Any, dict[str, Any]]:
    from kvferry.kv_transfer.base import KVConnectorRole
    from kvferry.kv_transfer.connectors.nixl.connector import NixlConnector

    config, kvc = _geometry(args)
    conn = NixlConnector(config, KVConnectorRole.WORKER, kvc)
    caches = _caches(args, kvc, fill)
    conn.register_kv_caches(caches)
    return conn, caches


def _private_stdout() -> Any:
    """Our results get stdout to themselves; NIXL's and UCX's prints go to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def run_prefill(args: argparse.Namespace) -> None:
    out = _private_stdout()
    from kvferry.kv_transfer.connectors.pd.metadata import PDConnectorMetadata, SendSpec

    conn, _ = _connector(args, fill=True)
    worker = conn.connector_worker
    blocks = list(range(args.blocks))
    n = args.blocks * args.block_size
    sends = [SendSpec(f"bench-{i}", blocks, n, "digest") for i in range(2 * args.iters + 2)]
    worker.bind(PDConnectorMetadata(reqs_to_send=sends))
    print(json.dumps({"port": worker.port}), file=out, flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        worker.get_finished()
        time.sleep(0.0002)
    conn.shutdown()


def _connector_read(conn: Any, i: int, port: int, args: argparse.Namespace) -> float:
    from kvferry.kv_transfer.connectors.pd.metadata import (
        PDConnectorMetadata,
        RecvSpec,
        RemoteRef,
    )

    blocks = list(range(args.blocks))
    ref = RemoteRef("bench-prefill", "127.0.0.1", port, f"bench-{i}")
    spec = RecvSpec(f"r{i}", ref, blocks, blocks, args.blocks * args.block_size, "digest")
    worker = conn.connector_worker
    t0 = time.perf_counter()
    worker.start_load(PDConnectorMetadata(reqs_to_recv=[spec]), empty_step=False)
    while True:
        _, done = worker.get_finished()
        if done:
            break
        # An engine polls once per step; spinning here would starve the claim's thread of
        # the GIL, which no engine does.
        time.sleep(0.00005)
    seconds = time.perf_counter() - t0
    if worker.get_failed_recving():
        raise RuntimeError("the connector's read failed (see the log)")
    return seconds


def _raw_read(conn: Any, args: argparse.Namespace) -> float:
    worker = conn.connector_worker
    transport = worker.transport
    peer = worker.reader.peer("bench-prefill")
    blocks = list(range(args.blocks))
    agent = transport.agent
    t0 = time.perf_counter()
    handle = agent.make_prepped_xfer(
        "READ",
        transport.local_dlist,
        transport.layout.indices(blocks),
        peer.dlist,
        peer.layout.indices(blocks),
        b"",
    )
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    seconds = time.perf_counter() - t0
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"raw READ ended in state {state}")
    return seconds


def run_decode(args: argparse.Namespace) -> None:
    out = _private_stdout()
    import torch

    conn, caches = _connector(args, fill=False)
    nbytes = 2 * args.blocks * conn.connector_worker.transport.layout.block_bytes * args.layers
    _connector_read(conn, 0, args.port, args)  # warm-up: handshake, metadata, connection
    expected = _caches(args, _geometry(args)[1], fill=True)
    ok = all(
        torch.equal(caches[k][:, : args.blocks].cpu(), expected[k][:, : args.blocks].cpu())
        for k in caches
    )
    _raw_read(conn, args)  # warm-up of the raw path
    conn_s, raw_s = [], []
    for i in range(1, args.iters + 1):
        conn_s.append(_connector_read(conn, i, args.port, args))
        raw_s.append(_raw_read(conn, args))
    conn.shutdown()
    result = {"bytes": nbytes, "connector_s": conn_s, "raw_s": raw_s, "verified": ok}
    print(json.dumps(result), file=out, flush=True)


def _child(role: str, args: argparse.Namespace, extra: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--role", role, *sys.argv[1:], *extra]
    env = {**os.environ}
    if args.device == "cpu":
        env.setdefault("UCX_NET_DEVICES", "lo")
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: a few MB per read")
    ap.add_argument("--blocks", type=int, default=256, help="blocks per read")
    ap.add_argument("--num-blocks", type=int, default=512, help="blocks in each pool")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--backends", default="UCX")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", help="also write the result as JSON here")
    ap.add_argument("--role", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.kv_heads, args.head_dim, args.dtype = 4, 2, 64, "float32"
        args.blocks, args.num_blocks = min(args.blocks, 64), min(args.num_blocks, 128)
    return args


def run_pair(args: argparse.Namespace) -> dict[str, Any]:
    """Start the prefill child, then the decode child that measures; the decode result."""
    prefill = _child("prefill", args, [])
    assert prefill.stdout is not None and prefill.stdin is not None
    try:
        port = json.loads(prefill.stdout.readline())["port"]
        decode = _child("decode", args, ["--port", str(port)])
        out, _ = decode.communicate(timeout=1800)
        if decode.returncode != 0:
            raise SystemExit(f"decode child failed ({decode.returncode})")
        res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    finally:
        prefill.stdin.close()
        prefill.wait(60)
    return res


def main() -> None:
    args = parse_args()
    if args.role == "prefill":
        return run_prefill(args)
    if args.role == "decode":
        return run_decode(args)
    res = run_pair(args)
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
        payload = {
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
