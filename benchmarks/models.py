"""Random-weight benchmark models, cached under ``.bench/models/<name>``.

The weights are random (no download is possible here): throughput does not depend on
them, and greedy outputs are still deterministic, so backends can be compared token by
token. Models are written with kvferry's generator (``kvferry.model.tiny.make_tiny_model``)
when it exists, else directly with transformers plus a word-level tokenizer that covers
the whole vocabulary. Checkpoints are stored in float32; each backend casts to the
benchmark dtype at load time.

    python benchmarks/models.py            # build all (prints their paths)
    python benchmarks/models.py mid --force
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.compute import linear_flops
from benchmarks.harness.models import SPECS, get_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "names", nargs="*", metavar="NAME", help=f"any of {', '.join(SPECS)} (default: all)"
    )
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--generator", default="auto", choices=["auto", "kvferry", "transformers"])
    args = ap.parse_args()
    unknown = set(args.names) - set(SPECS)
    if unknown:
        ap.error(f"unknown model(s) {sorted(unknown)}; choose from {list(SPECS)}")
    for name in args.names or list(SPECS):
        path = get_model(name, force=args.force, generator=args.generator)
        fl = linear_flops(path)
        print(
            f"{name}: {path}  params={fl.num_params / 1e6:.1f}M  "
            f"linear GFLOP/token={fl.per_token / 1e9:.3f}"
        )


if __name__ == "__main__":
    main()
