"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvferry.model.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(arch="llama", **kwargs) -> Path``: a tiny random HF checkpoint folder made by
    :func:`kvferry.model.tiny.make_tiny_model`, built once per session for each distinct set of
    arguments. Treat the folder as read-only; copy it before changing anything."""
    cache: dict[str, Path] = {}

    def factory(arch: str = "llama", **kwargs: Any) -> Path:
        key = repr((arch, sorted(kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_model(out, arch=arch, **kwargs)
        return cache[key]

    return factory
