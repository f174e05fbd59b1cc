"""The KV-transfer configs the benchmarks compare, as ``kv_transfer_config`` dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HOST_BYTES = 4 << 30  # host tier of the offload configs


def offload_kv(kind: str, folder: Path | None = None, **extra: Any) -> dict[str, Any] | None:
    """``off`` | ``simple`` (SimpleCPUOffloadConnector, eager) | ``offload`` (host tier)
    | ``disk`` (OffloadingConnector with a disk tier in ``folder``); ``extra`` adds or
    overrides connector options."""
    if kind == "off":
        return None
    options: dict[str, Any] = {"cpu_bytes_to_use": HOST_BYTES}
    if kind == "simple":
        name = "SimpleCPUOffloadConnector"
    elif kind == "offload":
        name = "OffloadingConnector"
    elif kind == "disk":
        assert folder is not None
        name = "OffloadingConnector"
        options["disk_path"] = str(folder)
    else:
        raise ValueError(f"unknown offload config {kind!r}")
    options.update(extra)
    return {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": options}


def nixl_kv(port: int | None = None, ip: str | None = None) -> dict[str, Any]:
    """NixlConnector in both roles, side channel on a free port; ``port`` / ``ip`` set
    ``kv_port`` / ``kv_ip`` when given."""
    kv: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    if ip is not None:
        kv["kv_ip"] = ip
    if port is not None:
        kv["kv_port"] = port
    kv["kv_connector_extra_config"] = {"side_channel_port": 0}
    return kv
