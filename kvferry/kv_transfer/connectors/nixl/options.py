"""NixlConnector's options: the shared P/D keys (:class:`PDOptions`) and NIXL's own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvferry.config import ConfigError
from kvferry.kv_transfer.connectors.pd.options import PDOptions, side_channel_address

__all__ = ["NixlOptions", "side_channel_address"]


@dataclass
class NixlOptions(PDOptions):
    """``kv_connector_extra_config`` keys of the NixlConnector."""

    # NIXL backends to create, in order of preference.
    backends: list[str] = field(default_factory=lambda: ["UCX"])
    # Progress threads of the backend (0: NIXL's default).
    num_threads: int = 0
    # Longest sleep (seconds) of the backend's progress thread between UCX events; 0 makes it
    # poll without sleeping (NIXL's own setting: a full core, even when idle).
    progress_interval: float = 0.01

    def validate(self, owner: str) -> None:
        if not self.backends or not all(isinstance(b, str) and b for b in self.backends):
            raise ConfigError(f"{owner}: backends must be a non-empty list of backend names")
        super().validate(owner)
        if self.num_threads < 0:
            raise ConfigError(f"{owner}: num_threads must be >= 0, got {self.num_threads}")
        if not (math.isfinite(self.progress_interval) and 0 <= self.progress_interval <= 1):
            raise ConfigError(
                f"{owner}: progress_interval must be between 0 and 1 second, "
                f"got {self.progress_interval}"
            )
