"""Request bodies of the OpenAI-compatible API (pydantic), and the error body.

Unknown fields are ignored (clients send many optional OpenAI fields); fields we know but do
not support with the value given (``n > 1``, ``echo``, ``logprobs``, tools ...) are refused with
a 400 naming the parameter. Extensions, as in vLLM: ``kv_transfer_params`` (handed to the KV
connector), ``ignore_eos``, ``min_tokens``, ``top_k``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``cache_salt`` and
``return_token_ids`` (the response then carries prompt and output token ids).

:func:`parse_body` turns raw bytes into one of these models, refusing with a 400 naming the
parameter what Python's ``json`` would let through: invalid UTF-8, ``NaN`` / ``Infinity`` (and
numbers too large for a float), and lone UTF-16 surrogates (``"\\ud800"``), which are not text.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvferry.config import ConfigError
from kvferry.entrypoints.openai.limits import ServerLimits
from kvferry.sampling_params import InvalidParamError, SamplingParams

M = TypeVar("M", bound=BaseModel)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UnsupportedParamError(InvalidParamError):
    """A known parameter with a value (or a feature) this server does not support."""


class BodyError(ConfigError):
    """The body as a whole is unreadable (not UTF-8, not JSON); no one parameter is at fault
    (``param`` is null, as the proxy reports it too)."""

    param = None


def _path(parts: tuple[Any, ...]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}" if out else str(p)
    return out or "body"


def _not_text(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_json_values(obj: Any) -> None:
    """Refuse non-finite numbers and strings that are not valid Unicode anywhere in ``obj``
    (iteratively: the depth is the parser's problem, not the stack's)."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidParamError(
                str(path[0]) if path else "body",
                f"{_path(path)} must be a finite number, got {value} (NaN and Infinity are "
                "not JSON numbers)",
            )
        if isinstance(value, str) and _not_text(value):
            raise InvalidParamError(
                str(path[0]) if path else "body",
                f"{_path(path)} is not valid Unicode text (it holds a lone UTF-16 surrogate)",
            )
        if isinstance(value, dict):
            for k, v in value.items():
                if _not_text(k):
                    raise InvalidParamError(
                        "body", "a key in the body is not valid Unicode text (a lone surrogate)"
                    )
                stack.append(((*path, k), v))
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in enumerate(value))


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: the first few, each with its field path."""
    parts = [f"{_path(tuple(e.get('loc', ())))}: {e.get('msg', 'invalid')}" for e in errors[:5]]
    loc = tuple(errors[0].get("loc", ())) if errors else ()
    return "; ".join(parts) or "invalid request body", str(loc[0]) if loc else None


def parse_body(raw: bytes, model: type[M]) -> M:
    """``model`` from a JSON body; ConfigError (-> 400) with a readable message otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"the request body is not valid UTF-8 (at byte {e.start})") from None
    if not text.strip():
        raise BodyError("the request body is empty; send a JSON object")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BodyError(
            f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise BodyError("the request body nests JSON too deeply") from None
    except ValueError as e:  # e.g. an integer literal of more digits than Python converts
        reason = str(e).split(":")[0]
        raise BodyError(f"the request body is not valid JSON: {reason}") from None
    if not isinstance(obj, dict):
        raise BodyError(f"the request body must be a JSON object, got {type(obj).__name__}")
    check_json_values(obj)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        message, param = validation_message(list(e.errors()))
        raise InvalidParamError(param or "body", message) from None


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

    def _check_common(self, limits: ServerLimits) -> None:
        if self.n != 1:
            raise UnsupportedParamError("n", "only n=1 is supported")
        if self.cache_salt is not None and not self.cache_salt:
            raise UnsupportedParamError("cache_salt", "cache_salt must not be empty")
        if self.top_k is not None and self.top_k < -1:
            raise InvalidParamError(
                "top_k", f"top_k must be 0 or -1 (disabled), or at least 1, got {self.top_k}"
            )
        stop = self._stop_list()
        if len(stop) > limits.max_stop_strings:
            raise InvalidParamError(
                "stop", f"stop may hold at most {limits.max_stop_strings} strings, got {len(stop)}"
            )
        longest = max(map(len, stop), default=0)
        if longest > limits.max_stop_string_chars:
            raise InvalidParamError(
                "stop",
                f"a stop string may be at most {limits.max_stop_string_chars} characters long, "
                f"got {longest}",
            )

    def _stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, limits: ServerLimits | None = None) -> SamplingParams:
        """SamplingParams for this body; ConfigError (-> 400) on bad values."""
        self._check_common(limits or ServerLimits())
        extra: dict[str, Any] = {}
        if self.kv_transfer_params is not None:
            extra["kv_transfer_params"] = dict(self.kv_transfer_params)
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else None
        stop = self._stop_list()
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

    def prompts(self, max_prompts: int | None = None) -> list[str | list[int]]:
        """The prompts of this body: one, or a batch (then kv_transfer_params is refused) of
        at most ``max_prompts``."""
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
        if max_prompts is not None and len(items) > max_prompts:
            raise InvalidParamError(
                "prompt", f"a request may carry at most {max_prompts} prompts, got {len(items)}"
            )
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


class TokenizeRequest(BaseModel):
    """``POST /tokenize``, as vLLM takes it: a ``prompt`` or chat ``messages`` (not both)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: True for a prompt, False for messages (the template holds them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidParamError("prompt", "give either prompt or messages")
        if self.messages is not None and not self.messages:
            raise InvalidParamError("messages", "messages must not be empty")
        if self.continue_final_message:
            raise UnsupportedParamError(
                "continue_final_message", "continue_final_message is not supported"
            )


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


class KVReleaseRequest(BaseModel):
    """``POST /v1/kv/release``: give back what the connector holds for these params."""

    model_config = ConfigDict(extra="ignore")
    kv_transfer_params: dict[str, Any]
