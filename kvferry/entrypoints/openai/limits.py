"""ServerLimits: how much one HTTP client may ask of ``kvferry serve``, checked in one place.

Every limit has a ``kvferry serve`` flag (the field name with dashes) and a default
meant to refuse only what no valid request needs:

- ``max_request_body_bytes``: a bigger body is refused with 413 while it streams in (a declared
  ``Content-Length`` over the limit before any of it is read).
- ``max_prompt_chars``: characters of one prompt (a completion prompt, or all message texts of
  a chat) before anything is tokenized. ``None``: the model's own bound, ``max_model_len``
  times the most characters one token of its tokenizer can cover (see :mod:`.prompt_bound`),
  which no prompt that fits the context exceeds; for a tokenizer without such a bound, no
  limit but the body's. A configured value applies besides that bound, and to the sum of a
  chat's message texts.
- ``max_prompts_per_request``: prompts in one ``/v1/completions`` batch.
- ``max_stop_strings`` / ``max_stop_string_chars``: the ``stop`` list, which is matched
  against the output after every token.
- ``body_read_timeout``: the whole body must arrive within this (else 408).
- ``header_timeout``: a connection must deliver a complete request head within this of
  connecting (or of its previous response), else it is closed: slow-header clients cannot
  hold connections open.
- ``timeout_keep_alive``: idle keep-alive connections are closed after this (uvicorn's).
- ``limit_concurrency``: connections plus requests in progress above which uvicorn answers
  503 (``None``: no limit).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

from kvferry.config import ConfigError

MiB = 1 << 20


# Help of each flag; the flag is the field's name with dashes.
_HELP = {
    "max_request_body_bytes": "largest request body in bytes; bigger ones get 413",
    "max_prompt_chars": "longest prompt in characters (default: max-model-len times the most "
    "characters one token of the tokenizer covers)",
    "max_prompts_per_request": "most prompts in one /v1/completions batch",
    "max_stop_strings": "most strings in a request's stop list",
    "max_stop_string_chars": "longest stop string in characters",
    "body_read_timeout": "seconds a client has to send the whole body, else 408",
    "header_timeout": "seconds a connection has to send a complete request head, else it is closed",
    "timeout_keep_alive": "seconds an idle keep-alive connection stays open",
    "limit_concurrency": "connections plus requests in progress above which new requests get "
    "503 (default: no limit)",
}
_OPTIONAL = ("max_prompt_chars", "limit_concurrency")


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = 16 * MiB
    max_prompt_chars: int | None = None
    max_prompts_per_request: int = 256
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    body_read_timeout: float = 60.0
    header_timeout: float = 10.0
    timeout_keep_alive: int = 5
    limit_concurrency: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in _OPTIONAL:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{flag} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{flag} must be positive, got {value}")

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("request limits")
        for f in fields(ServerLimits):
            kind = float if f.type == "float" else int
            default = f.default
            suffix = "" if f.name in _OPTIONAL else " (default: %(default)s)"
            g.add_argument(
                "--" + f.name.replace("_", "-"),
                type=kind,
                default=default,
                help=_HELP[f.name] + suffix,
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerLimits:
        given = vars(args)
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})
