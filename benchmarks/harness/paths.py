"""Where the benchmarks keep what they create (all under the git-ignored ``.bench/``)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
BENCH_DIR = REPO_ROOT / ".bench"
RESULTS_DIR = BENCH_DIR / "results"
MODELS_DIR = BENCH_DIR / "models"
OFFLOAD_SCRATCH = BENCH_DIR / "offload"  # KV pools, chunk files of the offload benchmarks
BENCH_DOC = REPO_ROOT / "docs" / "benchmarks.md"
IMG_DIR = REPO_ROOT / "docs" / "img"
