"""Checkpoint loading: shards, dtype casting, tied embeddings and clear errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvferry.config import ConfigError, ModelConfig
from kvferry.model.llama import CausalLM
from kvferry.model.loader import load_model
from kvferry.worker import cpu_backend
from kvferry.worker.cpu_backend import CPULinear, PackedStepsLinear, SmallStepsLinear
from kvferry.worker.model_runner import ModelRunner

CPU = torch.device("cpu")


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def state(folder: Path, dtype: str = "float32") -> dict[str, torch.Tensor]:
    return load_model(ModelConfig(str(folder), dtype=dtype), CPU).state_dict()


def test_loads_fused_weights_in_hf_order(tiny_model_factory: Callable[..., Path]) -> None:
    folder = tiny_model_factory("qwen2")
    hf = load_file(str(folder / "model.safetensors"))
    model = load_model(ModelConfig(str(folder), dtype="float32"), CPU)
    sd = model.state_dict()
    p = "model.layers.1.self_attn."
    expected_w = torch.cat(
        [hf[p + "q_proj.weight"], hf[p + "k_proj.weight"], hf[p + "v_proj.weight"]]
    )
    expected_b = torch.cat([hf[p + "q_proj.bias"], hf[p + "k_proj.bias"], hf[p + "v_proj.bias"]])
    assert torch.equal(sd[p + "qkv_proj.weight"], expected_w)
    assert torch.equal(sd[p + "qkv_proj.bias"], expected_b)
    p = "model.layers.1.mlp."
    expected_gu = torch.cat([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]])
    assert torch.equal(sd[p + "gate_up_proj.weight"], expected_gu)
    assert not any(t.requires_grad for t in model.parameters())
    assert model.layer_names == [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def test_sharded_checkpoint_loads_the_same(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    src = tiny_model_factory("llama")
    folder = copy_of(src, tmp_path / "sharded")
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    a, b = state(src), state(folder)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_casts_to_requested_dtype(tiny_model_factory: Callable[..., Path]) -> None:
    folder = tiny_model_factory("llama", dtype="bfloat16")
    sd = state(folder, "float32")
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert ModelConfig(str(folder)).torch_dtype == torch.bfloat16  # "auto" follows config.json
    assert all(t.dtype == torch.bfloat16 for t in state(folder, "auto").values())


def test_tied_checkpoint_with_redundant_lm_head(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    folder = copy_of(tiny_model_factory("qwen3", tie_word_embeddings=True), tmp_path / "tied")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    model = load_model(ModelConfig(str(folder), dtype="float32"), CPU)
    hidden = torch.randn(2, 256)
    expected = hidden @ tensors["model.embed_tokens.weight"].T
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_missing_tensor_is_named(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    folder = copy_of(tiny_model_factory("llama"), tmp_path / "missing")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight"):
        load_model(ModelConfig(str(folder), dtype="float32"), CPU)


def test_untied_checkpoint_without_lm_head(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    folder = copy_of(tiny_model_factory("llama"), tmp_path / "nohead")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match="lm_head.weight"):
        load_model(ModelConfig(str(folder), dtype="float32"), CPU)


def test_misshaped_tensor_is_named(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    folder = copy_of(tiny_model_factory("llama"), tmp_path / "shape")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(1000, 256)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(
        ConfigError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\[1000, 256\].*\[1024, 256\]"
    ):
        load_model(ModelConfig(str(folder), dtype="float32"), CPU)


def test_index_naming_a_missing_shard(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    folder = copy_of(tiny_model_factory("llama"), tmp_path / "badindex")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00009.safetensors"}})
    )
    with pytest.raises(ConfigError, match="model-00009.safetensors"):
        load_model(ModelConfig(str(folder), dtype="float32"), CPU)


def test_corrupt_weights_file(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    folder = copy_of(tiny_model_factory("llama"), tmp_path / "corrupt")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ConfigError, match="cannot read weights file"):
        load_model(ModelConfig(str(folder), dtype="float32"), CPU)


def test_unsupported_architecture(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    folder = copy_of(tiny_model_factory("llama"), tmp_path / "arch")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture.*MistralForCausalLM"):
        ModelConfig(str(folder))


def cpu_tuned(folder: Path, dtype: str) -> CausalLM:
    """A loaded model as a CPU engine's model runner has laid it out."""
    model = load_model(ModelConfig(str(folder), dtype=dtype), CPU)
    return ModelRunner(model, 16, CPU, 0).model  # type: ignore[no-any-return]


def test_cpu_fp32_weights_are_laid_out_for_gemms(tiny_model_factory: Callable[..., Path]) -> None:
    folder = tiny_model_factory("llama")
    plain = load_model(ModelConfig(str(folder), dtype="float32"), CPU)
    proj = plain.model.layers[0].self_attn.qkv_proj
    assert proj.kernel is None and proj.weight.is_contiguous()  # the loader leaves it as is
    fp32 = cpu_tuned(folder, "float32")
    proj = fp32.model.layers[0].self_attn.qkv_proj
    if cpu_backend.pack_weight(torch.ones(2, 2)) is not None:
        hook = proj.kernel
        if isinstance(hook, SmallStepsLinear):  # AVX2 or AVX-512: a C kernel for small steps
            assert cpu_backend.cpu_features().isa in ("avx2", "avx512")
            hook = hook.rest
        if isinstance(hook, PackedStepsLinear):  # AVX-512: the panel kernel, on its own copy
            assert cpu_backend.cpu_features().isa == "avx512"
            assert hook.packed.numel() >= proj.weight.numel()
            hook = hook.rest
        assert isinstance(hook, CPULinear)
        assert hook.packed is not None and proj.weight.is_contiguous()
    else:
        assert proj.weight.stride() == (1, proj.weight.shape[0])  # input-major
    bf16 = cpu_tuned(folder, "bfloat16")
    proj = bf16.model.layers[0].self_attn.qkv_proj
    hook = proj.kernel
    if isinstance(hook, SmallStepsLinear) and cpu_backend.cpu_features().native_bf16:
        hook = hook.rest  # the dot-product kernel for one-row steps, in front of the packed copy
    packed = hook.packed if isinstance(hook, CPULinear) else None
    if isinstance(hook, PackedStepsLinear):  # AMX: the GEMM kernel, on its own copy
        assert cpu_backend.cpu_features().amx_bf16
        assert hook.packed.dtype == torch.bfloat16
        assert hook.packed.numel() == proj.weight.numel()
        assert isinstance(hook.rest, CPULinear) and hook.rest.packed is None  # plain beyond
        packed = hook.packed
    assert proj.weight.is_contiguous()  # half precision: the dense weight keeps its layout
    if not cpu_backend.cpu_features().native_bf16:
        assert packed is None  # a bf16 packed copy only serves bf16 instructions
    else:
        assert packed is not None


def test_cpu_fp32_without_onednn_uses_input_major_weights(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_backend, "pack_weight", lambda w: None)
    folder = tiny_model_factory("llama")
    model = cpu_tuned(folder, "float32")
    proj = model.model.layers[0].self_attn.qkv_proj
    assert proj.kernel is None and proj.weight.stride() == (1, proj.weight.shape[0])
