"""EngineCoreOutput: the scheduler's per-request result of one step, read by the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvferry.request import PrefillStats, Request, RequestStatus


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
    external_cache_hit_sources: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    # For request metrics: when the first scheduling admitted it, and its preemptions so far.
    first_scheduled_time: float | None = None
    num_preemptions: int = 0

    @classmethod
    def from_request(
        cls,
        request: Request,
        new_token_ids: list[int] | None = None,
        new_logprobs: list[dict[int, float]] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> EngineCoreOutput:
        """The output for ``request`` as it stands (finish reason, cache hits, error) with this
        step's new tokens."""
        stats = request.prefill_stats or PrefillStats()
        return cls(
            request_id=request.request_id,
            new_token_ids=new_token_ids if new_token_ids is not None else [],
            new_logprobs=new_logprobs,
            finish_reason=RequestStatus.finish_reason(request.status),
            stop_reason=request.stop_reason,
            kv_transfer_params=kv_transfer_params,
            num_local_cached_tokens=stats.num_local_cached_tokens,
            num_external_cached_tokens=stats.num_external_cached_tokens,
            external_cache_hit_sources=stats.external_cache_hit_sources,
            error=request.error,
            first_scheduled_time=request.prefill_stats.scheduled_time
            if request.prefill_stats
            else None,
            num_preemptions=request.num_preemptions,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
