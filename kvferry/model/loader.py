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

from kvferry.config import ConfigError, ModelConfig
from kvferry.model.llama import CausalLM
from kvferry.model.parallel import tp_rank, tp_size
from kvferry.model.shard_plan import plan_pieces

logger = logging.getLogger(__name__)

# Checkpoint tensors that are derived state or belong to other variants, not weights we need.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model_config: ModelConfig, device: torch.device) -> CausalLM:
    """Build the model for ``model_config.arch`` and load its weights onto ``device`` in
    ``model_config.torch_dtype``; the result is in eval mode with gradients off, laid out as
    the checkpoint is (device tuning is the model runner's).

    Rotary tables cover ``model_config.max_len`` positions. Reads
    ``model.safetensors.index.json`` when present, otherwise every ``*.safetensors`` file
    in the folder. Under tensor parallelism (``kvferry.model.parallel``) each parameter is this
    rank's shard and only its slices are read. Raises :class:`ConfigError` naming the tensor when one is missing or has the
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

        rank, world_size = tp_rank(), tp_size()
        for name, param in model.named_parameters():
            filled = 0
            for piece in plan_pieces(name, tuple(param.shape), cfg, rank, world_size):
                src = piece.src
                path = locations.get(src)
                if path is None:
                    raise ConfigError(
                        f"{folder}: checkpoint has no tensor {src!r} (needed for {cfg.architecture})"
                    )
                f = open_file(path)
                found = tuple(f.get_slice(src).get_shape())
                if found != piece.full_shape:
                    raise ConfigError(
                        f"{folder}: tensor {src!r} in {path.name} has shape {list(found)}, "
                        f"expected {list(piece.full_shape)} from config.json"
                    )
                part = piece.read(f.get_slice(src)) if world_size > 1 else f.get_tensor(src)
                rows = part.shape[0]
                with torch.no_grad():
                    param[piece.dst_offset : piece.dst_offset + rows].copy_(part)
                filled = max(filled, piece.dst_offset + rows)
                used.add(src)
            if param.dim() and filled < param.shape[0]:  # the last vocabulary shard's padding
                with torch.no_grad():
                    param[filled:].zero_()

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
