"""Per-request timeline lines for finding where time before the first token goes.

Logged at DEBUG on the ``kvferry.timeline`` logger (``KVFERRY_LOG_LEVEL=DEBUG``), one line per
event, timestamps as ``time.time()`` seconds so that a client on the same machine can line
them up with its own send and receive times. Events:

- ``tl added``: a request reached the engine thread (``submit``: the server handed it over,
  after tokenization; ``added``: the engine thread enqueued it in the scheduler).
- ``tl sched``: the scheduler planned a step; prefill chunks as ``id:tokens@computed``, and
  how many decodes and tokens the step has.
- ``tl step``: a step's forward and update ran from ``t0`` to ``t1``.
- ``tl first``: a request's first token was handed to its stream (``t``).

The helpers cost one ``isEnabledFor`` check per call when the logger is off.
"""

from __future__ import annotations

import logging

from kvferry.logger import init_logger

logger = init_logger("kvferry.timeline")


def enabled() -> bool:
    return logger.isEnabledFor(logging.DEBUG)


def emit(event: str, **fields: object) -> None:
    """One ``tl <event> k=v ...`` line; floats keep microseconds (they are epoch times)."""
    parts = [f"tl {event}"]
    for k, v in fields.items():
        parts.append(f"{k}={v:.6f}" if isinstance(v, float) else f"{k}={v}")
    logger.debug(" ".join(parts))
