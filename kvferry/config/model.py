"""ModelConfig: the checkpoint folder, its architecture and the dtype it runs in."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvferry.config.arch import ArchConfig
from kvferry.config.errors import ConfigError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(name: str, arch_dtype: str | None) -> torch.dtype:
    if name == "auto":
        if arch_dtype in _DTYPES:
            # bf16/fp16 checkpoints run in their own dtype; on CPU fp16 matmuls are slow and
            # inaccurate, so "auto" picks bf16 there.
            dt = _DTYPES[arch_dtype]
            return torch.bfloat16 if dt == torch.float16 and not torch.cuda.is_available() else dt
        return torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


@dataclass
class ModelConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    arch: ArchConfig = field(init=False)
    torch_dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        path = Path(self.model)
        if not path.exists():
            raise ConfigError(f"model folder {self.model!r} does not exist")
        if not path.is_dir():
            raise ConfigError(
                f"model {self.model!r} is not a folder (expected a Hugging Face checkpoint folder)"
            )
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"model folder {self.model!r} has no config.json")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{cfg_path} must hold a JSON object")
        self.arch = ArchConfig.from_dict(raw, str(cfg_path))
        if not any(path.glob("*.safetensors")):
            raise ConfigError(f"model folder {self.model!r} has no *.safetensors weights")
        self.torch_dtype = resolve_dtype(self.dtype, self.arch.torch_dtype)
        limit = self.arch.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        elif self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        if self.tokenizer is None:
            self.tokenizer = self.model

    @property
    def max_len(self) -> int:
        assert self.max_model_len is not None
        return self.max_model_len
