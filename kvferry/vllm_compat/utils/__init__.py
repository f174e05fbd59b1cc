"""``vllm.utils``: the helpers connectors import (older vLLM kept them at this level)."""

from kvferry.vllm_compat.utils.hashing import safe_hash, sha256
from kvferry.vllm_compat.utils.math_utils import cdiv, round_down, round_up

__all__ = ["cdiv", "round_down", "round_up", "safe_hash", "sha256"]
