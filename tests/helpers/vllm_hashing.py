"""vLLM's own block-hash code (``vllm/utils/hashing.py`` and ``vllm/v1/core/kv_cache_utils.py``
from the published wheel), loaded with stub modules for the rest of ``vllm``.

The two files run unmodified; every other ``vllm.*`` module they import is a stub whose
attributes are placeholder classes, except ``vllm.envs`` (the flag ``maybe_convert_block_hash``
reads) and ``vllm.logger`` (standard logging, so tests can read vLLM's warnings). The stubs live
in ``sys.modules`` only while loading: a test session never sees an importable ``vllm``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.vllm_wheel import extract

HASHING = "vllm/utils/hashing.py"
KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"
VLLM_LOGGER = "vllm.v1.core.kv_cache_utils"


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = sys.modules.get(f"{self.__name__}.{name}")
        if sub is not None:
            return sub
        placeholder = type(name, (), {})
        setattr(self, name, placeholder)
        return placeholder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, src: Path, real: dict[str, str]) -> None:
        self.src = src
        self.real = real

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name in self.real:
            return importlib.util.spec_from_file_location(name, self.src / self.real[name])
        if name == "vllm" or name.startswith("vllm."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _vllm_names() -> list[str]:
    return [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]


def load() -> tuple[types.ModuleType, types.ModuleType]:
    """``(hashing, kv_cache_utils)`` as vLLM ships them. Skips the test when the wheel cannot
    be downloaded, unless ``CI`` is set (then it fails)."""
    try:
        src = extract(HASHING, KV_CACHE_UTILS)
    except RuntimeError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    real = {
        "vllm.utils.hashing": HASHING,
        "vllm.v1.core.kv_cache_utils": KV_CACHE_UTILS,
    }
    saved = {n: sys.modules.pop(n) for n in _vllm_names()}
    finder = _Finder(src, real)
    sys.meta_path.insert(0, finder)
    try:
        envs = importlib.import_module("vllm.envs")
        envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = True  # type: ignore[attr-defined]
        vllm_logger = importlib.import_module("vllm.logger")
        vllm_logger.init_logger = logging.getLogger  # type: ignore[attr-defined]
        hashing = importlib.import_module("vllm.utils.hashing")
        kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    finally:
        sys.meta_path.remove(finder)
        for n in _vllm_names():
            del sys.modules[n]
        sys.modules.update(saved)
    return hashing, kv_cache_utils
