"""Running one benchmark child process: wall time, peak RSS, and other jobs' CPU use."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class ChildResult:
    returncode: int
    wall_s: float
    peak_rss_bytes: int  # max(kernel ru_maxrss of the child, sampled RSS of its process tree)
    maxrss_bytes: int  # kernel's ru_maxrss for the child (largest single process)
    sampled_tree_rss_bytes: int  # largest sampled sum of RSS over child + descendants
    stdout: str
    stderr: str
    timed_out: bool = False
    # Share of the machine's CPU time (all cores, wall_s) used by anything other than this
    # child's tree and this process, incl. hypervisor steal: noise from other jobs.
    other_cpu_frac: float = 0.0


def _busy_cpu_s() -> float:
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _self_cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _tree_rss(proc: Any) -> int:
    import psutil

    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def _pump(stream: Any, sink: list[str], echo: bool) -> None:
    for line in stream:
        sink.append(line)
        if echo:
            sys.stderr.write(line)
            sys.stderr.flush()


def run_child(
    cmd: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    poll_interval: float = 0.05,
    cwd: str | os.PathLike[str] | None = None,
    echo_stderr: bool = False,
) -> ChildResult:
    """Run ``cmd`` to completion and measure its wall time and peak RSS.

    Peak RSS comes from two sources: the kernel's ``ru_maxrss`` of this child (via
    ``os.wait4``, exact but per process) and a psutil sampler that sums RSS over the
    child's whole process tree (catches helper processes, may miss short spikes).
    """
    import psutil

    busy0, self0 = _busy_cpu_s(), _self_cpu_s()
    start = time.perf_counter()
    popen = subprocess.Popen(
        list(cmd),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out_chunks: list[str] = []
    err_chunks: list[str] = []
    pumps = [
        threading.Thread(target=_pump, args=(popen.stdout, out_chunks, False), daemon=True),
        threading.Thread(target=_pump, args=(popen.stderr, err_chunks, echo_stderr), daemon=True),
    ]
    for t in pumps:
        t.start()
    ps = psutil.Process(popen.pid)
    sampled = 0
    timed_out = False
    status = 0
    usage: resource.struct_rusage | None = None
    while True:
        pid, status, usage = os.wait4(popen.pid, os.WNOHANG)
        if pid != 0:
            break
        sampled = max(sampled, _tree_rss(ps))
        if timeout is not None and time.perf_counter() - start > timeout:
            timed_out = True
            for child in ps.children(recursive=True):
                child.kill()
            popen.kill()
            _, status, usage = os.wait4(popen.pid, 0)
            break
        time.sleep(poll_interval)
    wall = time.perf_counter() - start
    assert usage is not None
    child_cpu = usage.ru_utime + usage.ru_stime  # incl. descendants the child waited for
    other = _busy_cpu_s() - busy0 - child_cpu - (_self_cpu_s() - self0)
    other_frac = max(0.0, other) / max(wall * (os.cpu_count() or 1), 1e-9)
    popen.returncode = os.waitstatus_to_exitcode(status)
    for t in pumps:
        t.join(timeout=5)
    maxrss = usage.ru_maxrss * 1024  # Linux reports KiB
    return ChildResult(
        returncode=popen.returncode,
        wall_s=wall,
        peak_rss_bytes=max(maxrss, sampled),
        maxrss_bytes=maxrss,
        sampled_tree_rss_bytes=sampled,
        stdout="".join(out_chunks),
        stderr="".join(err_chunks),
        timed_out=timed_out,
        other_cpu_frac=other_frac,
    )
