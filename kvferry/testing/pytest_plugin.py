"""A pytest plugin for connector authors: ``pytest -p kvferry.testing.pytest_plugin``.

``--kvferry-conformance JSON`` (repeatable) adds one test item that runs each config through
every scenario, prints the reports and fails with the report of any config that failed a
scenario (*not exercised* and *not applicable* scenarios do not fail it). The ``kvferry_conformance`` fixture runs the kit from a test:
``report = kvferry_conformance({"kv_connector": ...})``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvferry.testing.harness import Harness
from kvferry.testing.report import PASSED, ConformanceReport
from kvferry.testing.runner import run_conformance


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvferry", "kvferry connector conformance")
    group.addoption("--kvferry-conformance", action="append", default=[], metavar="JSON",
                    help="a KV transfer config to run through the conformance scenarios")  # fmt: skip
    group.addoption("--kvferry-conformance-profile", default="quick", choices=["quick", "full"])


@pytest.fixture(scope="session")
def kvferry_harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    h = Harness(request.config.getoption("--kvferry-conformance-profile"))
    yield h
    h.close()


@pytest.fixture(scope="session")
def kvferry_conformance(kvferry_harness: Harness) -> Callable[..., ConformanceReport]:
    def run(kv: str | dict[str, Any], scenarios: list[str] | None = None) -> ConformanceReport:
        return run_conformance(kv, scenarios=scenarios, harness=kvferry_harness)

    return run


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:  # fmt: skip
    if config.getoption("--kvferry-conformance"):
        items.append(_ConformanceItem.from_parent(session, name="kvferry-conformance"))


class _ConformanceItem(pytest.Item):
    """One item running every ``--kvferry-conformance`` config; fails with the report."""

    def runtest(self) -> None:
        h = Harness(self.config.getoption("--kvferry-conformance-profile"))
        try:
            configs = self.config.getoption("--kvferry-conformance")
            reports = [run_conformance(kv, harness=h) for kv in configs]
        finally:
            h.close()
        failed = [r for r in reports if not r.ok]
        for r in reports:
            print(r.to_text())
        if failed:
            raise AssertionError("\n".join(r.to_text() for r in failed))
        if not any(res.status == PASSED for r in reports for res in r.results):
            pytest.skip("no scenario could be exercised")

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "kvferry-conformance", None, "kvferry conformance kit"


__all__ = ["kvferry_conformance", "kvferry_harness"]
