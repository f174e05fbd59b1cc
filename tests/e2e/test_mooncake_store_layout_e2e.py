"""MooncakeStoreConnector with HND KV pools on a real ``mooncake_master``: an HND engine
stores, a second HND engine hits every whole chunk, token-identical to an engine without a
connector. An NHD engine on the same master never reads the HND values: its namespace (part
of every key, and digested into every value's header) names the layout, so the HND chunks
are misses, and an HND value planted under the NHD engine's own key is refused as corrupt
(recomputed, not loaded); its answers are token-identical too. The two engines stored the same
KV in their own memory orders, and the HND values are intact afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvferry import LLM
from kvferry.core.block_hash import hash_token_blocks
from kvferry.kv_layout import KVCacheLayout
from kvferry.kv_transfer.connectors.mooncake_store.layout import StoreLayout
from kvferry.kv_transfer.stores.chunk_codec import HEADER_BYTES
from kvferry.kv_transfer.stores.chunk_key import key_digest
from kvferry.kv_transfer.stores.master import MooncakeMaster
from kvferry.kv_transfer.stores.mooncake_client import MooncakeStoreClient
from kvferry.kv_transfer.stores.mooncake_config import load_mooncake_config
from tests.helpers.mooncake_store import drain, engine_args, generate, prompts, store_kv

pytest.importorskip("mooncake.store", reason="needs Mooncake's store client (extra 'mooncake')")

# A short prompt and a long one. Whole chunks of 32 tokens (blocks_per_chunk 2 x block size
# 16) are stored (64 -> 2, 450 -> 14); a hit never includes the last token (64 -> 1).
PROMPTS = [prompts(1, 64, seed=21)[0], prompts(1, 450, seed=22)[0]]
CHUNK_TOKENS = 32
STORED = sum(len(p) // CHUNK_TOKENS for p in PROMPTS)
OFFERED = sum((len(p) - 1) // CHUNK_TOKENS for p in PROMPTS)
LAYOUT_ENV = "KVFERRY_KV_CACHE_LAYOUT"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    """Greedy tokens of an NHD engine without a connector."""
    llm = LLM(**engine_args(model_dir, None))
    outs, _ = generate(llm, PROMPTS)
    llm.engine.shutdown()
    return outs


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("mc-layout-logs")
    with MooncakeMaster(segment_bytes=128 << 20, log_dir=str(log_dir)) as m:
        yield m


def _scheduler(llm: LLM) -> Any:
    return llm.engine.scheduler.connector.scheduler_half


def _engine(model_dir: Path, master: MooncakeMaster, layout: KVCacheLayout) -> LLM:
    mp = pytest.MonkeyPatch()
    mp.setenv(LAYOUT_ENV, layout.value)  # read once, when the engine starts
    try:
        llm = LLM(**engine_args(model_dir, store_kv(master)))
    finally:
        mp.undo()
    assert llm.engine.kv_cache_config.layout is layout
    return llm


def _chunk_keys(layout: StoreLayout, tokens: list[int]) -> list[str]:
    """The keys of the whole chunks of ``tokens`` (without the rank suffix)."""
    hashes = hash_token_blocks(tokens, layout.block_size)
    bpc = layout.blocks_per_chunk
    return [layout.key(hashes[i + bpc - 1]) for i in range(0, len(hashes) - bpc + 1, bpc)]


@pytest.fixture(scope="module")
def hnd_layout(model_dir, reference, master) -> StoreLayout:
    """The store layout (namespace, value codec) of a first HND engine, which stored every
    whole chunk of the prompts."""
    first = _engine(model_dir, master, KVCacheLayout.HND)
    outs, hits = generate(first, PROMPTS)
    assert outs == reference and hits == 0
    sched = _scheduler(first)
    stats = drain(first)
    layout = sched.layout
    assert stats["stored_chunks"] == STORED
    assert set(sched.stored_keys) == {k for p in PROMPTS for k in _chunk_keys(layout, p)}
    return layout


def _client(master: MooncakeMaster) -> tuple[MooncakeStoreClient, np.ndarray]:
    client = MooncakeStoreClient(load_mooncake_config(master.config(0), environ={}))
    assert client.setup() is None
    buf = np.zeros(1 << 20, dtype=np.uint8)
    assert client.register_buffer(buf.ctypes.data, buf.nbytes)
    return client, buf


def _get(client: MooncakeStoreClient, buf: np.ndarray, key: str) -> np.ndarray:
    (n,) = client.get_into([key], [buf.ctypes.data], [buf.nbytes])
    assert n > HEADER_BYTES, (key, n)
    return buf[:n].copy()


def test_second_hnd_engine_hits_token_identically(model_dir, reference, master, hnd_layout):
    second = _engine(model_dir, master, KVCacheLayout.HND)
    assert _scheduler(second).layout.namespace == hnd_layout.namespace
    outs, hits = generate(second, PROMPTS)
    stats = drain(second)
    assert outs == reference
    assert hits == OFFERED * CHUNK_TOKENS
    assert stats["get_chunks"] == OFFERED and stats.get("corrupt_chunks", 0) == 0


def test_nhd_engine_never_reads_hnd_values(model_dir, reference, master, hnd_layout):
    nhd = _engine(model_dir, master, KVCacheLayout.NHD)
    nhd_layout = _scheduler(nhd).layout
    # The namespace names a non-NHD layout (readable and in its digest).
    assert "-hnd-" in hnd_layout.namespace and "-hnd-" not in nhd_layout.namespace
    assert nhd_layout.namespace != hnd_layout.namespace
    assert nhd_layout.key(b"\x01" * 32) != hnd_layout.key(b"\x01" * 32)

    # Plant the HND value of the first prompt's chunk under the NHD engine's key for it (as
    # a store shared without the layout in the key would hold it): refused, not loaded.
    client, buf = _client(master)
    try:
        (hnd_key,) = _chunk_keys(hnd_layout, PROMPTS[0][:-1])
        (planted,) = _chunk_keys(nhd_layout, PROMPTS[0][:-1])
        value = _get(client, buf, f"{hnd_key}/r0")
        buf[: len(value)] = value
        assert client.put_from([f"{planted}/r0"], [buf.ctypes.data], [len(value)]) == [0]

        kv = nhd.engine.kv_cache_config
        outs, hits = generate(nhd, PROMPTS)
        stats = drain(nhd)
        nhd_stored = set(_scheduler(nhd).stored_keys)
        assert outs == reference
        # Only the planted chunk was offered (the HND chunks are not under NHD keys), and
        # its value failed the check: nothing was loaded from the store.
        assert hits <= CHUNK_TOKENS and stats.get("hit_tokens", 0) == CHUNK_TOKENS
        assert stats["corrupt_chunks"] == 1 and stats.get("get_chunks", 0) == 0

        # Both engines stored the second prompt's first chunk: the same KV, each in its
        # own memory order (so bytes of one read as the other would be wrong KV).
        hnd_key, nhd_key = (_chunk_keys(x, PROMPTS[1])[0] for x in (hnd_layout, nhd_layout))
        assert nhd_key in nhd_stored
        g = kv.groups[0]
        bpc = nhd_layout.blocks_per_chunk
        shape = (len(g.layer_names), 2, bpc, g.block_size, g.num_kv_heads, g.head_dim)
        as_nhd = _payload(_get(client, buf, f"{nhd_key}/r0"), shape)
        as_hnd = _payload(_get(client, buf, f"{hnd_key}/r0"), _swap(shape))
        assert g.num_kv_heads > 1 and not np.array_equal(as_hnd.ravel(), as_nhd.ravel())
        np.testing.assert_allclose(as_hnd.swapaxes(3, 4), as_nhd, rtol=1e-4, atol=1e-5)

        # The HND values are intact: each still passes the HND engines' check.
        codec = hnd_layout.codec()
        for key in (k for p in PROMPTS for k in _chunk_keys(hnd_layout, p)):
            value = _get(client, buf, f"{key}/r0")
            codec.open(memoryview(value), len(value), key_digest(f"{key}/r0"))
    finally:
        client.close()


def _swap(shape: tuple[int, ...]) -> tuple[int, ...]:
    layers, two, blocks, tokens, heads, dim = shape
    return (layers, two, blocks, heads, tokens, dim)


def _payload(value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return value[HEADER_BYTES:].view(np.float32).reshape(shape)
