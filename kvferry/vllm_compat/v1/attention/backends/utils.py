"""``vllm.v1.attention.backends.utils``: the KV cache layout helpers (vLLM's names).

:func:`get_kv_cache_layout` answers the layout the KV pool of this process's engine is
allocated in, as kvferry decided it at start: ``KVFERRY_KV_CACHE_LAYOUT`` when set, else what
the connector's ``get_required_kvcache_layout`` asked for, else ``NHD``. A connector that
calls it in ``__init__`` or ``register_kv_caches`` gets the order of the tensors it is handed.
Before an engine has started in the process the answer is a forecast from the environment
(``KVFERRY_KV_CACHE_LAYOUT`` or ``NHD``), as no connector requirement is known yet.

:func:`set_kv_cache_layout` exists for code that pins vLLM's layout before start; kvferry's
pool is laid out once and never re-laid, so a name other than the running engine's is an
error rather than a silent lie.
"""

from __future__ import annotations

from typing import Literal, cast, get_args

from kvferry import envs
from kvferry.kv_layout import KVCacheLayout, engine_layout, supported_layout_names

__all__ = [
    "KVCacheLayoutType",
    "get_kv_cache_layout",
    "is_valid_kv_cache_layout",
    "set_kv_cache_layout",
]

KVCacheLayoutType = Literal["NHD", "HND"]

_override: KVCacheLayout | None = None


def is_valid_kv_cache_layout(value: str) -> bool:
    """True for vLLM's layout names ``NHD`` and ``HND`` (exact case, as vLLM checks)."""
    return value in get_args(KVCacheLayoutType)


def get_kv_cache_layout() -> KVCacheLayoutType:
    """``"NHD"`` or ``"HND"``: the memory order of this process's KV pool."""
    layout = engine_layout() or _override or _from_environment()
    return cast(KVCacheLayoutType, layout.value)


def set_kv_cache_layout(cache_layout: str | None) -> None:
    """Pin the answer of :func:`get_kv_cache_layout` before an engine starts (None unpins).
    Raises ValueError for a layout kvferry does not allocate, or one other than the layout
    the running engine's pool already has."""
    global _override
    if cache_layout is None:
        _override = None
        return
    layout = KVCacheLayout.named(str(cache_layout))
    if layout is None:
        raise ValueError(
            f"{cache_layout!r} is not a KV cache layout kvferry allocates; it allocates "
            f"{supported_layout_names()}"
        )
    running = engine_layout()
    if running is not None and running is not layout:
        raise ValueError(
            f"cannot set the KV cache layout to {cache_layout!r}: this process's KV pool is "
            f"already allocated in {running.value!r}. kvferry decides the layout once at start "
            "(KVFERRY_KV_CACHE_LAYOUT, else the connector's get_required_kvcache_layout)"
        )
    _override = layout


def _from_environment() -> KVCacheLayout:
    name = envs.kv_cache_layout()
    return (KVCacheLayout.named(name) if name else None) or KVCacheLayout.NHD
