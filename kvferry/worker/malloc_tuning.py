"""glibc malloc settings for an engine process: fixed mmap and trim thresholds.

By default glibc raises its mmap threshold each time a large mmapped block is freed, and
returns freed memory at the top of the heap to the OS once it passes the trim threshold. An
engine step allocates and frees the same activation buffers (MiBs each) every step, so the
heap keeps shrinking and growing, and each regrowth page-faults fresh zeroed pages into the
next step's GEMMs and elementwise ops; long-lived small allocations between them (a connector
that keeps copies of KV blocks) make it worse. Fixed thresholds keep step buffers in the heap
and reused. Measured numbers are in docs/benchmarks.md ("Measured facts").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Blocks above 32 MiB still come from mmap (glibc's own upper bound for the dynamic threshold);
# up to 1 GiB of freed heap top is kept for the next step instead of being returned.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def tune_malloc(enabled: bool) -> str:
    """Apply the thresholds once for this process; returns what was done, for the log."""
    if not enabled:
        return "default(KVFERRY_MALLOC_TUNING=0)"
    if not sys.platform.startswith("linux"):
        return "default(not-linux)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has no mallopt tunables)
    except (OSError, AttributeError):
        return "default(not-glibc)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ):
        return "default(mallopt-refused)"
    return f"glibc(mmap>={MMAP_THRESHOLD >> 20}MiB,trim>={TRIM_THRESHOLD >> 20}MiB)"
