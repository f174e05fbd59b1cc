"""A truthful release (issue 11): ``AsyncLLM.release_kv_transfer`` returns once the blocks
are back, and within the connector's bound when it names a dead peer."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvferry import EngineArgs
from kvferry.engine.async_llm import AsyncLLM
from tests.helpers.ports import _dead_port

pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")


# -- a truthful release ----------------------------------------------------------------------


def test_release_returns_once_the_blocks_are_back(tiny_model_factory):
    """POST /v1/kv/release on the prefill instance itself: when release_kv_transfer returns,
    the held blocks are free (it used to return before the connector even saw the params)."""
    kvt = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"side_channel_port": 0, "handshake_timeout": 2.0},
    }
    args = EngineArgs(
        model=str(tiny_model_factory("llama")),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=64,
        kv_transfer_config=kvt,
    )
    llm = AsyncLLM(args.create_engine_config())

    def free(engine: Any) -> tuple[int, int]:
        return (
            engine.scheduler.kv_cache_manager.get_num_free_blocks(),
            engine.kv_cache_config.num_blocks,
        )

    async def main() -> None:
        from kvferry import SamplingParams

        extra = {"kv_transfer_params": {"do_remote_decode": True}}
        sp = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)
        final = None
        async for out in llm.generate({"prompt_token_ids": list(range(3, 60))}, sp):
            final = out
        assert final is not None and final.kv_transfer_params is not None
        held, total = await llm.call(free)
        assert held < total  # the prefill holds its prompt's blocks for a reader
        await llm.release_kv_transfer(final.kv_transfer_params)
        assert await llm.call(free) == (total, total)
        # A release naming a dead peer returns within the connector's bound.
        dead = {**final.kv_transfer_params, "remote_port": _dead_port(), "remote_engine_id": "x"}
        t0 = time.monotonic()
        await llm.release_kv_transfer(dead)
        assert time.monotonic() - t0 < 2 * 2.0 + 2

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
