"""Int64 tensors from Python ints, for the per-step index tensors (token ids, positions,
slots, block tables)."""

from __future__ import annotations

import array
from collections.abc import Iterable

import torch


def long_tensor(values: Iterable[int], device: torch.device | None = None) -> torch.Tensor:
    """A 1-D int64 tensor of ``values`` (on ``device`` when given).

    ``torch.tensor`` converts a list of Python ints element by element, which for a block
    table every step adds up; ``array('q')`` fills a C buffer in one loop and the tensor
    wraps it. The tensor keeps the buffer alive.
    """
    buf = array.array("q", values)
    t = torch.frombuffer(buf, dtype=torch.int64) if buf else torch.empty(0, dtype=torch.int64)
    return t if device is None or device.type == "cpu" else t.to(device)
