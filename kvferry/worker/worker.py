"""Worker: owns the device, the model weights and the paged KV cache tensors.

Sizing the KV pool: ``--num-kv-blocks`` wins; else ``--kv-cache-memory`` bytes; else a
default share of the memory left after loading the weights. A budget that cannot hold one
request of ``max_model_len`` tokens, or that exceeds the memory available, is refused with a
``ConfigError`` before anything large is allocated.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import time

import torch

from kvferry import envs
from kvferry.config import ConfigError, EngineConfig
from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvferry.kv_layout import record_engine_layout
from kvferry.kv_transfer.base import KVConnectorBase, KVConnectorHandshakeMetadata, KVConnectorRole
from kvferry.kv_transfer.factory import KVConnectorFactory, resolve_kv_cache_layout
from kvferry.kv_transfer.trace import maybe_wrap
from kvferry.logger import fmt_fields, init_logger
from kvferry.model.loader import load_model
from kvferry.model.parallel import all_reduce_min, tp_size
from kvferry.step_types.runner_output import ModelRunnerOutput
from kvferry.step_types.scheduler_output import SchedulerOutput
from kvferry.worker.kv_cache_layout import allocate_kv_caches, kv_cache_group_specs
from kvferry.worker.kv_connector import KVConnectorDriver
from kvferry.worker.model_runner import ModelRunner

logger = init_logger(__name__)

_CPU_DEFAULT_CAP = 2 * 1024**3  # like vLLM CPU's KV-space default order of magnitude
_CPU_DEFAULT_FRACTION = 0.3
_CUDA_DEFAULT_FRACTION = 0.85


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def zeroed_kv_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, prefault: bool = False
) -> torch.Tensor:
    """A zero-filled KV cache tensor (zeroed so that padded attention positions never read NaN
    garbage).

    On CPU the tensor lives in its own anonymous memory map, which the OS hands out zeroed,
    page by page on first write. ``prefault`` (``CacheConfig.kv_pool_prefault``, the engines'
    default) takes every page at start-up, so that no step pays for them: a block's first use
    would otherwise add its page faults to the forward that writes it (a request's time to
    first token online, a whole run's share offline; they are slow in VMs). Without it
    start-up skips zeroing a pool sized for the whole run and RSS grows with the blocks in use.
    Transparent huge pages are not requested: attention reads scattered blocks slightly
    faster from them, but a huge-page fault may stall on memory compaction for a long time.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds a reference to the map, which lives as long as the tensor does.
    tensor = torch.frombuffer(buf, dtype=dtype).view(shape)
    if prefault:
        tensor.zero_()
    return tensor


def _fmt_bytes(n: int) -> str:
    return f"{n / 1024**2:.1f}MiB"


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = config.device_config.torch_device
        if self.device.type == "cuda" and tp_size() > 1:
            self.device = torch.device("cuda", rank)  # one device per rank
        mc = config.model_config
        t0 = time.perf_counter()
        self.model = load_model(mc, self.device)
        # The runner tunes the model for the device before the pool is sized from what is left.
        self.model_runner = ModelRunner(
            self.model, config.cache_config.block_size, self.device, mc.seed
        )
        logger.info(
            fmt_fields(
                "model loaded",
                model=mc.model,
                dtype=str(mc.torch_dtype).removeprefix("torch."),
                device=str(self.device),
                seconds=time.perf_counter() - t0,
            )
        )
        # One KV cache group per attention type (a hybrid model has several); this rank's
        # share of the KV heads.
        groups = kv_cache_group_specs(
            mc.arch,
            self.model.layer_names,
            config.cache_config.block_size,
            mc.torch_dtype,
            num_kv_heads=mc.arch.num_key_value_heads // tp_size(),
        )
        group = groups[0]
        # Decided before anything is allocated: the pool is laid out once, for the connector.
        layout = resolve_kv_cache_layout(config)
        record_engine_layout(layout)  # what vllm's get_kv_cache_layout() answers here
        # Every rank's pool has the same number of blocks: the scheduler hands out one id space.
        num_blocks = all_reduce_min(self._num_blocks(groups))
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, groups=groups, layout=layout)
        forced = envs.kv_pool_prefault()
        prefault = config.cache_config.kv_pool_prefault if forced is None else forced
        self.kv_caches = allocate_kv_caches(
            self.kv_cache_config,
            self.device,
            functools.partial(zeroed_kv_tensor, prefault=prefault),
        )
        logger.info(
            fmt_fields(
                "KV cache allocated",
                blocks=num_blocks,
                block_size=group.block_size,
                tokens=num_blocks * group.block_size,
                layout=layout.value,
                bytes=_fmt_bytes(num_blocks * self.kv_cache_config.bytes_per_block),
            )
        )
        self.model_runner.initialize_kv_caches(
            self.kv_caches, [g.layer_names for g in self.kv_cache_config.groups]
        )
        self.kv_connector: KVConnectorBase | None = None
        if config.kv_transfer_config is not None:
            connector = KVConnectorFactory.create_connector(
                config, KVConnectorRole.WORKER, self.kv_cache_config
            )
            self.kv_connector = maybe_wrap(connector)
            self.model_runner.kv_driver = KVConnectorDriver(self.kv_connector, self.kv_caches)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def get_kv_connector_handshake_metadata(
        self,
    ) -> dict[int, KVConnectorHandshakeMetadata] | None:
        """This worker's connector handshake data keyed by its rank, or None when there is no
        connector or it has none (asked once, after ``register_kv_caches``)."""
        if self.kv_connector is None:
            return None
        metadata = self.kv_connector.get_handshake_metadata()
        return None if metadata is None else {self.rank: metadata}

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def _num_blocks(self, groups: tuple[KVCacheGroupSpec, ...]) -> int:
        cc, mc = self.config.cache_config, self.config.model_config
        per_block = KVCacheConfig(num_blocks=1, groups=groups).bytes_per_block
        # One request of max_len tokens in every group (a prompt computed in one step holds
        # all its blocks in a sliding-window group too), and a hybrid pool's null block.
        hybrid = any(g.sliding_window is not None for g in groups)
        need = len(groups) * -(-mc.max_len // groups[0].block_size) + int(hybrid)
        avail = available_memory(self.device)
        if cc.num_kv_blocks is not None:
            budget = cc.num_kv_blocks * per_block
            source = f"num_kv_blocks={cc.num_kv_blocks}"
        elif cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
            source = f"kv_cache_memory={_fmt_bytes(budget)}"
        else:
            if self.device.type == "cuda":
                budget = int(avail * _CUDA_DEFAULT_FRACTION)
            else:
                budget = min(_CPU_DEFAULT_CAP, int(avail * _CPU_DEFAULT_FRACTION))
            # Never default to more than every sequence at full length could use.
            max_useful = need * self.config.scheduler_config.max_num_seqs * per_block
            budget = min(budget, max(max_useful, need * per_block))
            source = "the default budget"
        if budget > avail:
            raise ConfigError(
                f"{source} needs {_fmt_bytes(budget)} for the KV cache but only "
                f"{_fmt_bytes(avail)} of {self.device.type} memory is available"
            )
        num_blocks = budget // per_block
        if num_blocks < need:
            raise ConfigError(
                f"{source} gives {num_blocks} KV blocks ({_fmt_bytes(per_block)} each), fewer than "
                f"the {need} needed for one request of max_model_len={mc.max_len}; "
                f"raise the KV budget to at least {_fmt_bytes(need * per_block)} or lower "
                f"--max-model-len"
            )
        return int(num_blocks)
