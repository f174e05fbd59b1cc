"""The weights fingerprint in the P/D compatibility check: it tells other weights apart
by content, not location, and the compat hash includes it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvferry.kv_transfer.connectors.pd import handshake as hs
from kvferry.model.fingerprint import weights_fingerprint
from tests.helpers.scheduler import make_kv_cache_config

# -- weights fingerprint ----------------------------------------------------------------------


def test_weights_fingerprint_tells_other_weights_apart(tiny_model_factory, tmp_path) -> None:
    a = tiny_model_factory("llama", layers=2, hidden=64, heads=2, kv_heads=1, vocab=512)
    b = tiny_model_factory("llama", layers=2, hidden=64, heads=2, kv_heads=1, vocab=512, seed=1)
    copy = tmp_path / "elsewhere" / a.name
    shutil.copytree(a, copy)
    fa, fb = weights_fingerprint(a), weights_fingerprint(b)
    assert fa != fb and len(fa) == 32
    assert weights_fingerprint(copy) == fa  # content, not location
    assert weights_fingerprint(tmp_path / "nothing") == "none"
    # A change inside a sampled region of the data changes it (the file's last bytes are one).
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert weights_fingerprint(copy) != fa
    cfg = json.loads((a / "config.json").read_text())
    assert cfg == json.loads((b / "config.json").read_text())  # same shapes, same config


def _weights_config(model: Path) -> Any:
    arch = SimpleNamespace(architecture="LlamaForCausalLM", layers=2)
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(model), arch=arch),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def test_compat_hash_includes_the_weights(tiny_model_factory) -> None:
    a = tiny_model_factory("llama", layers=2, hidden=64, heads=2, kv_heads=1, vocab=512)
    b = tiny_model_factory("llama", layers=2, hidden=64, heads=2, kv_heads=1, vocab=512, seed=1)
    kvc = make_kv_cache_config(16)
    ca = hs.Compat.of(_weights_config(a), kvc)  # type: ignore[arg-type]
    cb = hs.Compat.of(_weights_config(b), kvc)  # type: ignore[arg-type]
    assert f"weights={weights_fingerprint(a)}" in ca.desc
    assert ca.hash != cb.hash
