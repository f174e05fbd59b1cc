"""Typed configs from JSON objects: one set of checks and messages for every ``*_config`` flag."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from kvferry.config.errors import ConfigError

T = TypeVar("T")


def from_json_object(cls: type[T], data: Any, what: str) -> T:
    """``cls(**data)`` for a dataclass ``cls``, with a ConfigError naming ``what`` (e.g. "KV
    transfer config") for a non-object, unknown keys or values of the wrong kind."""
    if not isinstance(data, dict):
        raise ConfigError(f"the {what} must be a JSON object")
    valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ConfigError(f"unknown {what} key(s) {unknown}; valid keys are {valid}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ConfigError(f"bad {what}: {e}") from None


def parse_json(text: str, flag: str) -> Any:
    """The value of JSON flag ``flag`` (e.g. "--kv-transfer-config"), or a ConfigError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} is not valid JSON: {e}") from None
