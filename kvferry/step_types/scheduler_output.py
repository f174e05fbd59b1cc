"""SchedulerOutput: the plan for one engine step, sent from the scheduler to the workers.

Plain data only; no Request objects cross this boundary, so workers could live in another
process. The ``from_request(s)`` builders copy what the workers need out of the scheduler's
requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvferry.sampling_params import SamplingParams
from kvferry.step_types.kv_connector_metadata import KVConnectorMetadata

if TYPE_CHECKING:
    from kvferry.request import Request


@dataclass
class NewRequestData:
    """A request the workers have not seen yet, or one resumed after preemption.

    ``token_ids`` holds every known token (prompt plus outputs so far), ``block_ids`` the
    request's whole block table per KV cache group, and ``num_computed_tokens`` how many
    leading tokens already have KV in those blocks.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int

    @classmethod
    def from_request(cls, request: Request, block_ids: tuple[list[int], ...]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
        )

    # vLLM's names for what kvferry carries differently, and for inputs kvferry has none of
    # (read by connectors written for vLLM).
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def prompt_len(self) -> int:
        return self.num_prompt_tokens

    @property
    def mm_features(self) -> list[Any]:
        return []

    lora_request = None
    pooling_params = None
    prompt_embeds = None


@dataclass
class CachedRequestData:
    """Requests the workers already hold: the blocks appended to them this step.

    The worker appends its own sampled tokens to its copy of the request, so no token ids
    travel here. ``num_computed_tokens`` may go *down* between steps: after a failed KV load
    (policy ``recompute``) the scheduler rewinds a request to its last valid token, and
    ``num_output_tokens`` is then smaller than the worker's count because the token sampled
    on top of the bad KV was discarded; the worker must drop its extra output tokens.
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Output tokens the scheduler holds for each request (same order as req_ids).
    num_output_tokens: list[int] = field(default_factory=list)

    @classmethod
    def from_requests(
        cls, requests: Sequence[Request], new_block_ids: list[tuple[list[int], ...] | None]
    ) -> CachedRequestData:
        return cls(
            req_ids=[r.request_id for r in requests],
            new_block_ids=new_block_ids,
            num_computed_tokens=[r.num_computed_tokens for r in requests],
            num_output_tokens=[r.num_output_tokens for r in requests],
        )

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # vLLM's names: kvferry sends a request resumed after preemption as new data (with its
    # whole block table), never as cached data, and sends no token ids here.
    @property
    def resumed_req_ids(self) -> set[str]:
        return set()

    @property
    def resumed_from_preemption(self) -> list[bool]:
        return [False] * len(self.req_ids)

    @property
    def new_token_ids(self) -> list[list[int]]:
        return [[] for _ in self.req_ids]

    @property
    def all_token_ids(self) -> dict[str, list[int]]:
        return {}


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens the forward pass computes for it this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished since the last step; workers drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted this step; their blocks may be reused by this very step.
    preempted_req_ids: set[str] = field(default_factory=set)
    # True when a request in this step has a synchronous external KV load.
    has_sync_kv_loads: bool = False
    # The step's plan built by the scheduler-side KV connector (None without a connector).
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    # vLLM's fields for features kvferry does not have (speculative decoding, encoders).
    @property
    def scheduled_spec_decode_tokens(self) -> dict[str, list[int]]:
        return {}

    @property
    def scheduled_encoder_inputs(self) -> dict[str, list[int]]:
        return {}

    @property
    def free_encoder_mm_hashes(self) -> list[str]:
        return []

    @property
    def num_common_prefix_blocks(self) -> list[int]:
        return []
