"""Command-line conventions shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def fill_quick_defaults(args: argparse.Namespace, **defaults: tuple[Any, Any]) -> None:
    """Give every option in ``defaults`` that was left unset (or falsy) its
    ``(quick, full)`` default, by ``args.quick``."""
    for name, (quick, full) in defaults.items():
        setattr(args, name, getattr(args, name) or (quick if args.quick else full))


def log(msg: str) -> None:
    """Progress on stderr, so that stdout holds only the report."""
    print(msg, file=sys.stderr, flush=True)
