"""What every prompt must satisfy before it becomes a request, checked in one place for the
engine (``LLMEngine.add_request``) and the server (which checks in its tokenizer threads, so
that a bad prompt is a 400 naming its parameter before it reaches the engine thread)."""

from __future__ import annotations

from kvferry.sampling_params import InvalidParamError, SamplingParams


def check_prompt_ids(
    ids: list[int], max_model_len: int, vocab_size: int, param: str = "prompt"
) -> None:
    """Not empty, shorter than the context (to leave room for output), ids in the vocabulary."""
    n = len(ids)
    if not n:
        raise InvalidParamError(param, "the prompt is empty")
    if n >= max_model_len:
        raise InvalidParamError(
            param,
            f"the prompt has {n} tokens; it must be shorter than max_model_len="
            f"{max_model_len} to leave room for output",
        )
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        raise InvalidParamError(
            param, f"prompt token ids must be in [0, {vocab_size}); got {lo}..{hi}"
        )


def check_stop_token_ids(params: SamplingParams, vocab_size: int) -> None:
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidParamError(
            "stop_token_ids", f"stop_token_ids must be in [0, {vocab_size}); got {bad[0]}"
        )
