"""The ExampleHiddenStatesConnector's ``kv_connector_extra_config`` options, checked once.

vLLM takes the layer ids from its ``extract_hidden_states`` speculative config
(``draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids``); kvferry has no
speculative decoding, so the same key sits in the connector's extra config.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from kvferry.config import ConfigError


@dataclass
class HiddenStatesOptions:
    """``shared_storage_path``: the folder files are written to (vLLM's default ``/tmp``).
    ``eagle_aux_hidden_state_layer_ids``: the residual-stream positions to save, distinct and
    increasing, each in ``0 .. num_hidden_layers`` (required).
    ``num_writer_threads``: threads writing files off the step. ``use_synchronization_lock``:
    hold ``<file>.lock`` exclusively until the file is written, so ``load_hidden_states``
    waits for it. ``allow_custom_save_path``: honour a request's
    ``kv_transfer_params["hidden_states_path"]`` (lets clients write anywhere the server
    can: trusted clients only)."""

    shared_storage_path: str = "/tmp"
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    num_writer_threads: int = 8
    use_synchronization_lock: bool = True
    allow_custom_save_path: bool = False

    def validate(self, owner: str) -> None:
        if self.num_writer_threads < 1:
            raise ConfigError(f"{owner}: num_writer_threads must be at least 1")
        if not self.shared_storage_path:
            raise ConfigError(f"{owner}: shared_storage_path must not be empty")

    def layer_ids(self, num_hidden_layers: int, owner: str) -> tuple[int, ...]:
        """The layer ids, checked against a model of ``num_hidden_layers`` layers."""
        ids = self.eagle_aux_hidden_state_layer_ids
        if not ids:
            raise ConfigError(
                f"{owner}: kv_connector_extra_config needs eagle_aux_hidden_state_layer_ids, "
                f"the hidden-state layers to save (ids 0..{num_hidden_layers})"
            )
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise ConfigError(f"{owner}: layer id {i!r} is not an integer")
            if not 0 <= i <= num_hidden_layers:
                raise ConfigError(
                    f"{owner}: layer id {i} is out of range: this model has "
                    f"{num_hidden_layers} layers, so ids go from 0 (the embeddings) to "
                    f"{num_hidden_layers} (the last layer's output)"
                )
        if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
            raise ConfigError(
                f"{owner}: eagle_aux_hidden_state_layer_ids must be distinct and increasing, "
                f"got {ids}"
            )
        return tuple(ids)


def check_writable_folder(path: str, owner: str) -> None:
    """Create ``path`` if needed and prove a file can be written there, or raise ConfigError."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvferry-probe-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"{owner}: shared_storage_path {path!r} is not a writable folder: {e.strerror or e}"
        ) from None
