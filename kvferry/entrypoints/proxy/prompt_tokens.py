"""PromptTokens: a request's prompt token ids, computed as ``kvferry serve`` computes them.

Completions: a text prompt is encoded with the tokenizer's special tokens, token ids are taken
as they are; of a batch only the first prompt is used (one instance serves the whole body).
Chat: the messages go through the model's chat template, which already holds the special
tokens. Anything the server would refuse gives None (the server answers it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvferry.entrypoints.openai.protocol import ChatMessage
from kvferry.tokenizer import Tokenizer


class PromptTokens:
    def __init__(self, tokenizer_folder: str | Path) -> None:
        self.tokenizer = Tokenizer(tokenizer_folder)

    def token_ids(self, body: dict[str, Any], endpoint: str) -> list[int] | None:
        try:
            if endpoint.endswith("/chat/completions"):
                return self._chat(body)
            return self._completion(body.get("prompt"))
        except (ValidationError, ValueError, TypeError, KeyError):
            return None
        except Exception:  # template errors (jinja) and tokenizer errors: not ours to report
            return None

    def _completion(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None

    def _chat(self, body: dict[str, Any]) -> list[int] | None:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            return None
        messages = [ChatMessage.model_validate(m) for m in raw]
        chat = [{"role": m.role, "content": m.text()} for m in messages]
        text = self.tokenizer.apply_chat_template(
            chat, bool(body.get("add_generation_prompt", True))
        )
        return self.tokenizer.encode(text, add_special_tokens=False)
