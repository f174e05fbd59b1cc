"""Fixed glibc malloc thresholds in the engine process, and the switch that keeps glibc's."""

from __future__ import annotations

import subprocess
import sys

from kvferry.worker.malloc_tuning import tune_malloc


def test_switched_off_keeps_glibc_defaults() -> None:
    assert tune_malloc(False) == "default(KVFERRY_MALLOC_TUNING=0)"


def test_applied_on_linux_glibc_and_reported() -> None:
    # In a child process: the thresholds are process-wide and must not leak into this one.
    code = "from kvferry.worker.malloc_tuning import tune_malloc; print(tune_malloc(True))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    if sys.platform.startswith("linux"):
        assert out == "glibc(mmap>=32MiB,trim>=1024MiB)"
    else:
        assert out.startswith("default(")
