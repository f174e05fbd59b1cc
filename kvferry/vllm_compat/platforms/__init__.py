"""``vllm.platforms``: ``current_platform``, the device kvferry runs on in this process."""

from __future__ import annotations

import torch

__all__ = ["Platform", "current_platform"]


class Platform:
    """What connectors ask of vLLM's platform object; CUDA when a GPU is visible (the device
    kvferry's ``device="auto"`` picks), CPU otherwise."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.device_name = device_type
        self.dispatch_key = "CUDA" if device_type == "cuda" else "CPU"

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def is_cuda_alike(self) -> bool:
        return self.device_type == "cuda"

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def is_out_of_tree(self) -> bool:
        return False

    def is_pin_memory_available(self) -> bool:
        return self.is_cuda()

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if self.is_cuda() else "cpu"

    def get_device_capability(self, device_id: int = 0) -> tuple[int, int] | None:
        return torch.cuda.get_device_capability(device_id) if self.is_cuda() else None

    def synchronize(self) -> None:
        if self.is_cuda():
            torch.cuda.synchronize()

    def __repr__(self) -> str:
        return f"Platform({self.device_type!r})"


current_platform = Platform("cuda" if torch.cuda.is_available() else "cpu")
