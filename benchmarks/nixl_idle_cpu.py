"""Idle CPU and listening sockets of one ``kvferry serve`` instance with the NixlConnector.

Starts the server on 127.0.0.1 (side channel port 0), waits until ``/health`` answers and a
few seconds more, then reports the process's CPU time over ``--seconds`` as a share of one
core, and every address it listens on (HTTP, side channel, UCX).

    .venv/bin/python benchmarks/nixl_idle_cpu.py MODEL_DIR [--seconds 30]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.kv_configs import nixl_kv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    port = _free_port()
    kv = nixl_kv(ip="127.0.0.1")
    cmd = [
        sys.executable, "-m", "kvferry.entrypoints.cli", "serve", args.model,
        "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the server did not come up") from None
                time.sleep(0.2)
        time.sleep(3)
        p = psutil.Process(proc.pid)
        t0, w0 = p.cpu_times(), time.monotonic()
        time.sleep(args.seconds)
        t1, w1 = p.cpu_times(), time.monotonic()
        cpu = (t1.user - t0.user + t1.system - t0.system) / (w1 - w0)
        print(f"idle CPU over {w1 - w0:.1f} s: {100 * cpu:.2f}% of one core")
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                print(f"listening on {c.laddr.ip}:{c.laddr.port}")
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
