"""EngineCoreOutput: the scheduler's per-request result of one step, read by the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    # "stop" | "length" | "abort" | "error" once the request has finished, else None.
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Returned by the KV connector's request_finished (e.g. for P/D hand-off).
    kv_transfer_params: dict[str, Any] | None = None
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
