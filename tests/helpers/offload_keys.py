"""Stand-in block hashes for the offload unit tests."""

from __future__ import annotations


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")
