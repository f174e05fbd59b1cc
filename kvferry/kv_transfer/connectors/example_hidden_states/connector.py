"""ExampleHiddenStatesConnector: writes the chosen layers' hidden states of every request to
a folder, one safetensors file per request (e.g. training data for EAGLE-style drafters).

A working example of a connector that moves something other than KV, with vLLM's name,
options and file format. The model's decoder loop records the residual stream at the layer
ids asked for into the step's forward context; the worker half (:mod:`.worker`) keeps it per
KV slot and writes the files; the scheduler half (:mod:`.scheduler`) decides when a
request's file is complete. Files and their format: :mod:`.files`. Options: :mod:`.options`.

Differences from vLLM: the layer ids are a connector option (kvferry has no speculative
config), chunked prefill works (vLLM needs it off), and prompt-only files are written in the
step that finishes the prompt rather than after the request ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import KVConnectorMetadata, KVConnectorRole, SupportsHMA
from kvferry.kv_transfer.connectors.example_hidden_states.metadata import (
    ExampleHiddenStatesConnectorMetadata,
)
from kvferry.kv_transfer.connectors.example_hidden_states.options import (
    HiddenStatesOptions,
    check_writable_folder,
)
from kvferry.kv_transfer.connectors.example_hidden_states.scheduler import (
    HiddenStatesScheduler,
)
from kvferry.kv_transfer.connectors.example_hidden_states.worker import HiddenStatesWorker
from kvferry.kv_transfer.connectors.split import SplitConnector
from kvferry.kv_transfer.options import parse_options

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.request import Request


def _tensor_parallel_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _full_attention_group(kv_cache_config: KVCacheConfig, owner: str) -> int:
    """The first KV cache group that keeps every token's block (no sliding window): its block
    ids index the hidden-states buffer."""
    for i, group in enumerate(kv_cache_config.groups):
        if getattr(group, "sliding_window", None) is None:
            return i
    raise ConfigError(f"{owner} needs a full-attention KV cache group")


class ExampleHiddenStatesConnector(
    SplitConnector[HiddenStatesScheduler, HiddenStatesWorker], SupportsHMA
):
    """See the module docstring. Store-only: it never offers a hit."""

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        name = type(self).__name__
        opts = parse_options(
            HiddenStatesOptions, self._kv_transfer_config.kv_connector_extra_config, name
        )
        arch = config.model_config.arch
        layer_ids = opts.layer_ids(arch.num_hidden_layers, name)
        check_writable_folder(opts.shared_storage_path, name)
        self._group = _full_attention_group(kv_cache_config, name)
        block_size = kv_cache_config.groups[self._group].block_size
        if role == KVConnectorRole.SCHEDULER:
            self.set_scheduler_half(HiddenStatesScheduler(opts, block_size, self._group, name))
        else:
            self.set_worker_half(
                HiddenStatesWorker(
                    opts,
                    layer_ids,
                    arch.hidden_size,
                    config.model_config.torch_dtype,
                    kv_cache_config.num_blocks,
                    block_size,
                    # Any layer of the group: they share its metadata (its slot mapping).
                    slots_layer=kv_cache_config.groups[self._group].layer_names[0],
                    is_writer=_tensor_parallel_rank() == 0,
                    owner=name,
                )
            )

    def get_finished_count(self) -> int:
        # Only rank 0 writes, so only rank 0 ever reports a delayed free as sent.
        return 1

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
            raise TypeError(f"{type(self).__name__} got {type(metadata).__name__} as metadata")
        super().bind_connector_metadata(metadata)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    def num_tracked_requests(self) -> int:
        return self.scheduler_half.num_tracked_requests()

    def wait_for_writes(self) -> None:
        """Worker role: block until every file submitted so far is in place."""
        self.worker_half.wait_for_writes()
