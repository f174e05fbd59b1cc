"""In-process kvferry engines for the benchmarks that drive ``LLM`` directly."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def make_llm(model: Path, dtype: str, kv: dict[str, Any] | None = None, **kw: Any) -> Any:
    """A ``kvferry.LLM`` on ``model``; ``kv`` is its KV-transfer config (none if None)."""
    from kvferry import LLM

    args: dict[str, Any] = {"dtype": dtype}
    args.update(kw)
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model), **args)


def drain(llm: Any, timeout_s: float = 600.0) -> None:
    """Step an engine with no requests until its connector's transfers are done."""
    engine = llm.engine
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not settle")
        engine.step()
