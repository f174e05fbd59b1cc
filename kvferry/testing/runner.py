"""Run a connector through the conformance scenarios and build its report; the built-in
connectors' configurations the kit is run on in CI and in ``docs/conformance.md``."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any

from kvferry.config import ConfigError, KVTransferConfig
from kvferry.kv_transfer.factory import KVConnectorFactory
from kvferry.testing.harness import Harness
from kvferry.testing.pd import PD_SCENARIOS
from kvferry.testing.report import FAILED, ConformanceReport, ScenarioResult
from kvferry.testing.scenarios import SCENARIOS, Subject

# Connectors whose hits are handed over by a prefill instance (run_conformance's pd default).
PD_CONNECTORS = ("NixlConnector", "MooncakeConnector")


def parse_kv_transfer_config(value: str | dict[str, Any]) -> dict[str, Any]:
    """A KV transfer config given as JSON text or a dict, validated the engine's way."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-transfer-config is not valid JSON: {e}") from None
    if not isinstance(value, dict) or not value.get("kv_connector"):
        raise ConfigError("the KV transfer config must be a JSON object with kv_connector set")
    data = {"kv_role": "kv_both", **value}
    # Resolving the class here makes a misspelt name or module path a config error, not a
    # failure of every scenario.
    KVConnectorFactory.get_connector_class(KVTransferConfig.from_dict(data))
    return data


def run_conformance(
    kv_transfer_config: str | dict[str, Any],
    profile: str = "quick",
    scenarios: list[str] | None = None,
    harness: Harness | None = None,
    pd: bool | None = None,
) -> ConformanceReport:
    """Run ``scenarios`` (default: all) against the connector; never raises for a scenario's
    failure (it is reported), only for a config that cannot be read. ``pd``: drive the hit
    scenarios through a prefill and a decode engine (:mod:`kvferry.testing.pd`); default:
    for the NixlConnector."""
    kv = parse_kv_transfer_config(kv_transfer_config)
    names = scenarios or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ConfigError(f"unknown scenario(s) {unknown}; the kit has {list(SCENARIOS)}")
    own = harness is None
    h = harness or Harness(profile)
    report = ConformanceReport(str(kv["kv_connector"]), kv, h.profile.name)
    try:
        subject = Subject(h, kv, kv["kv_connector"] in PD_CONNECTORS if pd is None else pd)
        for name in names:
            t0 = time.perf_counter()
            scenario = PD_SCENARIOS.get(name) if subject.pd else None
            try:
                o = (scenario or SCENARIOS[name])(subject)
                result = ScenarioResult(name, o.status, o.reasons, o.notes)
            except Exception as e:  # a connector may fail in any way; the report says how
                where = traceback.extract_tb(e.__traceback__)[-1]
                result = ScenarioResult(name, FAILED, [
                    f"raised {type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})"
                ])  # fmt: skip
            result.seconds = round(time.perf_counter() - t0, 3)
            report.results.append(result)
    finally:
        if own:
            h.close()
    return report


def builtin_configs(workdir: str | Path) -> dict[str, dict[str, Any]]:
    """kvferry's own connectors as the kit runs them (folders under ``workdir``)."""
    d = Path(workdir)

    def kv(name: str, **extra: Any) -> dict[str, Any]:
        return {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": extra}

    pd_timing: dict[str, Any] = dict(side_channel_port=0, handshake_timeout=1.5,
                                     transfer_timeout=10.0, kv_lease_duration=4.0,
                                     heartbeat_interval=0.5)  # fmt: skip

    return {
        "ExampleConnector": kv("ExampleConnector", shared_storage_path=str(d / "example")),
        # Store-only (hidden states, never a hit): the kit can drive it through misses only.
        "ExampleHiddenStatesConnector": kv(
            "ExampleHiddenStatesConnector",
            shared_storage_path=str(d / "hidden-states"),
            eagle_aux_hidden_state_layer_ids=[0, 1],
        ),
        "SimpleCPUOffloadConnector": kv("SimpleCPUOffloadConnector", num_cpu_blocks=128),
        "OffloadingConnector": kv("OffloadingConnector", num_cpu_chunks=128),
        "OffloadingConnector (disk tier)": kv(
            "OffloadingConnector", num_cpu_chunks=4, disk_path=str(d / "disk")
        ),
        "MultiConnector": kv(
            "MultiConnector",
            connectors=[
                kv("ExampleConnector", shared_storage_path=str(d / "multi-example")),
                kv("SimpleCPUOffloadConnector", num_cpu_blocks=128),
            ],
        ),  # fmt: skip
        # Short lease and timeouts: an abandoned prefill frees its blocks within seconds.
        "NixlConnector": kv("NixlConnector", **pd_timing),
        "MooncakeConnector": kv("MooncakeConnector", **pd_timing),
    }
