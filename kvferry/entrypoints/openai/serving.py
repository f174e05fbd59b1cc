"""OpenAIServing: the serving logic of ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/tokenize`` and ``/detokenize`` over an AsyncLLM.

A handler validates the body (ConfigError -> 400) and checks the model name, then hands over
to ``completions.py`` or ``chat.py``: prompt checks and tokenization (``intake.py``), one engine
request per prompt (``engine_requests.py``), then one JSON body or an SSE stream
(``streaming.py``). A decode request refused before it reached the engine gives its
prefill's KV back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kvferry.config import ConfigError
from kvferry.engine.async_llm import AsyncLLM
from kvferry.entrypoints.openai.chat import serve_chat_completion
from kvferry.entrypoints.openai.completions import serve_completion
from kvferry.entrypoints.openai.engine_requests import RequestFailedError
from kvferry.entrypoints.openai.http_utils import EventStream
from kvferry.entrypoints.openai.intake import PromptIntake
from kvferry.entrypoints.openai.limits import ServerLimits
from kvferry.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _SamplingRequest,
)
from kvferry.entrypoints.openai.tokenize import serve_detokenize, serve_tokenize
from kvferry.logger import init_logger

__all__ = ["ModelNotFoundError", "OpenAIServing", "RequestFailedError"]

logger = init_logger(__name__)

T = TypeVar("T")


class ModelNotFoundError(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.")


class OpenAIServing:
    def __init__(
        self, llm: AsyncLLM, served_model_name: str, limits: ServerLimits | None = None
    ) -> None:
        self.llm = llm
        self.model_name = served_model_name
        self.limits = limits or ServerLimits()
        self._background: set[asyncio.Future[None]] = set()
        # Encoding and decoding only read the tokenizer, so the pool shares the engine's.
        self.intake = PromptIntake(llm.config.model_config, llm.engine.tokenizer, self.limits)

    def shutdown(self) -> None:
        self.intake.shutdown()

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the tokenizer pool (CPU work kept off the event loop)."""
        return await self.intake.offload(fn, *args)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFoundError(name)

    def models(self) -> dict[str, Any]:
        """vLLM's model card: ``root`` is the model folder, ``parent`` a base model (none
        without LoRA), ``permission`` one permissive entry."""
        created = int(time.time())
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {
            "id": self.model_name,
            "object": "model",
            "created": created,
            "owned_by": "kvferry",
            "root": self.llm.config.model_config.model,
            "parent": None,
            "max_model_len": self.llm.config.model_config.max_len,
            "permission": [permission],
        }
        return {"object": "list", "data": [card]}

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        return await serve_tokenize(body, self.intake)

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        return await serve_detokenize(body, self.intake)

    async def create_completion(self, body: CompletionRequest) -> dict | EventStream:
        with self._release_if_rejected(body):
            self.check_model(body.model)
            return await serve_completion(body, self.llm, self.intake, self.model_name)

    async def create_chat_completion(self, body: ChatCompletionRequest) -> dict | EventStream:
        with self._release_if_rejected(body):
            self.check_model(body.model)
            return await serve_chat_completion(body, self.llm, self.intake, self.model_name)

    @contextlib.contextmanager
    def _release_if_rejected(self, body: _SamplingRequest) -> Iterator[None]:
        """A decode request refused before it reached the engine never reads the prefill's
        KV: give it back now rather than at lease expiry (vLLM does the same)."""
        try:
            yield
        except (ConfigError, ModelNotFoundError):
            params = body.kv_transfer_params
            if params and params.get("do_remote_prefill") and self.llm.has_kv_connector:
                task = asyncio.ensure_future(self._release_quietly(params))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            raise

    async def _release_quietly(self, params: dict[str, Any]) -> None:
        try:
            await self.llm.release_kv_transfer(params)
        except Exception as e:
            logger.warning("releasing the KV of a rejected request failed: %s", e)
