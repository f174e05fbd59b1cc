"""A C kernel of ``kvferry/native/csrc`` at another git revision next to the working tree's,
in one process: its build from that revision's sources, and an engine's decode steps timed
with the two builds taking turns.

Both builds export the same symbol names; ``ctypes.CDLL`` opens each library with its own
handle (``RTLD_LOCAL``), so a function looked up on one never resolves into the other.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.harness.decode_steps import random_prompts, timed_decode_steps
from benchmarks.harness.models import bench_model
from benchmarks.harness.paths import REPO_ROOT
from benchmarks.harness.quiet import read_loadavg, wait_until
from benchmarks.harness.results import result_path, run_header, write_json
from benchmarks.harness.timing import alternating

CSRC = "kvferry/native/csrc"
BUILDS = ("current", "baseline")


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def sources_at(rev: str, source: str, folder: Path) -> Path:
    """``rev``'s ``csrc/<source>`` and every header of its ``csrc/`` written into ``folder``
    side by side, so that the source's quoted includes find that revision's headers before
    the working tree's (the build adds ``-I`` of the tree's ``csrc``); returns the source."""
    names = _git("ls-tree", "--name-only", rev, f"{CSRC}/").split()
    if f"{CSRC}/{source}" not in names:
        sys.exit(f"{rev} has no {CSRC}/{source}")
    headers = sorted(n for n in names if n.endswith(".h"))
    digest = hashlib.sha256()
    for name in headers:
        text = _git("show", f"{rev}:{name}")
        (folder / Path(name).name).write_text(text)
        digest.update(text.encode())
    # The build's cache key hashes the source and the working tree's headers, not these:
    # naming the revision's headers in the source keeps one revision's cached build from
    # standing in for another's with the same .c and different headers.
    text = _git("show", f"{rev}:{CSRC}/{source}")
    text += f"\n/* headers at {rev}: sha256 {digest.hexdigest()} */\n"
    (folder / source).write_text(text)
    return folder / source


def load_library_at(rev: str, source: str, lib_name: str) -> ctypes.CDLL:
    """``csrc/<source>`` (e.g. ``"bf16_linear.c"``) as it is at git revision ``rev``, built
    with that revision's headers and loaded as ``lib_name`` (a name of its own, so that it
    neither replaces nor reuses the working tree's build); exits where it cannot be built."""
    from kvferry.native.build import load_library

    folder = Path(tempfile.mkdtemp(prefix=f"kvferry-{Path(source).stem}-"))
    lib = load_library(lib_name, sources_at(rev, source, folder))
    if lib is None:
        sys.exit(f"could not build {rev}'s {source} (no C compiler, or native kernels off)")
    return lib


def generate_s(llm: Any, rng: random.Random, nreq: int, ctx: int, tokens: int) -> float:
    """Seconds for ``nreq`` fresh random prompts of ``ctx`` tokens to generate ``tokens``."""
    from kvferry import SamplingParams

    vocab = llm.engine.config.model_config.arch.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(ctx)]} for _ in range(nreq)
    ]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t


def paired_decode_steps(
    llm: Any,
    use: Callable[[str], None],
    nreq: int,
    ctx: int,
    rounds: int,
    rng: random.Random,
) -> dict[str, list[float]]:
    """Decode-step seconds of ``llm`` per build (:data:`BUILDS`) and round; ``use(name)``
    switches the engine to a build. Each round prefills ``nreq`` fresh random prompts of
    ``ctx`` tokens, then runs their 32 decode steps with the builds alternating step by step
    (the first build alternating by round), so both see the same batch at nearly the same
    context; a round's value per build is the median of its 16 steps. The engine is left on
    ``"current"``."""
    engine = llm.engine
    steps: dict[str, list[float]] = {name: [] for name in BUILDS}
    generate_s(llm, rng, nreq, ctx, 2)  # first touch of the blocks this case uses
    for r in range(rounds):
        order = alternating(BUILDS, r)
        use("current")
        names: list[str] = []

        def before(i: int, order: list[str] = order, names: list[str] = names) -> None:
            names.append(order[i % 2])
            use(names[-1])

        prompts = random_prompts(engine, rng, nreq, ctx)
        times = timed_decode_steps(engine, prompts, 32, before)
        for name in BUILDS:
            steps[name].append(
                statistics.median(t for n, t in zip(names, times, strict=True) if n == name)
            )
    use("current")
    return steps


def step_summary(steps: Mapping[str, list[float]], label: str) -> dict[str, Any]:
    """A case's paired decode steps (:func:`paired_decode_steps`) as its median ms per build
    and the per-round speed-ups, printed as one line headed ``label``."""
    gains = [b / c for c, b in zip(steps["current"], steps["baseline"], strict=True)]
    ms = {n: statistics.median(v) * 1e3 for n, v in steps.items()}
    print(
        f"{label}: step {ms['current']:.1f} ms against {ms['baseline']:.1f}; speed-up median"
        f" {statistics.median(gains):.3f} ({min(gains):.3f}-{max(gains):.3f})",
        flush=True,
    )
    return {"step_ms": ms, "gains": gains}


PARTS = ("kernel", "engine")


def add_ab_arguments(ap: argparse.ArgumentParser, name: str) -> None:
    """The options every revision A/B script takes: the revision, the model, which parts
    run, rounds, seed, the quiet-machine check and the results file."""
    ap.add_argument("--baseline", required=True, help="git revision of the kernel to compare")
    ap.add_argument("--model", default="qwen3-0.6b", help="a benchmark model name, or a folder")
    ap.add_argument("--parts", default="kernel", help="comma-separated: kernel, engine")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-load", type=float, default=0.5, help="1-min load average to start")
    ap.add_argument("--allow-noise", action="store_true")
    ap.add_argument("--out", help=f"results JSON (default: .bench/results/{name}.json)")


def resolve_ab_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.parts`` as a list of :data:`PARTS` (an unknown one is a usage error) and
    ``args.model_dir``, the model's folder (built on first use for a benchmark name)."""
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if set(args.parts) - set(PARTS):
        ap.error(f"unknown --parts {sorted(set(args.parts) - set(PARTS))}")
    folder = Path(args.model) if Path(args.model).is_dir() else bench_model(args.model)
    args.model_dir = str(folder)


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"1x160,8x160"`` as ``[(requests, tokens), ...]``."""
    out = []
    for item in text.split(","):
        nreq, _, ctx = item.strip().partition("x")
        out.append((int(nreq), int(ctx)))
    return out


def run_ab(
    name: str,
    args: Any,
    parts: Mapping[str, Callable[[], Any]],
    report: Callable[[dict[str, Any]], str],
    **facts: Any,
) -> None:
    """The end every A/B script shares: waits for a quiet machine (unless
    ``args.allow_noise``), runs the ``parts`` (name -> what it measures) in order, and writes
    the results JSON (``args.out``, default ``.bench/results/<name>.json``) with the run's
    header, ``facts`` and settings, then prints ``report``'s table."""
    if not args.allow_noise:
        wait_until(read_loadavg, args.max_load, 300.0, "1-min load average", print)
    doc: dict[str, Any] = {**run_header(), **facts}
    doc["settings"] = {k: v for k, v in vars(args).items() if k != "model_dir"}
    for part, measure in parts.items():
        doc[part] = measure()
    doc["table"] = report(doc)
    out = write_json(Path(args.out) if args.out else result_path(name), doc)
    print(doc["table"])
    print(f"results: {out}")
