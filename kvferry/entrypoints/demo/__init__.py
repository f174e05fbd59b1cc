"""``kvferry demo``: end-to-end demos on localhost.

- ``pd``: prefill/decode disaggregation (:mod:`.pd`);
- ``shared``: two instances sharing KV through a Mooncake Store behind the KV-aware proxy
  (:mod:`.shared`).

The process helpers (:mod:`.processes`) are what tests and benchmarks start servers with.
"""

from __future__ import annotations

import argparse

from kvferry.entrypoints.demo.pd import PROMPTS, default_kv_config, exercise, run_pd
from kvferry.entrypoints.demo.processes import (
    Instance,
    connector_stats,
    scrape,
    start,
    stop,
    transfer_summary,
    wait_healthy,
    wait_listening,
)

__all__ = [
    "PROMPTS",
    "Instance",
    "add_demo_args",
    "connector_stats",
    "default_kv_config",
    "exercise",
    "run_pd",
    "scrape",
    "start",
    "stop",
    "transfer_summary",
    "wait_healthy",
    "wait_listening",
]


def _run(args: argparse.Namespace) -> int:
    if args.which == "shared":
        from kvferry.entrypoints.demo.shared import run_shared

        return run_shared(args)
    return run_pd(args)


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "which",
        choices=["pd", "shared"],
        help="pd: prefill/decode disaggregation; shared: two instances sharing KV through a "
        "Mooncake Store behind the KV-aware proxy",
    )
    p.add_argument("--model", default="models/tiny-llama", help="model folder (made if missing)")
    p.add_argument("--kv-transfer-config", default=None, help="pd: connector JSON for both")
    p.add_argument("--prefill-kv-transfer-config", default=None, help="pd")
    p.add_argument("--decode-kv-transfer-config", default=None, help="pd")
    p.add_argument("--num-requests", type=int, default=3, help="pd")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--server-args",
        default=None,
        help="extra flags for the servers (default: pd: '--kv-cache-memory 256MiB'; shared: "
        "'--num-kv-blocks 48', a small pool, so that its prompts leave it)",
    )
    p.set_defaults(func=_run)
