"""Two processes driving P/D connectors directly, for the P/D bandwidth benchmarks.

``benchmarks/nixl_bandwidth.py`` and ``benchmarks/pd_bandwidth.py`` run the same shape: a
*prefill* child fills a KV pool, registers it with the worker side of one P/D connector per
transfer family (NixlConnector, MooncakeConnector: the same tensors registered with each)
and holds "requests" over the same blocks; a *decode* child with a zeroed pool of the same
layout reads them and measures. No model and no scheduler: the connector gets the metadata
the scheduler would send (:class:`SendSpec` on the prefill side, :class:`RecvSpec` on the
decode side), so a read goes through the connector's whole path: side-channel claim, the
transport's READ, the completion notification the prefill side frees on.

The prefill child's first stdout line is a JSON object (its side-channel ports and whatever
the script adds); the parent hands it to the decode child as ``--peer``. Results travel on
stdout too, so everything the libraries print goes to stderr (:func:`private_stdout`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

SEED = 1234
DTYPES = ("bfloat16", "float16", "float32")
# Transfer family -> the connector that moves KV with it.
FAMILIES = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}


def engine_id(role: str, family: str) -> str:
    """The engine id of ``role``'s connector of ``family`` (one per family and process)."""
    return f"bench-{role}-{family}"


def add_geometry_args(ap: argparse.ArgumentParser) -> None:
    """The pool layout and read size, shared by the P/D bandwidth scripts."""
    ap.add_argument("--blocks", type=int, default=256, help="blocks per read")
    ap.add_argument("--num-blocks", type=int, default=512, help="blocks in each pool")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--role", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--peer", type=json.loads, help=argparse.SUPPRESS)


def quick_geometry(args: argparse.Namespace) -> None:
    """``--quick``: a few MB per read, fp32."""
    args.layers, args.kv_heads, args.head_dim, args.dtype = 4, 2, 64, "float32"
    args.blocks, args.num_blocks = min(args.blocks, 64), min(args.num_blocks, 128)


def check_geometry(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0 < args.blocks <= args.num_blocks:
        ap.error(f"--blocks must be in 1..--num-blocks ({args.num_blocks}), got {args.blocks}")
    if args.iters < 1:
        ap.error("--iters must be at least 1")


def geometry(args: argparse.Namespace, family: str, role: str) -> tuple[Any, Any]:
    """(what a P/D connector reads of an engine config, the KV cache config)."""
    import torch

    from kvferry.config import KVTransferConfig
    from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec

    group = KVCacheGroupSpec(
        layer_names=tuple(f"model.layers.{i}.self_attn" for i in range(args.layers)),
        block_size=args.block_size,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=getattr(torch, args.dtype),
    )
    kvc = KVCacheConfig(num_blocks=args.num_blocks, groups=(group,))
    extra: dict[str, Any] = {
        "side_channel_port": 0,
        # Long enough that no hold or read of a slow full run ever times out.
        "kv_lease_duration": 600.0,
        "transfer_timeout": 600.0,
    }
    if family == "nixl":
        extra["backends"] = args.backends.split(",")
    else:
        extra["mooncake_protocol"] = args.protocol
    kvt = KVTransferConfig(
        kv_connector=FAMILIES[family],
        kv_role="kv_both",
        engine_id=engine_id(role, family),
        kv_connector_extra_config=extra,
    )
    arch = SimpleNamespace(architecture="bench", layers=args.layers)  # only hashed
    config = SimpleNamespace(
        kv_transfer_config=kvt,
        model_config=SimpleNamespace(model="bench", arch=arch),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return config, kvc


def make_caches(args: argparse.Namespace, kvc: Any, fill: bool) -> dict[str, Any]:
    """One (2, N, B, H, D) tensor per layer: seeded random values, or zeros."""
    import torch

    g = kvc.groups[0]
    shape = (2, kvc.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
    gen = torch.Generator().manual_seed(SEED)
    out = {}
    for name in g.layer_names:
        if fill:
            t = torch.randn(shape, generator=gen).to(g.dtype)
        else:
            t = torch.zeros(shape, dtype=g.dtype)
        out[name] = t.to(args.device)
    return out


def make_connector(args: argparse.Namespace, family: str, role: str, caches: dict[str, Any]) -> Any:
    """The worker side of ``family``'s connector, with ``caches`` registered."""
    from kvferry.kv_transfer.base import KVConnectorRole

    config, kvc = geometry(args, family, role)
    if family == "nixl":
        from kvferry.kv_transfer.connectors.nixl.connector import NixlConnector

        conn: Any = NixlConnector(config, KVConnectorRole.WORKER, kvc)
    else:
        from kvferry.kv_transfer.connectors.mooncake.connector import MooncakeConnector

        conn = MooncakeConnector(config, KVConnectorRole.WORKER, kvc)
    conn.register_kv_caches(caches)
    return conn


def read_bytes(conn: Any, blocks: int) -> int:
    """Bytes one read of ``blocks`` blocks moves (every layer, K and V)."""
    layout = conn.connector_worker.transport.layout
    return 2 * blocks * layout.block_bytes * layout.num_layers


def private_stdout() -> Any:
    """Our results get stdout to themselves; the libraries' prints go to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def hold(conn: Any, count: int, blocks: int, block_size: int) -> None:
    """Prefill side: hold ``count`` requests ``bench-0`` .. over blocks ``0..blocks-1``."""
    from kvferry.kv_transfer.connectors.pd.metadata import PDConnectorMetadata, SendSpec

    ids = list(range(blocks))
    sends = [SendSpec(f"bench-{i}", ids, blocks * block_size, "digest") for i in range(count)]
    conn.connector_worker.bind(PDConnectorMetadata(reqs_to_send=sends))


def serve_until_stdin_closes(conns: Sequence[Any]) -> None:
    """Prefill side: poll the connectors (completion notifications free the holds) until
    the parent closes our stdin, then shut them down."""
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not stop.is_set():
        for conn in conns:
            conn.connector_worker.get_finished()
        time.sleep(0.0002)
    for conn in conns:
        conn.shutdown()


def connector_read(conn: Any, i: int, family: str, port: int, args: argparse.Namespace) -> float:
    """Decode side: read held request ``bench-i`` through the connector; its seconds."""
    from kvferry.kv_transfer.connectors.pd.metadata import (
        PDConnectorMetadata,
        RecvSpec,
        RemoteRef,
    )

    blocks = list(range(args.blocks))
    ref = RemoteRef(engine_id("prefill", family), "127.0.0.1", port, f"bench-{i}")
    spec = RecvSpec(f"r{i}", ref, blocks, blocks, args.blocks * args.block_size, "digest")
    worker = conn.connector_worker
    t0 = time.perf_counter()
    worker.start_load(PDConnectorMetadata(reqs_to_recv=[spec]), empty_step=False)
    while True:
        _, done = worker.get_finished()
        if done:
            break
        # An engine polls once per step; spinning here would starve the connector's
        # threads (claim, transfer) of the GIL, which no engine does.
        time.sleep(0.00005)
    seconds = time.perf_counter() - t0
    if worker.get_failed_recving():
        raise RuntimeError(f"{FAMILIES[family]}'s read failed (see the log)")
    return seconds


def caches_equal(got: dict[str, Any], want: dict[str, Any], blocks: int) -> bool:
    """Are the first ``blocks`` blocks of every layer (K and V) identical?"""
    import torch

    return all(torch.equal(got[k][:, :blocks].cpu(), want[k][:, :blocks].cpu()) for k in got)


def _child(script: str, args: argparse.Namespace, extra: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, script, *sys.argv[1:], *extra]
    env = {**os.environ}
    if args.device == "cpu":
        env.setdefault("UCX_NET_DEVICES", "lo")  # one host: UCX over loopback
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def run_pair(script: str, args: argparse.Namespace, timeout_s: float = 1800) -> dict[str, Any]:
    """Start ``script``'s prefill child, then its decode child (given the prefill child's
    first stdout line as ``--peer``); returns the decode child's last stdout line as JSON.
    Both children are stopped on every path out."""
    prefill = _child(script, args, ["--role", "prefill"])
    assert prefill.stdout is not None and prefill.stdin is not None
    decode: subprocess.Popen[str] | None = None
    try:
        line = prefill.stdout.readline().strip()
        if not line:
            raise SystemExit(f"the prefill child ended before it was ready ({prefill.wait(60)})")
        decode = _child(script, args, ["--role", "decode", "--peer", line])
        out, _ = decode.communicate(timeout=timeout_s)
        if decode.returncode != 0:
            raise SystemExit(f"the decode child failed ({decode.returncode}); its log is above")
        lines = out.strip().splitlines()
        if not lines:
            raise SystemExit("the decode child reported nothing")
        res: dict[str, Any] = json.loads(lines[-1])
    finally:
        if decode is not None and decode.poll() is None:
            decode.kill()
            decode.wait(60)
        try:
            prefill.stdin.close()
            prefill.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            prefill.kill()
            prefill.wait(60)
    return res
