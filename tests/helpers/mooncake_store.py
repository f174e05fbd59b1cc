"""Fixtures and helpers for MooncakeStoreConnector tests: a real ``mooncake_master`` (with a
standalone storage client, so stored KV outlives any engine), engine builders, and a child
process that runs prompts on an engine of its own (a second engine on the same master)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvferry.kv_transfer.stores.master import MooncakeMaster

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
CONNECTOR = "MooncakeStoreConnector"


def master_fixture(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master with a 128 MiB storage client (wrap with ``pytest.fixture``)."""
    with MooncakeMaster(segment_bytes=128 << 20, log_dir=str(tmp_path / "mc-logs")) as m:
        yield m


def store_kv(master: MooncakeMaster, **extra: Any) -> dict[str, Any]:
    """A kv_transfer_config for this master (the client settings given as extra_config)."""
    options: dict[str, Any] = dict(master.config())
    options.update({"blocks_per_chunk": 2, "staging_buffer_bytes": 8 << 20,
                    "lookup_timeout_s": 5.0, "reconnect_interval_s": 0.2})  # fmt: skip
    options.update(extra)
    return {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": options,
    }


def engine_args(model_dir: Path, kv: dict[str, Any] | None) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_batched_tokens": 512,
        "num_kv_blocks": 64,
    }
    if kv is not None:
        args["kv_transfer_config"] = kv
    return args


def prompts(n: int = 3, length: int = 150, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 2000, (length,), generator=g).tolist() for _ in range(n)]


def generate(llm: Any, token_prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy outputs and the external hit tokens of all prompts (one at a time, so each
    prompt's store lands before the next)."""
    from kvferry import SamplingParams

    outs, hits = [], 0
    for p in token_prompts:
        (o,) = llm.generate([{"prompt_token_ids": p}], SamplingParams(**GREEDY), use_tqdm=False)
        outs.append(list(o.outputs[0].token_ids))
        hits += o.metrics.num_external_cached_tokens
    return outs, hits


def drain(llm: Any) -> dict[str, Any]:
    """Step until the connector is idle, check nothing leaked, shut down; the stats totals."""
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    sched = engine.scheduler
    for _ in range(2000):
        if not sched.connector.has_pending_work():
            break
        engine.step()
    sched.check_integrity()
    assert sched.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_config.num_blocks
    assert not sched.requests
    sched.connector.check_store_integrity(idle=True)
    stats = dict(engine.kv_connector_totals.as_dict())
    engine.shutdown()
    return stats


def run_child(
    model_dir: Path, kv: dict[str, Any], token_prompts: list[list[int]]
) -> dict[str, Any]:
    """Run the prompts on an engine in a new process; its outputs, hits and stats."""
    spec = json.dumps({"args": engine_args(model_dir, kv), "prompts": token_prompts})
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.mooncake_store"],
        input=spec, capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"child engine failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child_main() -> None:
    from kvferry import LLM

    spec = json.loads(sys.stdin.read())
    llm = LLM(**spec["args"])
    outs, hits = generate(llm, spec["prompts"])
    stats = drain(llm)
    print(json.dumps({"outputs": outs, "hits": hits, "stats": stats}))


if __name__ == "__main__":
    _child_main()
