"""Helpers for the LMCacheMPConnector tests: a real LMCache server, engines with the
connector (in this process or in their own), prompts, and the leak check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, SamplingParams

lmcache_server_mod = pytest.importorskip("kvferry.kv_transfer.connectors.lmcache_mp.server")
pytest.importorskip("lmcache")

ROOT = Path(__file__).resolve().parents[4]
CHUNK = 32  # tokens per LMCache chunk: 2 blocks of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE_KW: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_batched_tokens": 512,
    "num_kv_blocks": 64,
}
# Short timeouts so that a dead server is noticed within a second or two.
FAST = {"lmcache.mp.mq_timeout": 3.0, "lmcache.mp.heartbeat_interval": 0.5}


@pytest.fixture(name="lmcache")
def lmcache_fixture(tmp_path: Path) -> Iterator[Any]:
    """A real LMCache MP server on 127.0.0.1, killed after the test (its state is in memory
    only; a graceful stop takes seconds)."""
    server = lmcache_server_mod.start_lmcache_server(
        chunk_size=CHUNK, l1_size_gb=0.25, log_path=tmp_path / "lmcache.log"
    )
    try:
        yield server
    finally:
        server.kill()


def kv_config(server: Any, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": server.extra_config(**{**FAST, **extra}),
    }


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 2000, (n,), generator=g).tolist() for n in lengths]


def make_llm(model: Path, kv: dict[str, Any] | None = None, **kw: Any) -> LLM:
    return LLM(model=str(model), kv_transfer_config=kv, **{**ENGINE_KW, **kw})


def generate(llm: LLM, batch: list[list[int]]) -> list[dict[str, Any]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    return [
        {
            "tokens": list(o.outputs[0].token_ids),
            "cached": o.num_cached_tokens,
            "external": o.metrics.num_external_cached_tokens,
        }
        for o in outs
    ]


def drain_and_check(llm: LLM) -> dict[str, Any]:
    """Run the engine idle, check nothing leaked, shut it down; the connector's totals."""
    engine = llm.engine
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests():
        engine.step()
        assert time.monotonic() < deadline, "the engine did not drain"
    sched = engine.scheduler
    sched.check_integrity()
    assert sched.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_config.num_blocks
    assert not sched.requests
    if sched.connector is not None:
        assert sched.connector.num_tracked_requests() == 0  # type: ignore[attr-defined]
    stats = dict(engine.kv_connector_totals.as_dict())
    engine.shutdown()
    return stats


def run_engine_process(
    model: Path,
    kv: dict[str, Any] | None,
    batch: list[list[int]],
    tmp: Path,
    name: str,
    tp: int = 1,
) -> dict[str, Any]:
    """Run one engine (``tp`` tensor-parallel workers) in its own Python process (see
    :mod:`.engine_proc`); its results."""
    job = tmp / f"{name}.json"
    job.write_text(json.dumps({"model": str(model), "kv": kv, "prompts": batch, "tp": tp}))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.kv_transfer.connectors.lmcache_mp.engine_proc", str(job)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=180,
        )
    text = (tmp / f"{name}.log").read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    return dict(json.loads((tmp / f"{name}.out.json").read_text()))
