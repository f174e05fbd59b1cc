"""kvferry.testing: the conformance kit for KV-connector authors.

``run_conformance(kv_transfer_config)`` runs a connector (built-in, or yours through
``kv_connector_module_path``; kvferry-native or written against vLLM's API) through the
protocol's scenarios on a real engine with a tiny random model, and returns a
:class:`ConformanceReport`. The same is ``kvferry conformance --kv-transfer-config JSON`` on
the command line and ``pytest -p kvferry.testing.pytest_plugin`` in a test suite.
"""

from kvferry.testing.harness import PROFILES, Harness
from kvferry.testing.order import check_order
from kvferry.testing.report import (
    FAILED,
    NOT_APPLICABLE,
    NOT_EXERCISED,
    PASSED,
    ConformanceReport,
    ScenarioResult,
)
from kvferry.testing.runner import builtin_configs, parse_kv_transfer_config, run_conformance
from kvferry.testing.scenarios import SCENARIOS

__all__ = [
    "FAILED",
    "NOT_APPLICABLE",
    "NOT_EXERCISED",
    "PASSED",
    "PROFILES",
    "SCENARIOS",
    "ConformanceReport",
    "Harness",
    "ScenarioResult",
    "builtin_configs",
    "check_order",
    "parse_kv_transfer_config",
    "run_conformance",
]
