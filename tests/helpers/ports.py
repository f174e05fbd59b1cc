"""A local port that nothing listens on, for tests against dead peers."""

from __future__ import annotations

import socket


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
