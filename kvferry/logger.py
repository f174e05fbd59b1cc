"""Structured logging: ``key=value`` pairs after a short message, one line per event."""

from __future__ import annotations

import logging
import sys
from typing import Any

from kvferry import envs

_CONFIGURED = False


def init_logger(name: str) -> logging.Logger:
    global _CONFIGURED
    if not _CONFIGURED:
        root = logging.getLogger("kvferry")
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(
                logging.Formatter("%(levelname)s %(asctime)s %(name)s] %(message)s", "%H:%M:%S")
            )
            root.addHandler(handler)
        root.setLevel(envs.log_level())
        root.propagate = False
        _CONFIGURED = True
    return logging.getLogger(name)


def fmt_fields(msg: str, **fields: Any) -> str:
    """Format a structured log line: ``msg k1=v1 k2=v2``."""
    parts = [msg]
    for k, v in fields.items():
        parts.append(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)
