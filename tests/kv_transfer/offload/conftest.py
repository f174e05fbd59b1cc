"""Fixtures for the offload tests."""

from __future__ import annotations

import pytest


@pytest.fixture()
def no_ambient_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset the deployment secret the environment may carry, so a test runs keyed only where
    it says so (the disk-tier tests opt in with ``pytest.mark.usefixtures``)."""
    monkeypatch.delenv("KVFERRY_KV_SECRET", raising=False)
    monkeypatch.delenv("KVFERRY_KV_SECRET_FILE", raising=False)
