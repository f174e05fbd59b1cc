"""Request and RequestStatus: the scheduler's view of one generation request."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvferry.sampling_params import SamplingParams

BlockHash = bytes


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class PrefillStats:
    """Where a request's prompt KV came from on its first scheduling."""

    num_prompt_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    # Of the external ones, tokens by the tier that held them (CacheHitSource values).
    external_cache_hit_sources: dict[str, int] = field(default_factory=dict)
    # When the first scheduling admitted it (wall clock; vLLM's ``scheduled_ts``).
    scheduled_time: float = field(default_factory=time.time)
    # A failed KV load left the request nothing valid: it starts over, and the sources its
    # fresh lookup finds replace these (all but scheduled_time).
    redo_lookup: bool = False

    @property
    def num_cached_tokens(self) -> int:
        return self.num_local_cached_tokens + self.num_external_cached_tokens

    def keep_valid_prefix(self, num_valid_tokens: int) -> None:
        """Only the first ``num_valid_tokens`` tokens' KV survived a failed load; the rest is
        computed again, so it counts as computed, not cached. The local hit is the start of
        the prompt and the external hit follows it, so the external count drops first. The
        tiers keep the external count in the order the connector reported them (it reports
        no positions), so they still sum to it."""
        num_valid = max(num_valid_tokens, 0)
        local = min(self.num_local_cached_tokens, num_valid)
        external = min(self.num_external_cached_tokens, num_valid - local)
        self.num_local_cached_tokens = local
        self.num_external_cached_tokens = external
        # A new dict: outputs already handed out share the old one.
        kept: dict[str, int] = {}
        left = external
        for tier, n in self.external_cache_hit_sources.items():
            if left > 0:
                kept[tier] = min(n, left)
                left -= kept[tier]
        self.external_cache_hit_sources = kept


class Request:
    """One request as the scheduler tracks it.

    ``num_computed_tokens`` counts tokens whose KV is in the engine's pool (or, while the
    status is ``WAITING_FOR_REMOTE_KVS``, promised by a connector). The scheduler advances it
    until it catches up with ``num_tokens``. ``block_hashes`` holds one chained hash per full
    block of ``all_token_ids`` and grows as output tokens are appended.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.kv_transfer_params: dict[str, Any] | None = sampling_params.extra_args.get(
            "kv_transfer_params"
        )
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_logprobs: list[dict[int, float]] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.prefill_stats: PrefillStats | None = None
        self.first_token_time: float | None = None
        self.error: str | None = None
        self._block_hasher = block_hasher
        self.block_hashes: list[BlockHash] = []
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self.update_block_hashes()

    # vLLM's names, for connectors written for vLLM (kvferry has no speculative tokens, LoRA,
    # pooling or multimodal inputs).
    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    mm_features: tuple[Any, ...] = ()
    lora_request = None
    pooling_params = None
    spec_token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
