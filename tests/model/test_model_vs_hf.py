"""kvferry's models against Hugging Face transformers on the same tiny checkpoints, and paged
attention schedules (chunked prefill, mixed batches) against a single full prefill."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvferry.config import ModelConfig
from kvferry.model.attention_metadata import build_attention_metadata
from kvferry.model.attention_workspace import AttentionWorkspace
from kvferry.model.forward_context import ForwardContext, layer_metadata, set_forward_context
from kvferry.model.hidden_states_capture import HiddenStatesCapture
from kvferry.model.llama import CausalLM
from kvferry.model.loader import load_model
from kvferry.worker.cpu_backend import CPUBackend

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16
CPU = torch.device("cpu")

CASES: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "llama-tied-llama3rope": {
        "arch": "llama",
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    },
    "llama-linear-rope": {"arch": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}},
    "qwen2": {"arch": "qwen2"},
    "qwen3-tied": {"arch": "qwen3", "head_dim": 48, "tie_word_embeddings": True},
}


@pytest.fixture(scope="module")
def checkpoint(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """A copy of a tiny checkpoint whose norm weights are random, so that swapping two norms
    (or q_norm/k_norm) in the loader changes the logits."""
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            src = tiny_model_factory(**CASES[case])
            dst = tmp_path_factory.mktemp(f"perturbed-{case}")
            shutil.copytree(src, dst, dirs_exist_ok=True)
            tensors = load_file(str(dst / "model.safetensors"))
            gen = torch.Generator().manual_seed(7)
            for name, t in tensors.items():
                if name.endswith("norm.weight"):
                    tensors[name] = 1.0 + 0.2 * torch.randn(t.shape, generator=gen)
            save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
            made[case] = dst
        return made[case]

    return get


def hf_logits(folder: Path, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


class PagedRunner:
    """Drives a kvferry model the way the engine does: per-request block lists drawn from a
    shuffled pool (so blocks are never contiguous), one forward per step, with the attention
    workspace of the device's backend (``native``: as :func:`load`)."""

    def __init__(
        self, model: CausalLM, num_blocks: int = 64, seed: int = 0, native: bool = True
    ) -> None:
        cfg = model.config
        self.model = model
        weight = model.model.embed_tokens.weight
        self.device = weight.device
        self.workspace = AttentionWorkspace()
        if self.device.type == "cpu":
            self.workspace = CPUBackend(model.dtype, native).attention_workspace()
        shape = (2, num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = {
            name: torch.zeros(shape, dtype=weight.dtype, device=self.device)
            for name in model.layer_names
        }
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def add(self, req: str, ids: list[int]) -> None:
        self.tokens[req], self.blocks[req], self.computed[req] = list(ids), [], 0

    def step(self, schedule: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        """Run ``num_tokens`` more tokens of each listed request; returns per-request logits."""
        logits = self.model.compute_logits(self.hidden(schedule)).cpu()
        out, offset = {}, 0
        for req, n in schedule:
            out[req] = logits[offset : offset + n]
            offset += n
        return out

    def hidden(
        self,
        schedule: list[tuple[str, int]],
        output_rows: list[int] | None = None,
        capture: HiddenStatesCapture | None = None,
    ) -> torch.Tensor:
        """The step's final hidden states (of ``output_rows`` alone, if given)."""
        ids: list[int] = []
        pos: list[int] = []
        qlens, slens, tables = [], [], []
        for req, n in schedule:
            start = self.computed[req]
            end = start + n
            while len(self.blocks[req]) * BLOCK_SIZE < end:
                self.blocks[req].append(self.free.pop())
            ids += self.tokens[req][start:end]
            pos += range(start, end)
            qlens.append(n)
            slens.append(end)
            tables.append(self.blocks[req])
            self.computed[req] = end
        meta = build_attention_metadata(qlens, slens, tables, BLOCK_SIZE, self.device)
        ctx = ForwardContext(
            layer_metadata(meta, self.kv_caches),
            self.kv_caches,
            attn_workspace=self.workspace,
            hidden_states_capture=capture,
        )
        rows = None
        if output_rows is not None:
            rows = torch.tensor(output_rows, dtype=torch.long, device=self.device)
        with torch.inference_mode(), set_forward_context(ctx):
            hidden: torch.Tensor = self.model(
                torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), rows
            )
        return hidden


def load(
    folder: Path, dtype: str = "float32", device: torch.device = CPU, native: bool = True
) -> CausalLM:
    """The model as the engine's runner tunes it; ``native=False``: torch ops in place of the
    C kernels (the weight layouts stay)."""
    model = load_model(ModelConfig(str(folder), dtype=dtype), device)
    if device.type == "cpu":
        CPUBackend(model.dtype, native).prepare_model(model)
    return model


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(5, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "torch-ops"])
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_matches_hf(case: str, native: bool, checkpoint: Callable[[str], Path]) -> None:
    folder = checkpoint(case)
    ids = prompt(45)
    model = load(folder, native=native)
    ours = PagedRunner(model, native=native)
    ours.add("a", ids)
    got = ours.step([("a", len(ids))])["a"]
    ref = hf_logits(folder, ids, torch.float32)
    assert (got - ref).abs().max().item() <= 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3-tied"])
def test_chunked_prefill_and_decode_match_full_prefill(
    case: str, checkpoint: Callable[[str], Path]
) -> None:
    model = load(checkpoint(case))
    ids = prompt(53, seed=1)
    full = PagedRunner(model, seed=1)
    full.add("a", ids)
    ref = full.step([("a", 53)])["a"]

    chunked = PagedRunner(model, seed=2)
    chunked.add("a", ids)
    # Chunk boundaries inside and at the edge of 16-token blocks, then two decode steps.
    parts = [chunked.step([("a", n)])["a"] for n in (20, 12, 19, 1, 1)]
    torch.testing.assert_close(torch.cat(parts), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["llama", "qwen3-tied"])
def test_mixed_batch_matches_full_prefill(case: str, checkpoint: Callable[[str], Path]) -> None:
    model = load(checkpoint(case))
    seqs = {"p": prompt(30, 3), "d1": prompt(41, 4), "d2": prompt(17, 5), "c": prompt(40, 6)}
    refs = {}
    for req, ids in seqs.items():
        solo = PagedRunner(model)
        solo.add(req, ids)
        refs[req] = solo.step([(req, len(ids))])[req]

    runner = PagedRunner(model, seed=3)
    for req, ids in seqs.items():
        runner.add(req, ids)
    # Bring the decoders to one token short of their prompts and start a chunked prefill.
    runner.step([("d1", 40), ("d2", 16), ("c", 25)])
    # One step mixing a decode, a fresh prefill, a chunked prefill with context, a decode.
    got = runner.step([("d1", 1), ("p", 30), ("c", 15), ("d2", 1)])
    torch.testing.assert_close(got["p"], refs["p"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["c"], refs["c"][25:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["d1"], refs["d1"][40:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["d2"], refs["d2"][16:], atol=1e-4, rtol=1e-4)


MIXED = {"p": (30, 3), "d1": (41, 4), "d2": (17, 5), "c": (40, 6)}
# One step mixing a decode, a fresh prefill, a chunked prefill with context, a decode.
MIXED_STEP = [("d1", 1), ("p", 30), ("c", 15), ("d2", 1)]


def mixed_runner(model: CausalLM, native: bool = True) -> PagedRunner:
    """A runner one step before MIXED_STEP."""
    runner = PagedRunner(model, seed=3, native=native)
    for req, (n, seed) in MIXED.items():
        runner.add(req, prompt(n, seed))
    runner.step([("d1", 40), ("d2", 16), ("c", 25)])
    return runner


# Flat rows of MIXED_STEP: d1 0, p 1..30, c 31..45, d2 46.
PICKS = {
    "any-order": [0, 30, 46, 1],  # d1, p's last token, d2, p's first
    "sampled": [0, 30, 45, 46],  # what the runner asks for: each request's last row
    "mid-chunk": [40, 20, 30],  # chunks attended from a row inside them on
}


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "torch-ops"])
@pytest.mark.parametrize("pick", list(PICKS))
@pytest.mark.parametrize("case", ["llama", "qwen3-tied"])
def test_sampled_rows_alone_match_every_row(
    case: str, pick: str, native: bool, checkpoint: Callable[[str], Path]
) -> None:
    """With ``output_rows`` the last layer's attention (from each chunk's first such row on),
    output projection and MLP run for those rows only; their hidden states, and every row's
    K/V in the cache, are as in a full forward."""
    model = load(checkpoint(case), native=native)
    full, picked, none = (mixed_runner(model, native) for _ in range(3))
    want = full.hidden(MIXED_STEP)
    rows = PICKS[pick]
    got = picked.hidden(MIXED_STEP, rows)
    torch.testing.assert_close(got, want[rows], atol=1e-5, rtol=1e-5)
    # A step that samples nothing (e.g. only a chunk of a longer prompt).
    assert none.hidden(MIXED_STEP, []).shape == (0, want.shape[1])
    for name in model.layer_names:
        assert torch.equal(picked.kv_caches[name], full.kv_caches[name]), name
        assert torch.equal(none.kv_caches[name], full.kv_caches[name]), name


def test_padded_rows_leave_the_tokens_rows_alone(checkpoint: Callable[[str], Path]) -> None:
    """A backend may have a step run on zero rows appended up to a multiple of
    ``row_multiple`` (for its GEMMs' sake): the tokens' hidden states, their K/V and what a
    capture records are as without them."""
    model = load(checkpoint("qwen3-tied"))
    layers = model.config.num_hidden_layers
    plain, plain_capture = mixed_runner(model), HiddenStatesCapture([0, 1, layers])
    want = plain.hidden(MIXED_STEP, capture=plain_capture)
    backend = model.model.row_multiple, model.model.pad_min_rows
    model.model.row_multiple, model.model.pad_min_rows = 8, 0  # 47 rows -> 48
    rows_seen: list[int] = []
    hook = model.model.layers[0].self_attn.qkv_proj.register_forward_pre_hook(
        lambda _module, args: rows_seen.append(args[0].shape[0])
    )
    try:
        padded, capture = mixed_runner(model), HiddenStatesCapture([0, 1, layers])
        got = padded.hidden(MIXED_STEP, capture=capture)
        picked = mixed_runner(model).hidden(MIXED_STEP, [46, 0])
    finally:
        model.model.row_multiple, model.model.pad_min_rows = backend
        hook.remove()
    assert rows_seen == [88, 48] * 2, rows_seen  # each runner: its 81-row setup step, then 47
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(picked, want[[46, 0]], atol=1e-5, rtol=1e-5)
    for i in (0, 1, layers):
        assert capture.states[i].shape == plain_capture.states[i].shape == want.shape
        torch.testing.assert_close(capture.states[i], plain_capture.states[i])
    for name in model.layer_names:
        torch.testing.assert_close(padded.kv_caches[name], plain.kv_caches[name])
    # Above pad_max_rows a step runs on its own rows only.
    model.model.row_multiple, model.model.pad_min_rows, model.model.pad_max_rows = 8, 0, 46
    rows_seen.clear()
    hook = model.model.layers[0].self_attn.qkv_proj.register_forward_pre_hook(
        lambda _module, args: rows_seen.append(args[0].shape[0])
    )
    try:
        bounded = mixed_runner(model).hidden(MIXED_STEP)
    finally:
        model.model.row_multiple, model.model.pad_min_rows = backend
        model.model.pad_max_rows = None
        hook.remove()
    assert rows_seen == [81, 47], rows_seen
    torch.testing.assert_close(bounded, want, atol=1e-5, rtol=1e-5)


def test_decode_groups_of_very_different_lengths(checkpoint: Callable[[str], Path]) -> None:
    """Decodes far apart in length are attended in separate groups; results must not depend
    on the grouping or on batch order."""
    model = load(checkpoint("llama"))
    lens = [3, 70, 5, 33, 120, 18]
    seqs = {f"r{i}": prompt(n, 10 + i) for i, n in enumerate(lens)}
    runner = PagedRunner(model, num_blocks=48, seed=5)
    for req, ids in seqs.items():
        runner.add(req, ids)
    runner.step([(req, len(ids) - 1) for req, ids in seqs.items()])
    got = runner.step([(req, 1) for req in reversed(seqs)])
    for req, ids in seqs.items():
        solo = PagedRunner(model)
        solo.add(req, ids)
        ref = solo.step([(req, len(ids))])[req][-1:]
        torch.testing.assert_close(got[req], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["llama", "qwen3-tied"])
def test_bf16_close_to_hf(case: str, checkpoint: Callable[[str], Path]) -> None:
    folder = checkpoint(case)
    ids = prompt(40, seed=8)
    ours = PagedRunner(load(folder, "bfloat16"))
    ours.add("a", ids)
    got = ours.step([("a", 30)])["a"]
    got = torch.cat([got, ours.step([("a", 10)])["a"]])
    ref = hf_logits(folder, ids, torch.bfloat16)
    ref32 = hf_logits(folder, ids, torch.float32)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    assert (got.argmax(-1) == ref32.argmax(-1)).float().mean().item() >= 0.8
    assert (got - ref32).abs().max().item() < 0.25 * ref32.abs().max().item()


@pytest.mark.parametrize("case", ["llama", "qwen3-tied"])
def test_bf16_fused_ops_track_the_torch_ops(case: str, checkpoint: Callable[[str], Path]) -> None:
    """The bf16 fused kernels round where the torch ops do: through a whole model the logits
    match the torch-ops run (bit for bit on these checkpoints; a rare result one bf16 step
    apart is allowed for) and track Hugging Face's bf16 run."""
    folder = checkpoint(case)
    ids = prompt(40, seed=9)
    model = load(folder, "bfloat16")
    fused = [m for m in model.modules() if getattr(m, "fused", None) is not None]
    assert fused
    ops = fused[0].fused
    logits = {}
    for name in ("fused", "torch"):
        for m in fused:
            m.fused = ops if name == "fused" else None
        runner = PagedRunner(model)
        runner.add("a", ids)
        got = runner.step([("a", 30)])["a"]
        logits[name] = torch.cat([got, runner.step([("a", 10)])["a"]])
    got, want = logits["fused"], logits["torch"]
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
    ref = hf_logits(folder, ids, torch.bfloat16)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_mixed_batch_matches_cpu(dtype: str, checkpoint: Callable[[str], Path]) -> None:
    folder = checkpoint("qwen3-tied")
    results = {}
    for device in (CPU, torch.device("cuda")):
        runner = PagedRunner(load(folder, "float32" if device == CPU else dtype, device), seed=4)
        for req, n in (("a", 40), ("b", 33), ("c", 28)):
            runner.add(req, prompt(n, seed=n))
        runner.step([("a", 39), ("b", 20)])
        results[device.type] = runner.step([("a", 1), ("b", 13), ("c", 28)])
    for req, ref in results["cpu"].items():
        got = results["cuda"][req]
        if dtype == "float32":
            # TF32 may be on for matmuls; allow for it.
            torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
        else:
            assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8
