"""``kvferry conformance``: run a KV connector through the conformance kit
(:mod:`kvferry.testing`) and print its report; exit 1 when a scenario failed."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator


def add_conformance_args(sub: argparse._SubParsersAction) -> None:
    from kvferry.testing import PROFILES, SCENARIOS

    p = sub.add_parser(
        "conformance", help="run a KV connector through the protocol's conformance scenarios"
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--kv-transfer-config",
        help='the connector under test as JSON, e.g. \'{"kv_connector": "MyConnector", '
        '"kv_connector_module_path": "my_pkg.connector", "kv_connector_extra_config": {}}\'',
    )
    what.add_argument(
        "--builtin",
        action="store_true",
        help="run every built-in connector (the report in docs/conformance.md)",
    )
    p.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    p.add_argument(
        "--scenario",
        action="append",
        choices=list(SCENARIOS),
        default=None,
        metavar="NAME",
        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}",
    )
    p.add_argument(
        "--pd",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="drive the hit scenarios through a prefill and a decode engine, the params "
        "handed over as a proxy would (default: on for NixlConnector)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the report as JSON")
    out.add_argument("--markdown", action="store_true", help="print the report as Markdown")
    p.set_defaults(func=cmd_conformance)


def cmd_conformance(args: argparse.Namespace) -> int:
    from kvferry.testing import Harness, builtin_configs, run_conformance

    h = Harness(args.profile)
    # Transports (NIXL/UCX, Mooncake) log from C++ straight to file descriptor 1: a
    # machine-readable report must be all there is on stdout.
    quiet = _stdout_to_stderr() if args.json or args.markdown else contextlib.nullcontext()
    try:
        with quiet:
            if args.builtin:
                configs = builtin_configs(tempfile.mkdtemp(dir=h.workdir, prefix="builtin-"))
            else:
                configs = {"": args.kv_transfer_config}
            reports = {
                label: run_conformance(kv, args.profile, args.scenario, harness=h, pd=args.pd)
                for label, kv in configs.items()
            }
    finally:
        h.close()
    if args.json:
        data = [r.to_dict() | ({"label": k} if k else {}) for k, r in reports.items()]
        print(json.dumps(data[0] if len(data) == 1 and not args.builtin else data, indent=2))
    elif args.markdown:
        print("\n".join(r.to_markdown(k or None) for k, r in reports.items()), end="")
    else:
        print("\n".join(r.to_text() for r in reports.values()), end="")
    return 0 if all(r.ok for r in reports.values()) else 1


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 (and ``sys.stdout``) at stderr for the duration."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
