"""Serving logic of ``/v1/completions`` and ``/v1/chat/completions`` over an AsyncLLM.

A handler validates the body (ConfigError -> 400), checks each prompt's length in characters
against :class:`ServerLimits` (so a huge string is refused before it is tokenized), renders the
chat template and tokenizes in a small thread pool (never on the event loop, never on the
engine thread: the engine gets ``prompt_token_ids``), checks the token counts against the
context (``max_tokens`` beyond what is left is a 400, as in vLLM), starts one engine request
per prompt and
waits until every prompt has produced its first output (so a prompt the engine rejects is a 400,
not a broken stream). Non-streaming, it then collects the final outputs into one JSON body;
streaming, it returns an async iterator of SSE events (``data: {...}\\n\\n`` ... ``data: [DONE]``).
``kv_transfer_params`` returned by the KV connector go into the response body's top level, or
into the final chunk of a stream. Closing the iterator early (client gone) aborts the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvferry.config import ConfigError
from kvferry.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from kvferry.engine.prompt_checks import check_prompt_ids, check_stop_token_ids
from kvferry.entrypoints.openai.http_utils import EventStream, error_body, sse
from kvferry.entrypoints.openai.limits import ServerLimits
from kvferry.entrypoints.openai.prompt_bound import max_chars_per_token_in
from kvferry.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingRequest,
)
from kvferry.logger import init_logger
from kvferry.outputs import RequestOutput
from kvferry.sampling_params import InvalidParamError, SamplingParams
from kvferry.tokenizer import Tokenizer

logger = init_logger(__name__)

_ENGINE_ERRORS = (ConfigError, EngineStepError, EngineDeadError)
T = TypeVar("T")
# One engine prompt as the server hands it over: text (or None) and its token ids.
TokenPrompt = dict[str, Any]


class ModelNotFoundError(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.")


class RequestFailedError(RuntimeError):
    """The engine finished the request with an error (e.g. a failed KV load)."""


class _Merged:
    """Several requests' output streams as one, tagged with the prompt index."""

    def __init__(self, gens: list[AsyncIterator[RequestOutput]]) -> None:
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = (
            asyncio.Queue()
        )
        self._open = len(gens)
        self._tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(gens)]

    async def _pump(self, index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                self._queue.put_nowait((index, out))
        except Exception as e:
            self._queue.put_nowait((index, e))
        self._queue.put_nowait((index, None))

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next output of any request; None when all are done; raises their errors."""
        while self._open:
            index, item = await self._queue.get()
            if item is None:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return index, item
        return None

    async def prime(self, n: int) -> list[tuple[int, RequestOutput]]:
        """Outputs until each of the ``n`` requests has produced one."""
        seen: set[int] = set()
        items: list[tuple[int, RequestOutput]] = []
        while len(seen) < n:
            item = await self.next()
            if item is None:
                break
            items.append(item)
            seen.add(item[0])
        return items

    async def close(self) -> None:
        """Cancel what still runs (which aborts those engine requests)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class _Choice:
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


def _check_failed(out: RequestOutput) -> None:
    if out.finished and out.outputs and out.outputs[0].finish_reason == "error":
        raise RequestFailedError(out.error or "the engine failed this request")


def _usage(outs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(
        o.metrics.num_local_cached_tokens + o.metrics.num_external_cached_tokens
        for o in outs
        if o.metrics is not None
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class OpenAIServing:
    def __init__(
        self, llm: AsyncLLM, served_model_name: str, limits: ServerLimits | None = None
    ) -> None:
        self.llm = llm
        self.model_name = served_model_name
        self.limits = limits or ServerLimits()
        self._background: set[asyncio.Future[None]] = set()
        mc = llm.config.model_config
        self.max_model_len = mc.max_len
        self.vocab_size = mc.arch.vocab_size
        # Encoding and decoding only read the tokenizer, so the pool shares the engine's.
        self.tokenizer: Tokenizer = llm.engine.tokenizer
        per_token = max_chars_per_token_in(mc.tokenizer) if mc.tokenizer else None
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

    # -- intake -------------------------------------------------------------------------------

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

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFoundError(name)

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "kvferry",
            "max_model_len": self.llm.config.model_config.max_len,
        }
        return {"object": "list", "data": [card]}

    async def _start(
        self,
        body: _SamplingRequest,
        params: SamplingParams,
        prompts: list[TokenPrompt],
        request_id: str,
    ) -> tuple[_Merged, list[tuple[int, RequestOutput]]]:
        gens = [
            self.llm.generate(p, params, f"{request_id}-{i}", body.cache_salt)
            for i, p in enumerate(prompts)
        ]
        merged = _Merged(gens)
        try:
            return merged, await merged.prime(len(gens))
        except BaseException:
            await merged.close()
            raise

    async def _collect(
        self, merged: _Merged, primed: list[tuple[int, RequestOutput]], n: int
    ) -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        try:
            for i, out in primed:
                if out.finished:
                    finals[i] = out
            while (item := await merged.next()) is not None:
                if item[1].finished:
                    finals[item[0]] = item[1]
        finally:
            await merged.close()
        outs = [finals[i] for i in range(n)]
        for out in outs:
            _check_failed(out)
        return outs

    # -- /v1/completions ----------------------------------------------------------------------

    async def create_completion(self, body: CompletionRequest) -> dict | EventStream:
        with self._release_if_rejected(body):
            return await self._completion(body)

    async def create_chat_completion(self, body: ChatCompletionRequest) -> dict | EventStream:
        with self._release_if_rejected(body):
            return await self._chat_completion(body)

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

    async def _completion(self, body: CompletionRequest) -> dict | EventStream:
        self.check_model(body.model)
        texts = body.prompts(self.limits.max_prompts_per_request)
        params = body.to_sampling_params(self.limits)
        check_stop_token_ids(params, self.vocab_size)
        limit = self._prompt_char_limit()
        for i, p in enumerate(texts):
            if isinstance(p, str):
                what = "the prompt" if len(texts) == 1 else f"prompt {i}"
                self._check_chars(p, "prompt", what, limit)
        prompts = await self.offload(self._encode_prompts, texts, params)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        merged, primed = await self._start(body, params, prompts, rid)
        if body.stream:
            return self._stream(body, merged, primed, len(prompts), rid, created, chat=False)
        outs = await self._collect(merged, primed, len(prompts))
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
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(outs),
            "kv_transfer_params": outs[0].kv_transfer_params if len(outs) == 1 else None,
        }

    # -- /v1/chat/completions -----------------------------------------------------------------

    async def _chat_completion(self, body: ChatCompletionRequest) -> dict | EventStream:
        self.check_model(body.model)
        messages = body.chat_messages()
        params = body.to_sampling_params(self.limits)
        check_stop_token_ids(params, self.vocab_size)
        chars = sum(len(m["content"]) for m in messages)
        if self.limits.max_prompt_chars is not None and chars > self.limits.max_prompt_chars:
            raise InvalidParamError(
                "messages",
                f"the messages have {chars} characters, more than the limit of "
                f"{self.limits.max_prompt_chars}",
            )
        prompt = await self.offload(self._encode_chat, messages, body.add_generation_prompt, params)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        merged, primed = await self._start(body, params, [prompt], rid)
        if body.stream:
            return self._stream(body, merged, primed, 1, rid, created, chat=True)
        (out,) = await self._collect(merged, primed, 1)
        c = out.outputs[0]
        response: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
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
            "usage": _usage([out]),
            "kv_transfer_params": out.kv_transfer_params,
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = out.prompt_token_ids
        return response

    # -- streaming ----------------------------------------------------------------------------

    def _stream(
        self,
        body: _SamplingRequest,
        merged: _Merged,
        primed: list[tuple[int, RequestOutput]],
        n: int,
        rid: str,
        created: int,
        chat: bool,
    ) -> EventStream:
        events = self._events(body, merged, primed, n, rid, created, chat)
        return EventStream(events, merged.close)

    async def _events(
        self,
        body: _SamplingRequest,
        merged: _Merged,
        primed: list[tuple[int, RequestOutput]],
        n: int,
        rid: str,
        created: int,
        chat: bool,
    ) -> AsyncGenerator[str, None]:
        params_stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
        hold = (
            0 if body.include_stop_str_in_output or not params_stop else max(map(len, params_stop))
        )
        states = [_Choice(max(0, hold - 1)) for _ in range(n)]
        finals: list[RequestOutput] = []
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            head = {"id": rid, "object": obj, "created": created, "model": self.model_name}
            return sse({**head, "choices": choices, **extra})

        try:
            pending = list(primed)
            while True:
                item = pending.pop(0) if pending else await merged.next()
                if item is None:
                    break
                i, out = item
                _check_failed(out)
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
                if not text and not out.finished and not (body.return_token_ids and ids):
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
                yield chunk([], usage=_usage(finals))
        except (*_ENGINE_ERRORS, RequestFailedError) as e:
            bad_input = isinstance(e, ConfigError)
            err_type = "invalid_request_error" if bad_input else "internal_server_error"
            yield sse(error_body(str(e), err_type, None, 400 if bad_input else 500))
        finally:
            await merged.close()
        yield sse("[DONE]")
