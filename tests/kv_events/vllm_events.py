"""vLLM's own ``vllm/distributed/kv_events.py`` from the published wheel, run unmodified.

Its ``vllm.*`` imports are served by small stubs while it loads (``KVEventsConfig`` is
kvferry's, which has vLLM's fields; ``ExternalBlockHash`` is vLLM's ``bytes | int``); the
stubs and any ``vllm`` modules already loaded (the kvferry shim) are put back afterwards, so
the session never sees an importable ``vllm``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types
from functools import cache

import pytest

from kvferry.config import KVEventsConfig
from tests.helpers.vllm_wheel import extract

KV_EVENTS = "vllm/distributed/kv_events.py"
MODULE_NAME = "_vllm_wheel_kv_events"


def _stubs() -> dict[str, types.ModuleType]:
    mods = {
        name: types.ModuleType(name)
        for name in (
            "vllm",
            "vllm.config",
            "vllm.config.kv_events",
            "vllm.logger",
            "vllm.utils",
            "vllm.utils.network_utils",
            "vllm.v1",
            "vllm.v1.core",
            "vllm.v1.core.kv_cache_utils",
        )
    }
    mods["vllm.config.kv_events"].KVEventsConfig = KVEventsConfig  # type: ignore[attr-defined]
    mods["vllm.logger"].init_logger = logging.getLogger  # type: ignore[attr-defined]
    net = mods["vllm.utils.network_utils"]
    net.get_ip = lambda: "127.0.0.1"  # type: ignore[attr-defined]
    net.get_tcp_uri = lambda ip, port: f"tcp://{ip}:{port}"  # type: ignore[attr-defined]
    net.is_valid_ipv6_address = lambda ip: ":" in ip  # type: ignore[attr-defined]
    net.split_zmq_path = lambda path: tuple(path.replace("//", "").split(":"))  # type: ignore[attr-defined]
    kcu = mods["vllm.v1.core.kv_cache_utils"]
    kcu.ExternalBlockHash = bytes | int  # type: ignore[attr-defined]
    return mods


@cache
def _load() -> types.ModuleType:
    path = extract(KV_EVENTS) / KV_EVENTS
    saved = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}
    for name in saved:
        del sys.modules[name]
    sys.modules.update(_stubs())
    try:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE_NAME] = module
        spec.loader.exec_module(module)
    finally:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
        sys.modules.update(saved)
    return module


def load() -> types.ModuleType:
    """vLLM's kv_events module. Skips when the wheel cannot be downloaded, unless ``CI`` is
    set (then it fails)."""
    try:
        return _load()
    except RuntimeError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    except OSError as e:  # network or disk trouble while fetching the wheel
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
