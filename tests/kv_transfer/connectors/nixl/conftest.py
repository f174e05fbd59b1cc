"""Fixtures for the NIXL connector tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def models(tiny_model_factory, tmp_path_factory) -> dict[str, Path]:
    """Two checkpoints in folders of the same name, same shapes, other weights (seeds)."""
    root = tmp_path_factory.mktemp("same-name")
    out = {}
    for key, seed in (("a", 0), ("b", 1)):
        out[key] = root / key / "tiny"
        shutil.copytree(tiny_model_factory("llama", seed=seed), out[key])
    return out
