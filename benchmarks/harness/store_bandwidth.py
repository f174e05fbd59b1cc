"""MooncakeStoreConnector load bandwidth vs a raw ``MooncakeDistributedStore`` get of the same
values, in one process, on one master.

The connector's worker half is built and driven directly (no model: the plans the scheduler
would send are made here), over a KV pool of the benchmark model's shape. One store job puts
the prompt's chunks into the store (the master's standalone storage client holds them, so
every get crosses the transfer engine); then, alternating:

* **connector**: a load job through the connector's whole path: ``batch_get_into`` into its
  registered staging buffer, every value's header and check verified, then copied into the
  pool's blocks; timed from the submit until ``take_recving`` reports the request (polled
  every 50 us, as an engine step would ask, without starving the load thread of the GIL).
* **raw**: one ``batch_get_into`` of the same keys (same number and size of values) into a
  buffer registered with a second, plain ``MooncakeDistributedStore`` client.

The connector's own ``get_latency_s`` samples (its ``batch_get_into`` alone) are kept too,
so the report can tell the store's time from the checks and the copy into the pool.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from benchmarks.harness.timing import alternating

POLL_S = 50e-6
ALIGN = 64  # the connector's staging slot alignment


@dataclass(frozen=True)
class KVGeometry:
    """The KV pool shape the bandwidth part moves (the benchmark model's, by default)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_size: int = 16
    blocks_per_chunk: int = 4

    @classmethod
    def of_model(cls, model_dir: Path, dtype: str, blocks_per_chunk: int) -> KVGeometry:
        cfg = json.loads((model_dir / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        return cls(
            layers=int(cfg["num_hidden_layers"]),
            kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=head_dim,
            dtype=dtype,
            blocks_per_chunk=blocks_per_chunk,
        )

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk


def _connector(master: Any, geo: KVGeometry, num_chunks: int) -> tuple[Any, Any]:
    """A worker-role MooncakeStoreConnector on ``master`` and its KV pool config: twice the
    read's blocks (the first half is stored, the second loaded into)."""
    import torch

    from kvferry.config import KVTransferConfig
    from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
    from kvferry.kv_transfer.base import KVConnectorRole
    from kvferry.kv_transfer.connectors.mooncake_store.connector import MooncakeStoreConnector

    group = KVCacheGroupSpec(
        layer_names=tuple(f"model.layers.{i}.self_attn" for i in range(geo.layers)),
        block_size=geo.block_size,
        num_kv_heads=geo.kv_heads,
        head_dim=geo.head_dim,
        dtype=getattr(torch, geo.dtype),
    )
    blocks = num_chunks * geo.blocks_per_chunk
    kvc = KVCacheConfig(num_blocks=2 * blocks, groups=(group,))
    value = kvc.bytes_per_block * geo.blocks_per_chunk + 4096  # payload + header, rounded up
    options = {
        **master.config(global_segment_size=0),
        "blocks_per_chunk": geo.blocks_per_chunk,
        # One slot per chunk in each half: the whole read is one batch, like the raw get.
        "staging_buffer_bytes": 2 * num_chunks * value,
        "load_timeout_s": 600.0,
        "max_pending_store_chunks": max(256, num_chunks),
    }
    kvt = KVTransferConfig(
        kv_connector="MooncakeStoreConnector",
        kv_role="kv_both",
        engine_id="bench-store-bandwidth",
        kv_connector_extra_config=options,
    )
    config = SimpleNamespace(
        kv_transfer_config=kvt,
        model_config=SimpleNamespace(model=None),
        cache_config=SimpleNamespace(
            enable_prefix_caching=True, prefix_caching_hash_algo="kvferry"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    # Only the fields the connector reads: an engine config without an engine.
    return MooncakeStoreConnector(cast(Any, config), KVConnectorRole.WORKER, kvc), kvc


def _pool(kvc: Any, blocks: int) -> dict[str, Any]:
    """Per layer ``(2, num_blocks, block, heads, dim)``: random in the first ``blocks``."""
    import torch

    g = kvc.groups[0]
    gen = torch.Generator().manual_seed(1234)
    out = {}
    for name in g.layer_names:
        t = torch.zeros(
            (2, kvc.num_blocks, g.block_size, g.num_kv_heads, g.head_dim), dtype=g.dtype
        )
        t[:, :blocks] = torch.randn((2, blocks, *t.shape[2:]), generator=gen).to(g.dtype)
        out[name] = t
    return out


def _wait(cond: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)
    return got


class RawGetter:
    """A plain ``MooncakeDistributedStore`` client with one registered buffer of ``n`` slots."""

    def __init__(self, master: Any, n: int, slot_bytes: int) -> None:
        import torch
        from mooncake.store import MooncakeDistributedStore

        c = master.config(global_segment_size=0)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            c["local_hostname"], c["metadata_server"], 0, c["local_buffer_size"],
            c["protocol"], c["device_name"], c["master_server_address"],
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"raw MooncakeDistributedStore setup returned {rc}")
        self.slot_bytes = slot_bytes
        self.buf = torch.zeros(n * slot_bytes, dtype=torch.uint8)
        self.ptr = int(self.buf.data_ptr())
        if self.store.register_buffer(self.ptr, self.buf.numel()) != 0:
            raise RuntimeError("raw register_buffer failed")
        self.ptrs = [self.ptr + i * slot_bytes for i in range(n)]

    def get(self, keys: list[str]) -> tuple[float, int]:
        t0 = time.perf_counter()
        codes = self.store.batch_get_into(
            keys, self.ptrs[: len(keys)], [self.slot_bytes] * len(keys)
        )
        seconds = time.perf_counter() - t0
        if any(c < 0 for c in codes):
            raise RuntimeError(
                f"raw batch_get_into failed: {sorted(set(c for c in codes if c < 0))}"
            )
        return seconds, int(sum(codes))

    def close(self) -> None:
        self.store.unregister_buffer(self.ptr)
        self.store.close()


def measure_bandwidth(master: Any, geo: KVGeometry, tokens: int, iters: int) -> dict[str, Any]:
    """Store ``tokens`` tokens' chunks through the connector, then ``iters`` alternating
    connector loads and raw gets of them (after one untimed warm-up of each)."""
    import torch

    from kvferry.kv_transfer.connectors.mooncake_store.metadata import ChunkIO, LoadJob, StoreJob

    num_chunks = tokens // geo.chunk_tokens
    if num_chunks < 1:
        raise ValueError(f"--bw-tokens {tokens} is less than one chunk ({geo.chunk_tokens} tokens)")
    bpc = geo.blocks_per_chunk
    conn, kvc = _connector(master, geo, num_chunks)
    raw: RawGetter | None = None
    try:
        caches = _pool(kvc, num_chunks * bpc)
        conn.register_kv_caches(caches)
        half = conn.worker_half
        t = half.transfers
        _wait(lambda: t.link.up, 30, "the connector's store link")
        run = hashlib.sha256(str(time.time_ns()).encode()).digest()
        keys = [conn.layout.key(hashlib.sha256(run + i.to_bytes(4, "big")).digest())
                for i in range(num_chunks)]  # fmt: skip
        src = [list(range(c * bpc, (c + 1) * bpc)) for c in range(num_chunks)]
        dst = [[num_chunks * bpc + b for b in blocks] for blocks in src]
        t.submit_store(
            StoreJob(1, "bw-store", [ChunkIO(k, b) for k, b in zip(keys, src, strict=True)])
        )
        meta = _wait(t.take_meta, 600, "the store job")
        if meta.store_failed or 1 not in meta.stored:
            raise RuntimeError(f"the connector's store failed: {meta}")
        t.take_stats()
        rank_keys = [conn.layout.rank_key(k, 0) for k in keys]
        raw = RawGetter(master, num_chunks, t.slot_bytes)

        job_ids = iter(range(2, 10**9))

        def connector_load() -> tuple[float, int, float]:
            job = LoadJob(next(job_ids), f"bw-load-{time.monotonic_ns()}",
                          [ChunkIO(k, b) for k, b in zip(keys, dst, strict=True)])  # fmt: skip
            t0 = time.perf_counter()
            t.submit_load(job)
            _wait(lambda: job.req_id in t.take_recving(), 600, "the connector's load")
            seconds = time.perf_counter() - t0
            errors = t.take_load_errors()
            stats = t.take_stats() or {}
            if errors:
                raise RuntimeError(f"the connector's load failed for {len(errors)} blocks")
            return seconds, int(stats.get("get_bytes", 0)), float(sum(stats["get_latency_s"]))

        connector_load()  # warm-up: first transfer-engine connection of this client
        names = list(caches)
        ok = all(torch.equal(caches[n][:, num_chunks * bpc :], caches[n][:, : num_chunks * bpc])
                 for n in names)  # fmt: skip
        raw.get(rank_keys)
        res: dict[str, Any] = {"connector_s": [], "connector_get_s": [], "raw_s": []}
        res.update({"chunks": num_chunks, "value_bytes": t.codec.value_bytes})
        for i in range(iters):
            for path in alternating(("connector", "raw"), i):
                if path == "connector":
                    s, nbytes, get_s = connector_load()
                    res["connector_s"].append(s)
                    res["connector_get_s"].append(get_s)
                    res["bytes"] = nbytes
                else:
                    s, raw_bytes = raw.get(rank_keys)
                    res["raw_s"].append(s)
                    res["raw_bytes"] = raw_bytes
        res["verified"] = ok
        return res
    finally:
        if raw is not None:
            raw.close()
        conn.shutdown()
