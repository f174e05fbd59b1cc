"""``init_logger``: connector loggers go through kvferry's log handler and level."""

from __future__ import annotations

import logging

from kvferry.logger import init_logger as _kvferry_logger

__all__ = ["init_logger"]


def init_logger(name: str) -> logging.Logger:
    """A logger under ``kvferry.connector.<name>`` (kvferry's own modules keep their names)."""
    return _kvferry_logger(name if name.startswith("kvferry") else f"kvferry.connector.{name}")
