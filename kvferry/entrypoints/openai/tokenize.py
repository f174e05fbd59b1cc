"""``/tokenize`` and ``/detokenize`` as vLLM serves them: a prompt (or chat messages through the
chat template) to token ids with their count and the context length, and ids back to text.
Both run in the tokenizer pool; neither reaches the engine."""

from __future__ import annotations

from typing import Any

from kvferry.entrypoints.openai.intake import PromptIntake
from kvferry.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from kvferry.sampling_params import InvalidParamError


async def serve_tokenize(body: TokenizeRequest, intake: PromptIntake) -> dict[str, Any]:
    body.check()
    messages: list[dict[str, str]] | None = None
    if body.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        intake.check_message_chars(messages)
    else:
        limit, n = intake.limits.max_prompt_chars, len(body.prompt or "")
        if limit is not None and n > limit:
            raise InvalidParamError(
                "prompt", f"the prompt has {n} characters, more than the limit of {limit}"
            )
    return await intake.offload(_tokenize, body, intake, messages)


def _tokenize(
    body: TokenizeRequest, intake: PromptIntake, messages: list[dict[str, str]] | None
) -> dict[str, Any]:
    tok = intake.tokenizer
    if messages is not None:
        text = tok.apply_chat_template(messages, body.add_generation_prompt)
        special = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        special = body.add_special_tokens is not False
    ids = tok.encode(text, add_special_tokens=special)
    return {
        "count": len(ids),
        "max_model_len": intake.max_model_len,
        "tokens": ids,
        "token_strs": tok.token_strs(ids) if body.return_token_strs else None,
    }


async def serve_detokenize(body: DetokenizeRequest, intake: PromptIntake) -> dict[str, Any]:
    vocab = intake.vocab_size
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab:
            raise InvalidParamError(
                "tokens", f"tokens[{i}] = {t} is out of the vocabulary (size {vocab})"
            )
    text = await intake.offload(intake.tokenizer.decode, body.tokens, False)
    return {"prompt": text}
