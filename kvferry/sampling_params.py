"""SamplingParams: how one request's output tokens are chosen and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvferry.config import ConfigError

# Temperatures below this sample greedily (vLLM's threshold): dividing logits by a tinier
# positive number overflows to inf/NaN instead of sharpening the distribution further.
SAMPLING_EPS = 1e-5
# top_p below this is raised to it. Any top_p under the most likely token's probability
# (at least 1/vocab) keeps exactly that token, so this changes no result for vocabularies
# under 10**8 tokens, while a value that rounds to 0 in float32 would keep none.
MIN_TOP_P = 1e-8
# torch generators take any integer of 64 bits, signed or not.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class InvalidParamError(ConfigError):
    """A bad value of one named request parameter; the server answers 400 naming ``param``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings (mirrors vLLM's names).

    ``temperature`` below ``SAMPLING_EPS`` (0 included) means greedy. ``top_k=None`` and
    ``top_p=1.0`` disable those filters; a ``top_p`` below ``MIN_TOP_P`` is raised to it (the
    same tokens: only the most likely one). ``max_tokens=None`` lets the request run until
    ``max_model_len``. ``seed`` is any 64-bit integer, signed or unsigned. ``extra_args`` may
    carry ``kv_transfer_params`` for KV connectors. Every value is checked here; a bad one
    raises :class:`InvalidParamError` (a ConfigError) naming the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_sampling()
        self._check_lengths()
        self._check_stops()

    def _check_sampling(self) -> None:
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t):
            raise InvalidParamError("temperature", f"temperature must be a finite number, got {t}")
        if t < 0:
            raise InvalidParamError("temperature", f"temperature must be >= 0, got {t}")
        p = self.top_p
        if not _is_number(p) or not math.isfinite(p) or not 0.0 < p <= 1.0:
            raise InvalidParamError("top_p", f"top_p must be in (0, 1], got {p}")
        self.top_p = max(float(p), MIN_TOP_P)
        k = self.top_k
        if k is not None and (not _is_int(k) or k < 1):
            raise InvalidParamError("top_k", f"top_k must be >= 1 (or None to disable), got {k}")
        s = self.seed
        if s is not None and (not _is_int(s) or not SEED_MIN <= s <= SEED_MAX):
            raise InvalidParamError(
                "seed", f"seed must be an integer in [-2**63, 2**64 - 1], got {s}"
            )
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20
        ):
            raise InvalidParamError(
                "logprobs", f"logprobs must be between 0 and 20, got {self.logprobs}"
            )

    def _check_lengths(self) -> None:
        m = self.max_tokens
        if m is not None and (not _is_int(m) or m < 1):
            raise InvalidParamError("max_tokens", f"max_tokens must be >= 1, got {m}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidParamError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if m is not None and self.min_tokens > m:
            raise InvalidParamError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({m})"
            )

    def _check_stops(self) -> None:
        if not isinstance(self.stop, list) or any(
            not isinstance(s, str) or not s for s in self.stop
        ):
            raise InvalidParamError("stop", "stop strings must be non-empty strings")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or any(not _is_int(t) or t < 0 for t in ids):
            raise InvalidParamError(
                "stop_token_ids", "stop_token_ids must be non-negative integers"
            )
        self.stop_token_ids = list(dict.fromkeys(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
