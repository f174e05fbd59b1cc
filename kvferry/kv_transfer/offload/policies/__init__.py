"""Eviction policies of the offload tiers, chosen by name ("lru", "arc") or module path.

A module path names a class ``pkg.module:ClassName`` (or ``pkg.module.ClassName``) that
subclasses :class:`EvictionPolicy` and takes the tier's capacity (in chunks) as its only
argument.
"""

from __future__ import annotations

import importlib
import inspect

from kvferry.config import ConfigError
from kvferry.kv_transfer.offload.policies.arc import ARCPolicy
from kvferry.kv_transfer.offload.policies.base import EvictionPolicy, Key
from kvferry.kv_transfer.offload.policies.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}

__all__ = ["ARCPolicy", "EvictionPolicy", "Key", "LRUPolicy", "POLICIES", "policy_class"]


def policy_class(name: str) -> type[EvictionPolicy]:
    """The policy class for a built-in name or a ``module:Class`` path; ConfigError if none."""
    if name in POLICIES:
        return POLICIES[name]
    module_name, sep, cls_name = name.partition(":")
    if not sep:
        module_name, _, cls_name = name.rpartition(".")
    if not module_name or not cls_name:
        raise ConfigError(
            f"unknown eviction policy {name!r}; use one of {sorted(POLICIES)} or a "
            f"'package.module:ClassName' path"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import eviction policy module {module_name!r}: {e}") from None
    cls = getattr(module, cls_name, None)
    if not (inspect.isclass(cls) and issubclass(cls, EvictionPolicy)):
        raise ConfigError(f"{name!r} is not an EvictionPolicy subclass")
    return cls
