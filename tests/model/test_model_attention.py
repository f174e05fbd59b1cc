"""Paged attention and its metadata against a plain reference, and the KV connector hooks."""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import pytest
import torch

from kvferry.model import attention as attention_module
from kvferry.model.attention import Attention
from kvferry.model.attention_metadata import AttentionMetadata, build_attention_metadata
from kvferry.model.attention_workspace import AttentionWorkspace
from kvferry.model.forward_context import ForwardContext, set_forward_context
from kvferry.native.paged_decode import PagedDecodeKernel, load_paged_decode
from kvferry.worker.cpu_backend import DECODE_GATHER_BYTES
from kvferry.worker.cpu_features import cpu_features

CPU = torch.device("cpu")


@pytest.fixture(params=["torch", "native"])
def decode_kernel(request: pytest.FixtureRequest) -> PagedDecodeKernel | None:
    """Each decode test runs on the portable gather + SDPA path and on the C kernel."""
    if request.param == "torch":
        return None
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler: the decode kernel cannot be built here")
    kernel = load_paged_decode(cpu_features().isa)
    assert kernel is not None, "a C compiler is installed, yet the decode kernel did not build"
    return kernel


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """Causal attention in fp64 for one request: ``q`` [n, H, d] at positions ctx..ctx+n-1,
    ``k``/``v`` [ctx + n, KVH, d] holding the whole sequence."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5
    allowed = torch.arange(k.shape[0])[None, :] <= (torch.arange(q.shape[0]) + ctx)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Scenario:
    """Requests with random histories already in a paged cache, plus one step to run."""

    def __init__(
        self,
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        steps: list[tuple[int, int]],  # per request: (context already cached, new tokens)
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        group_decodes: bool = True,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        total_blocks = sum(-(-(c + n) // block_size) + 1 for c, n in steps) + 3
        free = list(range(total_blocks))
        rng.shuffle(free)
        self.cache = torch.zeros(2, total_blocks, block_size, kv_heads, head_dim, dtype=dtype)
        self.k_all, self.v_all, self.tables = [], [], []
        flat = self.cache.flatten(1, 2)
        for ctx, n in steps:
            # One spare block beyond what the sequence needs, as the scheduler may allocate.
            table = [free.pop() for _ in range(-(-(ctx + n) // block_size) + 1)]
            k = torch.randn(ctx + n, kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(ctx + n, kv_heads, head_dim, generator=gen).to(dtype)
            for p in range(ctx):
                slot = table[p // block_size] * block_size + p % block_size
                flat[0, slot], flat[1, slot] = k[p], v[p]
            self.k_all.append(k)
            self.v_all.append(v)
            self.tables.append(table)
        self.steps = steps
        self.q = [torch.randn(n, heads, head_dim, generator=gen).to(dtype) for _, n in steps]
        self.meta = build_attention_metadata(
            [n for _, n in steps],
            [c + n for c, n in steps],
            self.tables,
            block_size,
            CPU,
            group_decodes=group_decodes,
        )

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.cat(self.q).flatten(1)
        k = torch.cat([k[c:] for k, (c, _) in zip(self.k_all, self.steps, strict=True)])
        v = torch.cat([v[c:] for v, (c, _) in zip(self.v_all, self.steps, strict=True)])
        return q, k.flatten(1), v.flatten(1)

    def expected(self) -> torch.Tensor:
        outs = [
            reference(q, k, v, c)
            for q, k, v, (c, _) in zip(self.q, self.k_all, self.v_all, self.steps, strict=True)
        ]
        return torch.cat(outs).flatten(1)

    def run(
        self,
        connector: Any = None,
        name: str = "layer0",
        kernel: PagedDecodeKernel | None = None,
        workspace: AttentionWorkspace | None = None,
        out_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Runs one layer with ``workspace``; by default, one set up as a CPU engine's is."""
        attn = Attention(self.heads, self.kv_heads, self.head_dim, layer_name=name)
        if workspace is None:
            workspace = AttentionWorkspace(
                decode_kernel=kernel, decode_gather_bytes=DECODE_GATHER_BYTES
            )
        ctx = ForwardContext(
            {name: self.meta}, {name: self.cache}, kv_connector=connector, attn_workspace=workspace
        )
        rows = None if out_rows is None else torch.tensor(out_rows, dtype=torch.long)
        with set_forward_context(ctx):
            return attn(*self.inputs(), rows)


MIXED = [(0, 1), (37, 1), (0, 21), (19, 13), (5, 1), (64, 1), (3, 2), (0, 6), (130, 1)]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(8, 2, 16, 16), (4, 4, 8, 4), (6, 1, 32, 8), (4, 2, 64, 32)],
)
def test_mixed_batch_matches_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int, decode_kernel: Any
) -> None:
    s = Scenario(heads, kv_heads, head_dim, block_size, MIXED, seed=heads + block_size)
    out = s.run(kernel=decode_kernel)
    torch.testing.assert_close(out.double(), s.expected(), atol=1e-5, rtol=1e-5)
    # Every token of every request is now in the cache where its block table says.
    flat = s.cache.flatten(1, 2)
    for k, v, table in zip(s.k_all, s.v_all, s.tables, strict=True):
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(len(k))]
        )
        assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)


@pytest.mark.parametrize(
    "steps",
    [
        [(0, 40)],  # one fresh prefill
        [(10, 1), (11, 1), (200, 1)],  # decodes only, two length groups
        [(16, 1), (16, 1)],  # decodes needing no mask
        [(31, 17)],  # one chunk with context
        [(0, 1)],  # a one-token prompt
    ],
)
def test_single_plan_batches(steps: list[tuple[int, int]], decode_kernel: Any) -> None:
    s = Scenario(4, 2, 16, 16, steps, seed=len(steps))
    out = s.run(kernel=decode_kernel)
    torch.testing.assert_close(out.double(), s.expected(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("long", [False, True], ids=["short", "long-context"])
def test_out_rows_attend_only_the_chunks_they_need(
    long: bool, decode_kernel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``out_rows`` only those rows come back, in that order; a chunk is attended from
    its first wanted row on and not at all without one; every row's K/V reach the cache."""
    steps = [(2400, 300), (30, 1), (0, 9)] if long else MIXED
    s = Scenario(4, 2, 16, 16, steps, seed=7)
    starts = [0]
    for _, n in steps:
        starts.append(starts[-1] + n)
    last = [stop - 1 for stop in starts[1:]]
    # Every request's last row (what a runner samples), one row inside the first prefill, and
    # a prefill left out altogether.
    prefills = [i for i, (_, n) in enumerate(steps) if n > 1]
    inside = starts[prefills[0]] + 3
    dropped = prefills[-1]
    rows = [r for r in last if r != last[dropped]][::-1] + [inside]
    attended: list[int] = []
    prefill = Attention._prefill

    def counting(self: Attention, q: torch.Tensor, k: Any, v: Any, c: Any, p: Any, *a: Any) -> Any:
        attended.append(p.token_stop - p.token_start)
        return prefill(self, q, k, v, c, p, *a)

    monkeypatch.setattr(Attention, "_prefill", counting)
    out = s.run(kernel=decode_kernel, out_rows=rows)
    torch.testing.assert_close(out.double(), s.expected()[rows], atol=1e-5, rtol=1e-5)
    first = [i for i in prefills if i != dropped]
    want = [starts[i + 1] - inside if i == prefills[0] else 1 for i in first]
    assert attended == want
    full = Scenario(4, 2, 16, 16, steps, seed=7)
    full.run(kernel=decode_kernel)
    assert torch.equal(s.cache, full.cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,steps",
    [
        (8, 2, [(2400, 300)]),  # a long chunk with context, alone in the step
        (4, 4, [(2000, 600), (30, 1), (0, 9)]),  # with a decode and a short prefill
        (8, 1, [(3000, 17), (2000, 100)]),  # two of them, one KV head for all query heads
    ],
)
def test_long_context_chunks_attend_in_two_merged_parts(
    heads: int,
    kv_heads: int,
    steps: list[tuple[int, int]],
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From SPLIT_CONTEXT_MIN_SEQ tokens a chunk with context attends to its context and to
    its own keys separately, merged by log-sum-exp; the result is the causal attention over the
    whole sequence. Shorter chunks keep the one masked SDPA."""
    assert attention_module.SPLIT_CONTEXT_MIN_SEQ <= 2700
    calls: list[int] = []
    split = Attention._context_then_own

    def counting(self: Attention, q: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        calls.append(q.shape[0])
        return split(self, q, *rest)

    monkeypatch.setattr(Attention, "_context_then_own", counting)
    s = Scenario(heads, kv_heads, 32, 16, steps, dtype=dtype, seed=heads + len(steps))
    out = s.run()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), s.expected(), atol=tol, rtol=tol)
    long = [n for c, n in steps if c > 0 and c + n >= attention_module.SPLIT_CONTEXT_MIN_SEQ]
    assert calls == long


def test_bf16_close_to_reference(decode_kernel: Any) -> None:
    s = Scenario(8, 2, 32, 16, MIXED, dtype=torch.bfloat16, seed=3)
    out = s.run(kernel=decode_kernel)
    torch.testing.assert_close(out.double(), s.expected(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_decodes_in_one_plan(dtype: torch.dtype, decode_kernel: Any) -> None:
    """An ungrouped batch of decodes of very different lengths (the kernel's layout: with
    enough requests it takes whole requests per work item), interleaved with prefills."""
    rng = random.Random(7)
    steps = [(rng.randrange(0, 300), 1) for _ in range(24)] + [(0, 9), (40, 5)]
    rng.shuffle(steps)
    s = Scenario(8, 2, 64, 16, steps, dtype=dtype, seed=7, group_decodes=False)
    (plan,) = s.meta.decodes
    assert len(plan.req_indices) == 24
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    out = s.run(kernel=decode_kernel)
    torch.testing.assert_close(out.double(), s.expected(), atol=tol, rtol=tol)


def test_without_metadata_runs_plain_causal_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, h, 8, generator=gen) for h in (4, 2, 2))
    attn = Attention(4, 2, 8, layer_name="x")
    with set_forward_context(ForwardContext(None, {})):
        out = attn(q.flatten(1), k.flatten(1), v.flatten(1))
    torch.testing.assert_close(out.double(), reference(q, k, v, 0).flatten(1), atol=1e-5, rtol=1e-5)


class RecordingConnector:
    def __init__(self, bound: bool, cache: torch.Tensor) -> None:
        self.bound = bound
        self.cache = cache
        self.events: list[tuple[str, str]] = []
        self.snapshots: dict[str, torch.Tensor] = {}
        self.saved_meta: AttentionMetadata | None = None

    def has_connector_metadata(self) -> bool:
        return self.bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.events.append(("wait", layer_name))
        self.snapshots["wait"] = self.cache.clone()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        self.events.append(("save", layer_name))
        assert kv_layer is self.cache
        self.snapshots["save"] = kv_layer.clone()
        self.saved_meta = attn_metadata


def test_connector_hooks_wrap_the_cache_write() -> None:
    s = Scenario(4, 2, 8, 4, [(6, 1), (0, 5)], seed=1)
    before = s.cache.clone()
    conn = RecordingConnector(True, s.cache)
    s.run(connector=conn, name="model.layers.0.self_attn.attn")
    name = "model.layers.0.self_attn.attn"
    assert conn.events == [("wait", name), ("save", name)]
    assert torch.equal(conn.snapshots["wait"], before)  # waited before touching the cache
    assert not torch.equal(conn.snapshots["save"], before)  # saved after the new K/V landed
    assert torch.equal(conn.snapshots["save"], s.cache)
    assert conn.saved_meta is s.meta


def test_connector_without_metadata_is_not_called() -> None:
    s = Scenario(4, 2, 8, 4, [(6, 1)], seed=2)
    conn = RecordingConnector(False, s.cache)
    s.run(connector=conn)
    assert conn.events == []


def test_metadata_fields() -> None:
    meta = build_attention_metadata([3, 1, 2], [3, 9, 6], [[7], [4, 2, 9], [5, 1]], 4, CPU)
    assert meta.num_reqs == 3 and meta.num_actual_tokens == 6
    assert meta.query_start_loc_list == [0, 3, 4, 6]
    assert meta.max_query_len == 3 and meta.max_seq_len == 9
    # request 0: positions 0..2 in block 7; request 1: position 8 -> block 9 offset 0;
    # request 2: positions 4, 5 -> block 1 offsets 0, 1.
    assert meta.slot_mapping.tolist() == [28, 29, 30, 36, 4, 5]
    assert meta.block_table.tolist() == [[7, 0, 0], [4, 2, 9], [5, 1, 0]]
    assert [d.req_indices for d in meta.decodes] == [[1]]
    assert [(p.req_index, p.context_len) for p in meta.prefills] == [(0, 0), (2, 4)]


def test_metadata_rejects_inconsistent_input() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([2], [9], [[0, 1]], 4, CPU)
    with pytest.raises(ValueError, match="query_len"):
        build_attention_metadata([5], [4], [[0]], 4, CPU)
    with pytest.raises(ValueError, match="one entry per request"):
        build_attention_metadata([1, 1], [1], [[0]], 4, CPU)


def test_decode_grouping_by_length() -> None:
    lens = [20, 400, 22, 410, 30, 1000]
    tables = [list(range(-(-n // 16))) for n in lens]
    meta = build_attention_metadata([1] * 6, lens, tables, 16, CPU)
    groups = [d.req_indices for d in meta.decodes]
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert [0, 2, 4] in groups and [1, 3] in groups and [5] in groups
    # Equal lengths form one group covering the batch in order, with no mask needed.
    meta = build_attention_metadata([1] * 4, [32] * 4, [[0, 1]] * 4, 16, CPU)
    (only,) = meta.decodes
    assert only.token_range == (0, 4) and only.mask is None


def test_decode_in_cache_sized_chunks() -> None:
    """With a gather budget a large decode group is gathered a few requests at a time."""
    steps = [(c, 1) for c in (12, 13, 9, 15, 14, 10, 11)] + [(0, 7)]
    s = Scenario(4, 2, 8, 4, steps, seed=4)
    assert len(s.meta.decodes) == 1  # one group, split into chunks at run time
    out = s.run(workspace=AttentionWorkspace(decode_gather_bytes=3000))
    torch.testing.assert_close(out.double(), s.expected(), atol=1e-5, rtol=1e-5)


def test_inference_mode_then_plain_forward() -> None:
    """Buffers first made under inference_mode must stay writable in later plain forwards."""
    workspace = AttentionWorkspace(decode_gather_bytes=DECODE_GATHER_BYTES)
    with torch.inference_mode():
        Scenario(4, 2, 8, 4, [(9, 1), (3, 1)], seed=5).run(workspace=workspace)
    s = Scenario(4, 2, 8, 4, [(9, 1), (3, 1)], seed=6)
    with torch.no_grad():
        out = s.run(workspace=workspace)
        torch.testing.assert_close(out.double(), s.expected(), atol=1e-5, rtol=1e-5)
