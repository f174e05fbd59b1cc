"""The deployment secret: where it comes from, what is refused, and per-purpose keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.config import ConfigError
from kvferry.kv_transfer.secret import MIN_SECRET_BYTES, load_deployment_secret


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFERRY_KV_SECRET", raising=False)
    monkeypatch.delenv("KVFERRY_KV_SECRET_FILE", raising=False)


def test_none_configured() -> None:
    assert load_deployment_secret({}) is None
    assert load_deployment_secret(None) is None


def test_sources_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("a" * 32 + "\n")
    b.write_text("b" * 32)
    monkeypatch.setenv("KVFERRY_KV_SECRET", "c" * 32)
    assert load_deployment_secret({}).value == b"c" * 32  # type: ignore[union-attr]
    monkeypatch.setenv("KVFERRY_KV_SECRET_FILE", str(b))
    assert load_deployment_secret({}).value == b"b" * 32  # type: ignore[union-attr]
    got = load_deployment_secret({"secret_file": str(a)})
    assert got is not None and got.value == b"a" * 32  # whitespace stripped
    assert "a" * 32 not in repr(got)


def test_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    short = tmp_path / "short"
    short.write_text("x" * (MIN_SECRET_BYTES - 1))
    with pytest.raises(ConfigError, match="at least"):
        load_deployment_secret({"secret_file": str(short)})
    with pytest.raises(ConfigError, match="cannot read"):
        load_deployment_secret({"secret_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="path"):
        load_deployment_secret({"secret_file": 3})
    monkeypatch.setenv("KVFERRY_KV_SECRET", "short")
    with pytest.raises(ConfigError, match="KVFERRY_KV_SECRET"):
        load_deployment_secret({})


def test_keys_differ_per_purpose_and_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_KV_SECRET", "s" * 32)
    s = load_deployment_secret({})
    assert s is not None
    k1, k2 = s.key_for("nixl-side-channel"), s.key_for("disk-tier")
    assert len(k1) == 32 and k1 != k2 and k1 == s.key_for("nixl-side-channel")
    monkeypatch.setenv("KVFERRY_KV_SECRET", "t" * 32)
    other = load_deployment_secret({})
    assert other is not None and other.key_for("disk-tier") != k2
