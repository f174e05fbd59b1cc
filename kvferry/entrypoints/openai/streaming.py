"""The SSE writer of streamed completions and chat completions.

:func:`stream_response` turns the merged outputs of an API request's engine requests into an
:class:`EventStream` of ``data: {...}\\n\\n`` chunks ending with ``data: [DONE]``: one chunk per
output with new tokens (by default one per token, see ``--stream-interval``), carrying the text
(and, on request, the token ids) new since the previous chunk of its choice, holding back text
that may still turn out to start a stop string. A chunk goes out even when its text is empty
(a token that completes no character, or text held back), as vLLM's do: clients time tokens by
chunks. ``kv_transfer_params`` returned by the KV connector go into a choice's final chunk. An
engine error after the first chunk becomes an error event; closing the stream early (client
gone) aborts the requests.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from kvferry.config import ConfigError
from kvferry.engine.async_llm import EngineDeadError, EngineStepError
from kvferry.entrypoints.openai.engine_requests import (
    IndexedOutput,
    MergedOutputs,
    RequestFailedError,
    check_failed,
    usage,
)
from kvferry.entrypoints.openai.http_utils import EventStream, error_body, sse
from kvferry.entrypoints.openai.protocol import _SamplingRequest
from kvferry.outputs import RequestOutput

_STREAM_ERRORS = (ConfigError, EngineStepError, EngineDeadError, RequestFailedError)


class StreamedChoice:
    """Streaming state of one prompt: what has been sent so far."""

    def __init__(self, hold_back: int) -> None:
        self.hold_back = hold_back
        self.text_sent = 0
        self.ids_sent = 0
        self.started = False

    def delta(self, out: RequestOutput) -> tuple[str, list[int]]:
        c = out.outputs[0]
        # Hold back text that may still turn out to be the start of a stop string.
        end = len(c.text) if out.finished else max(self.text_sent, len(c.text) - self.hold_back)
        text = c.text[self.text_sent : end]
        ids = c.token_ids[self.ids_sent :]
        self.text_sent, self.ids_sent = max(end, self.text_sent), len(c.token_ids)
        return text, ids


def stream_response(
    body: _SamplingRequest,
    merged: MergedOutputs,
    primed: list[IndexedOutput],
    n: int,
    *,
    request_id: str,
    created: int,
    model_name: str,
    chat: bool,
) -> EventStream:
    """The event stream of ``n`` prompts' outputs; ``primed`` are those already taken."""
    events = _events(body, merged, primed, n, request_id, created, model_name, chat)
    return EventStream(events, merged.close)


async def _events(
    body: _SamplingRequest,
    merged: MergedOutputs,
    primed: list[IndexedOutput],
    n: int,
    rid: str,
    created: int,
    model_name: str,
    chat: bool,
) -> AsyncGenerator[str, None]:
    params_stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    hold = 0 if body.include_stop_str_in_output or not params_stop else max(map(len, params_stop))
    states = [StreamedChoice(max(0, hold - 1)) for _ in range(n)]
    finals: list[RequestOutput] = []
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        head = {"id": rid, "object": obj, "created": created, "model": model_name}
        return sse({**head, "choices": choices, **extra})

    try:
        pending = list(primed)
        while True:
            item = pending.pop(0) if pending else await merged.next()
            if item is None:
                break
            i, out = item
            check_failed(out)
            st = states[i]
            text, ids = st.delta(out)
            if chat and not st.started:
                role: dict[str, Any] = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                }
                role.update(logprobs=None, finish_reason=None)
                if body.return_token_ids:
                    role["token_ids"] = []
                yield chunk([role])
            st.started = True
            if not text and not ids and not out.finished:
                continue
            c = out.outputs[0]
            choice: dict[str, Any] = {"index": i, "logprobs": None}
            if chat:
                choice["delta"] = {"content": text} if text or not out.finished else {}
            else:
                choice["text"] = text
            choice["finish_reason"] = c.finish_reason if out.finished else None
            if out.finished:
                choice["stop_reason"] = c.stop_reason
            if body.return_token_ids:
                choice["token_ids"] = ids
            extra: dict[str, Any] = {}
            if out.finished:
                finals.append(out)
                extra["kv_transfer_params"] = out.kv_transfer_params
            yield chunk([choice], **extra)
        if body.include_usage:
            yield chunk([], usage=usage(finals))
    except _STREAM_ERRORS as e:
        bad_input = isinstance(e, ConfigError)
        err_type = "invalid_request_error" if bad_input else "internal_server_error"
        yield sse(error_body(str(e), err_type, None, 400 if bad_input else 500))
    finally:
        await merged.close()
    yield sse("[DONE]")
