"""``/v1/chat/completions``: messages -> chat template -> one engine request -> one JSON body,
or an SSE stream.

``kv_transfer_params`` returned by the KV connector go into the body's top level, or into the
final chunk of a stream.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from kvferry.engine.async_llm import AsyncLLM
from kvferry.entrypoints.openai.engine_requests import collect_finals, start_requests, usage
from kvferry.entrypoints.openai.http_utils import EventStream
from kvferry.entrypoints.openai.intake import PromptIntake
from kvferry.entrypoints.openai.protocol import ChatCompletionRequest
from kvferry.entrypoints.openai.streaming import stream_response
from kvferry.outputs import RequestOutput


async def serve_chat_completion(
    body: ChatCompletionRequest, llm: AsyncLLM, intake: PromptIntake, model_name: str
) -> dict | EventStream:
    """Answer a chat completion request whose model was checked already."""
    messages = body.chat_messages()
    params = intake.sampling_params(body)
    intake.check_message_chars(messages)
    prompt = await intake.tokenize_chat(messages, body.add_generation_prompt, params)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    merged, primed = await start_requests(
        llm, [prompt], params, rid, body.cache_salt, final_only=not body.stream
    )
    if body.stream:
        return stream_response(
            body,
            merged,
            primed,
            1,
            request_id=rid,
            created=created,
            model_name=model_name,
            chat=True,
        )
    (out,) = await collect_finals(merged, primed, 1)
    return _chat_body(body, out, rid, created, model_name)


def _chat_body(
    body: ChatCompletionRequest, out: RequestOutput, rid: str, created: int, model_name: str
) -> dict[str, Any]:
    c = out.outputs[0]
    response: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **({"token_ids": c.token_ids} if body.return_token_ids else {}),
            }
        ],
        "usage": usage([out]),
        "kv_transfer_params": out.kv_transfer_params,
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = out.prompt_token_ids
    return response
