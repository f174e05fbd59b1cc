"""Stop conditions: whether the token just appended to a request ends it, and how."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.request import Request, RequestStatus


@dataclass(frozen=True)
class Stop:
    """The finished status to give the request; ``stop_reason`` is the stop token that ended
    it (None for EOS and length limits)."""

    status: RequestStatus
    stop_reason: int | None = None


def check_stop(request: Request, max_model_len: int) -> Stop | None:
    """Apply stop conditions to the request's last appended token; None if it goes on.

    Order and semantics follow vLLM: length limits win (``max_tokens``, or ``num_tokens``
    reaching ``max_model_len``), then ``min_tokens`` holds back EOS and stop tokens (the
    sampler is expected to mask them too), then EOS (unless ``ignore_eos``), then
    ``stop_token_ids`` (``stop_reason`` = the token id).
    """
    params = request.sampling_params
    if request.num_tokens >= max_model_len or (
        params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
    ):
        return Stop(RequestStatus.FINISHED_LENGTH_CAPPED)
    if request.num_output_tokens < params.min_tokens:
        return None
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last in request.eos_token_ids:
        return Stop(RequestStatus.FINISHED_STOPPED)
    if last in params.stop_token_ids:
        return Stop(RequestStatus.FINISHED_STOPPED, last)
    return None
