"""Building and caching the C kernels in ``csrc/``.

The kernels are plain C (OpenMP where they parallelise), so building one needs only a C
compiler (``$CC`` or ``cc``) and is quick; no torch headers are involved.
They link the OpenMP runtime by its soname (``libgomp.so.1``), which resolves to the
runtime torch already loaded, so a kernel and torch share one thread pool instead of two
pools fighting over the cores.

Shared objects are cached under ``$KVFERRY_KERNEL_CACHE`` (default
``~/.cache/kvferry/kernels``), keyed by the source, the compiler command and the CPU's
feature flags (they are built with ``-march=native``); the headers in ``csrc/`` (which every
kernel may include) count as part of each source. When the compiler is missing or the
build fails, :func:`load_library` logs why once per library and returns None.
``KVFERRY_NATIVE_KERNELS=0`` turns every kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvferry import envs
from kvferry.logger import init_logger

logger = init_logger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def compiler() -> str:
    return os.environ.get("CC") or "cc"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    configured = envs.kernel_cache_dir()
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvferry" / "kernels"


def _compile(cc: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: concurrent engines never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *FLAGS, f"-I{CSRC}", str(source), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(name: str, source: Path | None = None) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` (or ``source``) built and loaded; None when disabled or unbuildable
    (the reason is logged). Repeated calls return the same library."""
    src = source or CSRC / f"{name}.c"
    return _load(name, src, compiler(), envs.native_kernels(), _cache_dir())


@functools.cache
def _load(name: str, source: Path, cc: str, enabled: bool, cache_dir: Path) -> ctypes.CDLL | None:
    if not enabled:
        return None
    if shutil.which(cc) is None:
        logger.warning("no C compiler (%s) found: %s uses its slower portable path", cc, name)
        return None
    key = hashlib.sha256()
    key.update(source.read_bytes())
    for header in sorted(CSRC.glob("*.h")):
        key.update(header.read_bytes())
    key.update(" ".join([cc, *FLAGS]).encode())
    key.update(_cpu_flags().encode())
    target = cache_dir / f"{name}-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _compile(cc, source, target)
            logger.info("built the %s kernel path=%s", name, target)
        return ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or "").strip().splitlines()[-5:]
        logger.warning(
            "building the %s kernel failed (%s); using the portable path: %s",
            name,
            cc,
            " | ".join(tail),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("%s kernel unavailable (%s); using the portable path", name, e)
    return None
