"""The hardened disk tier end to end: with FIFOs and forged keyed chunks in the folder,
greedy outputs stay token-identical to a run without a connector.

The ambient deployment secret is unset for every test (``no_ambient_secret``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.kv_transfer.offload.disk import HEADER, KEYED_HEADER
from tests.helpers.disk_tier import OFFLOAD, _rewrite_with_crc, _secret_file

pytestmark = pytest.mark.usefixtures("no_ambient_secret")


def _forge(folder: Path, keyed: bool) -> int:
    """Replace every chunk's payload with other KV (float32 noise), fixing the checksum where
    that can be done without the key. Returns the files changed."""
    files = sorted(folder.glob("*.kvc"))
    size = KEYED_HEADER.size if keyed else HEADER.size
    g = torch.Generator().manual_seed(0)
    for f in files:
        raw = f.read_bytes()
        noise = (torch.randn((len(raw) - size) // 4, generator=g) * 4).numpy().tobytes()
        if keyed:
            f.write_bytes(raw[:size] + noise)
        else:
            _rewrite_with_crc(f, noise)
    return len(files)


# -- end to end: token-identical outputs ----------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    system = torch.randint(5, 2000, (96,), generator=g).tolist()
    return [system + torch.randint(5, 2000, (12,), generator=g).tolist() for _ in range(3)]


def _llm(model_dir: Path, kv: dict[str, Any] | None) -> LLM:
    args: dict[str, Any] = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 10}
    if kv is not None:
        args["kv_transfer_config"] = kv
    return LLM(model=str(model_dir), **args)


def _generate(llm: LLM) -> tuple[list[list[int]], dict[str, Any]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    engine = llm.engine
    while engine.has_unfinished_requests():
        engine.step()
    sched = engine.scheduler
    assert sched.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_config.num_blocks
    if sched.connector is not None:
        sched.connector.check_offload_integrity(idle=True)  # type: ignore[attr-defined]
    stats = dict(engine.kv_connector_totals.as_dict())
    engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], stats


@pytest.mark.slow
def test_end_to_end_fifo_and_keyed_rewrites_keep_outputs_identical(
    tiny_model_factory, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama")
    reference, _ = _generate(_llm(model_dir, None))
    kv = {
        "kv_connector": OFFLOAD,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "num_cpu_chunks": 2,
            "disk_path": str(tmp_path / "d"),
            "secret_file": _secret_file(tmp_path),
        },
    }
    tokens, _ = _generate(_llm(model_dir, kv))
    assert tokens == reference
    folder = next((tmp_path / "d").rglob("rank0"))
    files = sorted(folder.glob("*.kvc"))
    assert _forge(folder, keyed=True) >= 4
    os.unlink(files[-1])
    os.mkfifo(files[-1])
    t0 = time.monotonic()
    tokens, stats = _generate(_llm(model_dir, kv))
    assert time.monotonic() - t0 < 20
    assert tokens == reference  # zero wrong outputs
    assert stats["corrupt_chunks"] >= 4
