"""What users get back from LLM.generate and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    # Of the external ones, tokens by the tier that held them (``CacheHitSource`` values:
    # "host", "disk", "p2p", ..., "external_unspecified"), from the connector's
    # ``get_external_cache_hit_sources``.
    external_cache_hit_sources: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    kv_connector: dict[str, Any] = field(default_factory=dict)
    # The request's max_tokens as given (None: up to the context), for metrics.
    max_tokens_param: int | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.num_local_cached_tokens + self.num_external_cached_tokens

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    # Prompt tokens whose KV was not computed (local prefix cache plus KV connector), as vLLM's
    # ``RequestOutput.num_cached_tokens`` (set on every output the engine returns).
    num_cached_tokens: int | None = None
