"""How fast is the machine right now? A short GEMM and copy probe, around each launch.

On a shared VM both engines' absolute numbers move by tens of percent from hour to hour (other
tenants share the last-level cache and the memory channels, and the load average does not see
them). A probe taken right before each launch, on the otherwise idle machine, tells a slow
launch from a slow hour: when the probes of two launches differ as much as their results, the
machine moved, not the engine.

The probe runs in its own process (``python -m benchmarks.harness.speed_probe``) so that the
harness never holds torch's threads or buffers while a server runs; it takes about 2 s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.bandwidth import measure_copy_bandwidth
from benchmarks.harness.cli import log
from benchmarks.harness.compute import measure_matmul_rate

REPO_ROOT = Path(__file__).resolve().parents[2]
PROBE_TOKENS = 256
COPY_BYTES = 256 << 20  # still far past any last-level cache a guest sees whole


@dataclass(frozen=True)
class MachineSpeed:
    """One probe: the best GEMM rate at one linear-layer shape and the copy bandwidth."""

    dtype: str
    gemm_gflops: float
    copy_gbps: float
    seconds: float


def probe(dtype: str, hidden: int, min_time: float = 0.1) -> MachineSpeed:
    """GEMM rate of ``[256 x hidden] @ [hidden x 4 hidden]`` in ``dtype`` and the copy rate."""
    start = time.perf_counter()
    gemm = measure_matmul_rate(dtype, hidden, tokens=(PROBE_TOKENS,), min_time=min_time, rounds=2)
    copy = measure_copy_bandwidth(COPY_BYTES, min_time=min_time, rounds=2)
    return MachineSpeed(
        dtype, round(gemm.gflops, 1), copy.gbps, round(time.perf_counter() - start, 2)
    )


def probe_in_subprocess(
    python: str, dtype: str, hidden: int, timeout: float = 120.0
) -> dict[str, Any]:
    """:func:`probe` in a fresh ``python`` process; its fields as a dict."""
    argv = [python, "-m", "benchmarks.harness.speed_probe", "--dtype", dtype]
    argv += ["--hidden", str(hidden)]
    r = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO_ROOT
    )
    if r.returncode != 0:
        raise RuntimeError(f"speed probe exited with {r.returncode}: {r.stderr.strip()[-500:]}")
    lines = r.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not {"gemm_gflops", "copy_gbps"} <= doc.keys():
        raise RuntimeError(f"speed probe printed no result: {r.stdout.strip()[-200:]!r}")
    return doc


def probe_or_none(python: str, dtype: str, hidden: int, when: str) -> dict[str, Any] | None:
    """:func:`probe_in_subprocess`, logged as taken ``when`` (e.g. "before" a launch); None,
    with a warning, where it fails: a failed probe costs a launch its record, not the run."""
    try:
        speed = probe_in_subprocess(python, dtype, hidden)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        log(f"[probe] WARNING: no probe {when} this launch: {e}")
        return None
    log(
        f"[probe] {when}: {dtype} GEMM {speed['gemm_gflops']:.0f} GFLOP/s, "
        f"copy {speed['copy_gbps']:.1f} GB/s"
    )
    return speed


def spread_text(probes: Sequence[dict[str, Any]]) -> str:
    """One line on a model's probes, e.g. ``GEMM (bfloat16) 1,980-2,240 GFLOP/s (spread 13%),
    copy 25.1-26.3 GB/s (5%)``; empty without probes."""
    if not probes:
        return ""
    g = [p["gemm_gflops"] for p in probes]
    c = [p["copy_gbps"] for p in probes]

    def spread(v: list[float]) -> str:
        return f"{(max(v) / min(v) - 1) * 100:.0f}%" if min(v) > 0 else "-"

    return (
        f"GEMM ({probes[0]['dtype']}) {min(g):,.0f}-{max(g):,.0f} GFLOP/s (spread {spread(g)}), "
        f"copy {min(c):.1f}-{max(c):.1f} GB/s ({spread(c)})"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--min-time", type=float, default=0.1)
    args = ap.parse_args(argv)
    if args.hidden <= 0:
        ap.error("--hidden must be positive")
    print(json.dumps(asdict(probe(args.dtype, args.hidden, args.min_time))))


if __name__ == "__main__":
    main()
