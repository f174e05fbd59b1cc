"""ModelRunnerOutput: what one step of the model runner returns to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.step_types.kv_connector_output import KVConnectorOutput

# token id -> logprob; the sampled token is always present.
TokenLogprobs = dict[int, float]


@dataclass
class ModelRunnerOutput:
    # Requests of this step, in batch order.
    req_ids: list[str] = field(default_factory=list)
    # Per request: the tokens sampled this step ([] for a prefill chunk that is not the last).
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Per request, when it asked for logprobs: one entry per sampled token.
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    kv_connector_output: KVConnectorOutput | None = None
    # Requests the worker could not continue this step (e.g. sampling found no valid
    # distribution), with why; they sampled nothing and the scheduler ends them with an error.
    failed: dict[str, str] = field(default_factory=dict)
