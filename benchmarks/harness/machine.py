"""Facts about the machine and software that a measured number depends on."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.harness.paths import REPO_ROOT

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine_info() -> dict[str, Any]:
    """Platform, CPU model and vector ISA (and the level kvferry's CPU paths use), load average, memory, torch and git commit."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    info.update(_cpu_facts())
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        from kvferry.worker.cpu_features import cpu_features

        # What the engine's CPU paths assume (KVFERRY_CPU_ISA may cap it below the flags).
        info["kvferry_cpu"] = cpu_features().as_dict()
    except ImportError:
        pass
    # A preloaded allocator (tcmalloc) changes step times by several percent.
    info["ld_preload"] = os.environ.get("LD_PRELOAD", "")
    commit = _git_commit()
    if commit is not None:
        info["git_commit"] = commit
    return info


def _cpu_facts() -> dict[str, Any]:
    """``cpu_model``, ``cpu_family_model`` (e.g. ``25/1``: a VM's model name may be only
    "AMD EPYC", the family tells Zen 2 from Zen 3) and ``isa`` (the flags of ``ISA_FLAGS``
    this CPU has) from /proc/cpuinfo."""
    facts: dict[str, Any] = {}
    ids: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    facts["cpu_model"] = value.strip()
                elif key in ("cpu family", "model") and key not in ids:
                    ids[key] = value.strip()
                elif not key:  # the first processor's block ends
                    break
        if len(ids) == 2:
            facts["cpu_family_model"] = f"{ids['cpu family']}/{ids['model']}"
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
        facts["isa"] = [f for f in ISA_FLAGS if f in flags]
    except (OSError, IndexError):
        pass
    return facts


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()


def _git_commit() -> str | None:
    """Short HEAD commit, ``-dirty`` when ``kvferry/`` has uncommitted changes."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--", "kvferry")
    except OSError:
        return None
    return commit + ("-dirty" if dirty else "")
