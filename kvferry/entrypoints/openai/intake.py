"""PromptIntake: what a prompt goes through before it reaches the engine.

Each prompt's length in characters is checked against :class:`ServerLimits` and against what
the context can hold (so a huge string is refused before it is tokenized); the chat template
is rendered and prompts are tokenized in a small thread pool (never on the event loop, never
on the engine thread: the engine gets ``prompt_token_ids``); then the token counts are checked
against the context (``max_tokens`` beyond what is left is a 400, as in vLLM).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvferry.config import ModelConfig
from kvferry.engine.prompt_checks import check_prompt_ids, check_stop_token_ids
from kvferry.entrypoints.openai.limits import ServerLimits
from kvferry.entrypoints.openai.prompt_bound import max_chars_per_token_in
from kvferry.entrypoints.openai.protocol import _SamplingRequest
from kvferry.sampling_params import InvalidParamError, SamplingParams
from kvferry.tokenizer import Tokenizer

T = TypeVar("T")
# One engine prompt as the server hands it over: text (or None) and its token ids.
TokenPrompt = dict[str, Any]


class PromptIntake:
    """The server's checks and tokenization of prompts, for one model; ``shutdown()`` stops
    the tokenizer pool."""

    def __init__(
        self, model_config: ModelConfig, tokenizer: Tokenizer, limits: ServerLimits
    ) -> None:
        self.limits = limits
        self.max_model_len = model_config.max_len
        self.vocab_size = model_config.arch.vocab_size
        self.tokenizer = tokenizer
        tok_path = model_config.tokenizer
        per_token = max_chars_per_token_in(tok_path) if tok_path else None
        # Text longer than this cannot fit the context, whatever the configured limit.
        self.fit_chars = per_token * self.max_model_len if per_token else None
        self._pool = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="kvferry-tokenize"
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the tokenizer pool (CPU work kept off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def sampling_params(self, body: _SamplingRequest) -> SamplingParams:
        params = body.to_sampling_params(self.limits)
        check_stop_token_ids(params, self.vocab_size)
        return params

    # -- before tokenization ------------------------------------------------------------------

    def check_prompt_chars(self, prompts: list[str | list[int]]) -> None:
        limit = self._prompt_char_limit()
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                what = "the prompt" if len(prompts) == 1 else f"prompt {i}"
                self._check_chars(p, "prompt", what, limit)

    def check_message_chars(self, messages: list[dict[str, str]]) -> None:
        chars = sum(len(m["content"]) for m in messages)
        if self.limits.max_prompt_chars is not None and chars > self.limits.max_prompt_chars:
            raise InvalidParamError(
                "messages",
                f"the messages have {chars} characters, more than the limit of "
                f"{self.limits.max_prompt_chars}",
            )

    def _check_chars(self, text: str, param: str, what: str, limit: int | None) -> None:
        if limit is not None and len(text) > limit:
            raise InvalidParamError(
                param,
                f"{what} has {len(text)} characters, more than the limit of {limit} "
                f"(this model's maximum context length is {self.max_model_len} tokens)",
            )

    def _prompt_char_limit(self) -> int | None:
        limits = [c for c in (self.limits.max_prompt_chars, self.fit_chars) if c is not None]
        return min(limits) if limits else None

    # -- tokenization (in the pool) -----------------------------------------------------------

    async def tokenize_prompts(
        self, prompts: list[str | list[int]], params: SamplingParams
    ) -> list[TokenPrompt]:
        return await self.offload(self._encode_prompts, prompts, params)

    async def tokenize_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, params: SamplingParams
    ) -> TokenPrompt:
        return await self.offload(self._encode_chat, messages, add_generation_prompt, params)

    def _encode_prompts(
        self, prompts: list[str | list[int]], params: SamplingParams
    ) -> list[TokenPrompt]:
        out: list[TokenPrompt] = []
        for p in prompts:
            text, ids = (p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, p)
            self._check_tokens(ids, params, "prompt")
            out.append({"prompt": text, "prompt_token_ids": ids})
        return out

    def _encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, params: SamplingParams
    ) -> TokenPrompt:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt)
        self._check_chars(text, "messages", "the chat prompt", self.fit_chars)
        # The template already holds the special tokens it wants (as vLLM does).
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self._check_tokens(ids, params, "messages")
        return {"prompt": text, "prompt_token_ids": ids}

    def _check_tokens(self, ids: list[int], params: SamplingParams, param: str) -> None:
        """The engine's prompt checks, plus vLLM's server rule: ``max_tokens`` must fit in
        what the prompt leaves of the context."""
        check_prompt_ids(ids, self.max_model_len, self.vocab_size, param)
        n, max_len, m = len(ids), self.max_model_len, params.max_tokens
        if m is not None and n + m > max_len:
            raise InvalidParamError(
                "max_tokens",
                f"This model's maximum context length is {max_len} tokens. The prompt has {n} "
                f"tokens and max_tokens asks for {m} more, {n + m} in all; ask for at most "
                f"{max_len - n} or shorten the prompt.",
            )
