"""Helpers shared by the KV-offload benchmarks (``benchmarks/offload_*.py``).

* :func:`bench_model`: a benchmark model from ``models.py``, optionally with a longer
  ``max_position_embeddings`` (a patched copy whose weights are symlinks), so the ~140M
  ``mid`` model can take 8k-token prompts;
* :func:`make_llm` / :func:`drain`: an offline engine, and stepping it until its connector's
  transfers are done;
* :func:`offload_kv`: the KV-transfer configs the benchmarks compare;
* :func:`update_doc`: rewrite one benchmark's block of ``docs/benchmarks.md`` in place.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import BENCH_DIR, REPO_ROOT
from benchmarks.models import MODELS_DIR, get_model

DOC = REPO_ROOT / "docs" / "benchmarks.md"
IMG_DIR = REPO_ROOT / "docs" / "img"
RESULTS = BENCH_DIR / "results"
SCRATCH = BENCH_DIR / "offload"


def bench_model(name: str, min_positions: int = 0) -> Path:
    """Path of benchmark model ``name`` able to take ``min_positions`` positions."""
    base = get_model(name)
    cfg = json.loads((base / "config.json").read_text())
    if cfg.get("max_position_embeddings", 0) >= min_positions:
        return base
    out = MODELS_DIR / f"{name}-pos{min_positions}"
    cfg["max_position_embeddings"] = min_positions
    if not (out / "config.json").exists() or json.loads((out / "config.json").read_text()) != cfg:
        out.mkdir(parents=True, exist_ok=True)
        for f in base.iterdir():
            link = out / f.name
            if f.name != "config.json" and not link.exists():
                link.symlink_to(f.resolve())
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]


def make_llm(model: Path, dtype: str, kv: dict[str, Any] | None = None, **kw: Any) -> Any:
    from kvferry import LLM

    args: dict[str, Any] = {"dtype": dtype}
    args.update(kw)
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model), **args)


def drain(llm: Any, timeout_s: float = 600.0) -> None:
    """Step an engine with no requests until its connector's transfers are done."""
    engine = llm.engine
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not settle")
        engine.step()


def offload_kv(kind: str, folder: Path | None = None, **extra: Any) -> dict[str, Any] | None:
    """``off`` | ``simple`` (SimpleCPUOffloadConnector, eager) | ``offload`` (host tier)
    | ``disk`` (OffloadingConnector with a disk tier in ``folder``)."""
    if kind == "off":
        return None
    if kind == "simple":
        name, options = "SimpleCPUOffloadConnector", {"cpu_bytes_to_use": 4 << 30}
    elif kind == "offload":
        name, options = "OffloadingConnector", {"cpu_bytes_to_use": 4 << 30}
    elif kind == "disk":
        assert folder is not None
        name = "OffloadingConnector"
        options = {"cpu_bytes_to_use": 4 << 30, "disk_path": str(folder)}
    else:
        raise ValueError(f"unknown offload config {kind!r}")
    options.update(extra)
    return {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": options}


def update_doc(block: str, markdown: str) -> Path:
    """Replace the text between ``<!-- block:begin -->`` and ``<!-- block:end -->`` in
    docs/benchmarks.md (appending the block if it is not there yet)."""
    begin, end = f"<!-- {block}:begin -->", f"<!-- {block}:end -->"
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    new = f"{begin}\n{markdown.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + new + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    return DOC


def line_plot(
    path: Path,
    xs: list[int],
    series: dict[str, list[float | None]],
    title: str,
    xlabel: str,
    ylabel: str,
    log_y: bool = True,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in series.items():
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
