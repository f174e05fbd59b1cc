"""``vllm.utils.math_utils``: integer helpers."""

from __future__ import annotations

__all__ = ["cdiv", "round_down", "round_up"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)


def round_up(x: int, y: int) -> int:
    return ((x + y - 1) // y) * y


def round_down(x: int, y: int) -> int:
    return (x // y) * y
