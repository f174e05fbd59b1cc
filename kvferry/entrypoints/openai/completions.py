"""``/v1/completions``: prompts -> engine requests -> one JSON body, or an SSE stream.

``kv_transfer_params`` returned by the KV connector go into the body's top level (for a single
prompt), or into the final chunk of a stream.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from kvferry.engine.async_llm import AsyncLLM
from kvferry.entrypoints.openai.engine_requests import collect_finals, start_requests, usage
from kvferry.entrypoints.openai.http_utils import EventStream
from kvferry.entrypoints.openai.intake import PromptIntake
from kvferry.entrypoints.openai.protocol import CompletionRequest
from kvferry.entrypoints.openai.streaming import stream_response
from kvferry.outputs import RequestOutput


async def serve_completion(
    body: CompletionRequest, llm: AsyncLLM, intake: PromptIntake, model_name: str
) -> dict | EventStream:
    """Answer a completion request whose model was checked already."""
    texts = body.prompts(intake.limits.max_prompts_per_request)
    params = intake.sampling_params(body)
    intake.check_prompt_chars(texts)
    prompts = await intake.tokenize_prompts(texts, params)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    merged, primed = await start_requests(
        llm, prompts, params, rid, body.cache_salt, final_only=not body.stream
    )
    if body.stream:
        return stream_response(
            body,
            merged,
            primed,
            len(prompts),
            request_id=rid,
            created=created,
            model_name=model_name,
            chat=False,
        )
    outs = await collect_finals(merged, primed, len(prompts))
    return _completion_body(body, outs, rid, created, model_name)


def _completion_body(
    body: CompletionRequest, outs: list[RequestOutput], rid: str, created: int, model_name: str
) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outs):
        c = out.outputs[0]
        choice: dict[str, Any] = {
            "index": i,
            "text": c.text,
            "logprobs": None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if body.return_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": choices,
        "usage": usage(outs),
        "kv_transfer_params": outs[0].kv_transfer_params if len(outs) == 1 else None,
    }
