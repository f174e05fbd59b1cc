"""Request bodies of the OpenAI-compatible API (pydantic), and the error body.

Unknown fields are ignored (clients send many optional OpenAI fields); fields we know but do
not support with the value given (``n > 1``, ``echo``, ``logprobs``, tools ...) are refused with
a 400 naming the parameter. Extensions, as in vLLM: ``kv_transfer_params`` (handed to the KV
connector), ``ignore_eos``, ``min_tokens``, ``top_k``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``cache_salt`` and
``return_token_ids`` (the response then carries prompt and output token ids).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvferry.config import ConfigError
from kvferry.sampling_params import SamplingParams


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UnsupportedParamError(ConfigError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None

    def _check_common(self) -> None:
        if self.n != 1:
            raise UnsupportedParamError("n", "only n=1 is supported")
        if self.cache_salt is not None and not self.cache_salt:
            raise UnsupportedParamError("cache_salt", "cache_salt must not be empty")

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams for this body; ConfigError (-> 400) on bad values."""
        self._check_common()
        extra: dict[str, Any] = {}
        if self.kv_transfer_params is not None:
            extra["kv_transfer_params"] = dict(self.kv_transfer_params)
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            seed=self.seed,
            max_tokens=self._max_tokens(),
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            extra_args=extra,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this body: one, or a batch (then kv_transfer_params is refused)."""
        if self.echo:
            raise UnsupportedParamError("echo", "echo is not supported")
        if self.logprobs is not None:
            raise UnsupportedParamError("logprobs", "logprobs are not supported yet")
        if self.best_of not in (None, 1):
            raise UnsupportedParamError("best_of", "only best_of=1 is supported")
        if self.suffix:
            raise UnsupportedParamError("suffix", "suffix is not supported")
        p = self.prompt
        items: list[str | list[int]]
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        if not items:
            raise UnsupportedParamError("prompt", "prompt must not be empty")
        if len(items) > 1 and self.kv_transfer_params is not None:
            raise UnsupportedParamError(
                "kv_transfer_params", "kv_transfer_params needs a single prompt, not a batch"
            )
        return items


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise UnsupportedParamError(
                    "messages", f"only text content parts are supported, got {part.type!r}"
                )
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        if self.logprobs or self.top_logprobs:
            raise UnsupportedParamError("logprobs", "logprobs are not supported yet")
        if self.tools:
            raise UnsupportedParamError("tools", "tool calling is not supported")
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class KVReleaseRequest(BaseModel):
    """``POST /v1/kv/release``: give back what the connector holds for these params."""

    model_config = ConfigDict(extra="ignore")
    kv_transfer_params: dict[str, Any]
