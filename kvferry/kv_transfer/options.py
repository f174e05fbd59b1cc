"""Typed connector options parsed from ``kv_connector_extra_config``."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from kvferry.config import ConfigError

T = TypeVar("T")


def _check_type(name: str, value: Any, hint: Any, owner: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(name, value, arg, owner)
            except ConfigError:
                continue
        raise ConfigError(f"{owner}: option {name!r} has an invalid value {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    base = origin or hint
    if base is Any:
        return value
    if isinstance(base, type) and (
        not isinstance(value, base) or (base is int and isinstance(value, bool))
    ):
        raise ConfigError(
            f"{owner}: option {name!r} must be {getattr(base, '__name__', base)}, got {value!r}"
        )
    return value


def parse_options(
    cls: type[T], extra: dict[str, Any], owner: str, ignore: tuple[str, ...] = ()
) -> T:
    """Build the dataclass ``cls`` from ``extra``; unknown keys and wrong types are errors.

    ``ignore`` names keys that belong to someone else (e.g. a parent connector)."""
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(extra) - fields - set(ignore))
    if unknown:
        raise ConfigError(
            f"{owner}: unknown kv_connector_extra_config option(s) {unknown}; "
            f"valid options are {sorted(fields)}"
        )
    values = {k: _check_type(k, v, hints[k], owner) for k, v in extra.items() if k in fields}
    obj = cls(**values)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(owner)
    return obj
