"""Is the machine quiet enough to measure on?

Two checks, because the load average cannot tell this process's own work from others':

* before anything of ours runs: the 1-minute load average (``/proc/loadavg``) must be at
  most ``max_load``;
* between runs, while our own servers idle and the load average still carries our last
  run: the CPU share that *other* processes took over a short window (machine busy time
  from ``/proc/stat``, incl. hypervisor steal, minus this process tree's CPU time) must be
  at most ``max_other``.

Either check waits up to ``wait_s`` for the machine to calm down, then raises NoisyMachine
(the caller refuses to measure) unless told to go on regardless.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass


class NoisyMachine(RuntimeError):
    """Other jobs keep the CPUs busy; numbers taken now would measure them."""


def read_loadavg(path: str = "/proc/loadavg") -> float:
    """The 1-minute load average."""
    with open(path) as f:
        return float(f.read().split()[0])


def busy_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores, steal included)."""
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def own_cpu_s() -> float:
    """CPU seconds of this process and all its descendants, live or reaped."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            # children_*: descendants this process already reaped (a finished client,
            # a server's helper), so their time does not vanish from the sum.
            total += t.user + t.system + t.children_user + t.children_system
    return total


def other_share(busy_delta: float, own_delta: float, wall_s: float, cpus: int) -> float:
    """Share of the machine's CPU capacity used by others over a window (0..1)."""
    return max(0.0, busy_delta - own_delta) / max(wall_s * max(cpus, 1), 1e-9)


@dataclass
class CpuMeter:
    """Others' CPU share between ``start()`` and ``share()``."""

    t0: float = 0.0
    busy0: float = 0.0
    own0: float = 0.0

    def start(self) -> CpuMeter:
        self.t0, self.busy0, self.own0 = time.perf_counter(), busy_cpu_s(), own_cpu_s()
        return self

    def share(self) -> float:
        wall = time.perf_counter() - self.t0
        return other_share(
            busy_cpu_s() - self.busy0, own_cpu_s() - self.own0, wall, os.cpu_count() or 1
        )


def sample_other_share(window_s: float = 2.0) -> float:
    meter = CpuMeter().start()
    time.sleep(window_s)
    return meter.share()


def wait_until(
    probe: Callable[[], float],
    limit: float,
    wait_s: float,
    what: str,
    log: Callable[[str], None],
    poll_s: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Call ``probe`` until it returns at most ``limit``; give up after ``wait_s`` with
    NoisyMachine. Returns the last reading."""
    deadline = time.monotonic() + wait_s
    while True:
        value = probe()
        if value <= limit:
            return value
        if time.monotonic() >= deadline:
            raise NoisyMachine(
                f"{what} is {value:.2f} (limit {limit:.2f}) after waiting {wait_s:.0f} s: "
                "other jobs are using the CPUs. Rerun on a quiet machine, or pass "
                "--allow-noise to measure anyway (the report then warns)."
            )
        log(f"[quiet] {what} {value:.2f} > {limit:.2f}; waiting for the machine to calm down")
        sleep(poll_s)
