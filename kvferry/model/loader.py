"""Load a Hugging Face safetensors checkpoint into a :class:`~kvferry.model.llama.CausalLM`.

Only safetensors are read (never pickle). The model is built on the meta device and then
materialised on the target device, so no time is spent on random initialisation; every
parameter is filled from the checkpoint, fused parameters from several HF tensors.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvferry.config import ArchConfig, ConfigError, ModelConfig
from kvferry.model.llama import CausalLM

logger = logging.getLogger(__name__)

# Fused parameter -> the HF parameters stacked along dim 0, in order.
_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Checkpoint tensors that are derived state or belong to other variants, not weights we need.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model_config: ModelConfig, device: torch.device) -> CausalLM:
    """Build the model for ``model_config.arch`` and load its weights onto ``device`` in
    ``model_config.torch_dtype``; the result is in eval mode with gradients off, laid out as
    the checkpoint is (device tuning is the model runner's).

    Rotary tables cover ``model_config.max_len`` positions. Reads
    ``model.safetensors.index.json`` when present, otherwise every ``*.safetensors`` file
    in the folder. Raises :class:`ConfigError` naming the tensor when one is missing or has the
    wrong shape, and when a shard is missing or unreadable.
    """
    folder = Path(model_config.model)
    cfg = model_config.arch
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions=model_config.max_len)
    _materialize(model, model_config.torch_dtype, device)

    locations = _tensor_locations(folder)
    used: set[str] = set()
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def open_file(path: Path) -> Any:
            if path not in handles:
                try:
                    handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                except Exception as e:  # safetensors raises its own error types
                    raise ConfigError(f"cannot read weights file {path}: {e}") from None
            return handles[path]

        for name, param in model.named_parameters():
            offset = 0
            for src, rows in _sources(name, param.shape[0], cfg):
                path = locations.get(src)
                if path is None:
                    raise ConfigError(
                        f"{folder}: checkpoint has no tensor {src!r} (needed for {cfg.architecture})"
                    )
                f = open_file(path)
                expected = (rows, *param.shape[1:])
                found = tuple(f.get_slice(src).get_shape())
                if found != expected:
                    raise ConfigError(
                        f"{folder}: tensor {src!r} in {path.name} has shape {list(found)}, "
                        f"expected {list(expected)} from config.json"
                    )
                with torch.no_grad():
                    param[offset : offset + rows].copy_(f.get_tensor(src))
                offset += rows
                used.add(src)

    unused = sorted(
        n
        for n in locations
        if n not in used
        and not n.endswith(_IGNORABLE_SUFFIXES)
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    )
    if unused:
        logger.warning(
            "%s: %d checkpoint tensors were not used, e.g. %s", folder, len(unused), unused[:5]
        )
    model.eval()
    model.requires_grad_(False)
    return model


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter uninitialised storage of ``dtype`` on ``device``.
    ``Module.to_empty`` would get there through torch's Python reference ops, which are slow
    on first use."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=False))


def _sources(name: str, rows: int, cfg: ArchConfig) -> list[tuple[str, int]]:
    """HF tensor names that fill parameter ``name`` and how many dim-0 rows each provides."""
    for fused, parts in _FUSED.items():
        if f".{fused}." not in name:
            continue
        if fused == "qkv_proj":
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            sizes = [q, kv, kv]
        else:
            sizes = [rows // 2, rows // 2]
        return [(name.replace(fused, part), n) for part, n in zip(parts, sizes, strict=True)]
    return [(name, rows)]


def _tensor_locations(folder: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index: {e}") from None
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index}: 'weight_map' must be an object")
        locations = {}
        for tensor, file in weight_map.items():
            path = folder / str(file)
            if not path.is_file():
                raise ConfigError(f"{index} lists {file!r} for {tensor!r}, but it does not exist")
            locations[str(tensor)] = path
        return locations
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model folder {str(folder)!r} has no *.safetensors weights")
    locations = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
        except Exception as e:
            raise ConfigError(f"cannot read weights file {path}: {e}") from None
        for key in keys:
            locations[key] = path
    return locations
