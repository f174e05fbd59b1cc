"""OutputProcessor: turns the scheduler's per-step token deltas into user-facing outputs.

It detokenizes incrementally, detects stop strings (which the scheduler cannot see, since it
works on token ids) and tells the caller which requests must be stopped for that reason.

Each request is processed on its own: one whose output cannot be processed (the detokenizer
raises, e.g. on a token id the tokenizer does not know) ends with finish reason ``error`` and
a message, and the caller finishes it in the scheduler; the other requests are unaffected.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvferry.core.outputs import EngineCoreOutput
from kvferry.logger import init_logger
from kvferry.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvferry.sampling_params import SamplingParams
from kvferry.tokenizer import IncrementalDetokenizer, Tokenizer

logger = init_logger(__name__)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    # Requests whose output hit a stop string: the engine must finish them in the scheduler.
    stopped_by_string: list[str]
    # Requests whose output could not be processed -> why: the engine must finish them in the
    # scheduler with an error (their final output is in ``outputs`` already).
    failed: dict[str, str] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams
    ) -> None:
        self.states[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            params=params,
            detok=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            metrics=RequestMetrics(
                arrival_time=time.time(),
                num_prompt_tokens=len(prompt_ids),
                max_tokens_param=params.max_tokens,
            ),
        )

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.time()
        result = ProcessedOutputs([], [])
        for out in core_outputs:
            state = self.states.get(out.request_id)
            if state is None:  # aborted by the caller meanwhile
                continue
            try:
                stopped_by_string = self._apply(state, out, now)
            except Exception as e:
                logger.exception("processing the output of request %s failed", out.request_id)
                error = f"processing the output failed: {type(e).__name__}: {e}"
                result.failed[out.request_id] = error
                state.finish_reason, state.stop_reason = "error", None
                state.metrics.finished_time = now
                self.states.pop(out.request_id, None)
                result.outputs.append(self._make_output(state, out, error))
                continue
            if stopped_by_string:
                result.stopped_by_string.append(out.request_id)
            result.outputs.append(self._make_output(state, out, out.error))
        return result

    def _apply(self, state: RequestState, out: EngineCoreOutput, now: float) -> bool:
        """Add one step's output to ``state``; True if a stop string ended it."""
        if out.new_token_ids and state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        state.metrics.num_local_cached_tokens = out.num_local_cached_tokens
        state.metrics.num_external_cached_tokens = out.num_external_cached_tokens
        state.metrics.external_cache_hit_sources = out.external_cache_hit_sources
        state.metrics.first_scheduled_time = out.first_scheduled_time
        state.metrics.num_preemptions = out.num_preemptions
        state.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            state.logprobs.extend(out.new_logprobs)
        if out.new_token_ids:
            state.text += state.detok.add(out.new_token_ids)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        stopped_by_string = finish_reason is None and self._check_stop_strings(state)
        if stopped_by_string:
            finish_reason, stop_reason = "stop", state.stop_reason
        if finish_reason is not None:
            state.finish_reason = finish_reason
            state.stop_reason = stop_reason
            state.metrics.finished_time = now
            del self.states[out.request_id]
        return stopped_by_string

    def _check_stop_strings(self, state: RequestState) -> bool:
        stops = state.params.stop
        if not stops or len(state.token_ids) < state.params.min_tokens:
            return False
        # Only the tail can contain a stop string that just appeared.
        window = max(len(s) for s in stops) + 16
        base = max(0, len(state.text) - window)
        tail = state.text[base:]
        hits = [(tail.find(s), s) for s in stops if s in tail]
        if not hits:
            return False
        idx, stop = min(hits)
        cut = base + idx + (len(stop) if state.params.include_stop_str_in_output else 0)
        state.text = state.text[:cut]
        state.stop_reason = stop
        return True

    @staticmethod
    def _make_output(
        state: RequestState, out: EngineCoreOutput, error: str | None
    ) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=list(state.token_ids),
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            logprobs=list(state.logprobs) if state.params.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=state.finish_reason is not None,
            metrics=state.metrics,
            kv_transfer_params=out.kv_transfer_params,
            error=error,
            num_cached_tokens=state.metrics.num_cached_tokens,
        )
