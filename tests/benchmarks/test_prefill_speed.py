"""The prefill benchmark's step profile times every part, C kernels included, and leaves the
engine's methods as it found them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import prefill_speed
from benchmarks.harness.engines import make_llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profile_times_each_part_and_restores_the_methods(
    tiny_model_factory: Callable[..., Path], dtype: str
) -> None:
    llm = make_llm(tiny_model_factory(), dtype, max_model_len=256, enable_prefix_caching=False)
    methods = [cls.__dict__[name] for _, cls, name in prefill_speed._PARTS]
    parts = prefill_speed.profile(llm, list(range(10, 140)))
    assert [cls.__dict__[name] for _, cls, name in prefill_speed._PARTS] == methods
    for part in ("linear layers", "attention", "kv write"):
        assert parts[part] > 0, part
    timed = sum(v for k, v in parts.items() if k not in ("wall", "other"))
    assert timed + parts["other"] == pytest.approx(parts["wall"])
    assert 0 < timed < parts["wall"]
