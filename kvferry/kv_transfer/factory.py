"""KVConnectorFactory: connector name -> class, loaded lazily, one instance per role.

Importing this module imports no connector: the registry holds (module, class) names, and a
module is imported only when its connector is created. ``kv_connector_module_path`` names a
user's module instead: a dotted name or a path to a ``.py`` file (see :func:`import_module_path`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from kvferry import envs
from kvferry.config import ConfigError
from kvferry.kv_layout import KVCacheLayout, supported_layout_names
from kvferry.kv_transfer import vllm_imports
from kvferry.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorRole,
    supports_hma,
)

if TYPE_CHECKING:
    from kvferry.config import EngineConfig, KVTransferConfig
    from kvferry.kv_cache_config import KVCacheConfig


class KVConnectorFactory:
    _registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def registered_names(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def get_connector_class(cls, kvt: KVTransferConfig) -> type[KVConnectorBase]:
        name = kvt.kv_connector
        if name is None:
            raise ConfigError("kv_connector is not set")
        if kvt.kv_connector_module_path:
            module_path, class_name = kvt.kv_connector_module_path, name
        elif name in cls._registry:
            module_path, class_name = cls._registry[name]
        else:
            raise ConfigError(
                f"unknown KV connector {name!r}; built-in connectors are {cls.registered_names()}, "
                f"or set kv_connector_module_path to load your own"
            )
        if kvt.kv_connector_module_path:
            # A connector written for vLLM imports vllm.*: served by kvferry when vLLM is absent.
            vllm_imports.install()
            module = import_module_path(module_path, "KV connector module")
        else:
            try:
                module = importlib.import_module(module_path)
            except ImportError as e:
                raise ConfigError(
                    f"cannot import KV connector module {module_path!r}: {e}"
                ) from None
        connector_cls = getattr(module, class_name, None)
        if connector_cls is None:
            raise ConfigError(f"module {module_path!r} has no class {class_name!r}")
        if not (inspect.isclass(connector_cls) and issubclass(connector_cls, KVConnectorBase)):
            raise ConfigError(
                f"{module_path}.{class_name} is not a KV connector (it must subclass "
                f"kvferry.kv_transfer.base.KVConnectorBase)"
            )
        if not _takes_kv_cache_config(connector_cls):
            raise ConfigError(
                f"KV connector {module_path}.{class_name} uses the deprecated 2-argument "
                "constructor (vllm_config, role); a KV connector must accept kv_cache_config "
                "as its third constructor argument and pass it on to super().__init__()"
            )
        return connector_cls

    @classmethod
    def create_connector(
        cls, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> KVConnectorBase:
        kvt = config.kv_transfer_config
        if kvt is None:
            raise ConfigError("creating a KV connector needs a kv_transfer_config")
        connector_cls = cls.get_connector_class(kvt)
        if len(kv_cache_config.groups) > 1 and not _supports_hma(connector_cls, kvt):
            raise ConfigError(
                f"{connector_cls.__name__} does not implement SupportsHMA, but this engine has "
                f"{len(kv_cache_config.groups)} KV cache groups"
            )
        required = required_kv_cache_layout(connector_cls, config)
        if required is not None and required is not kv_cache_config.layout:
            raise ConfigError(
                f"{connector_cls.__name__} requires the {required.value!r} KV cache layout, "
                f"but the KV pool is allocated {kv_cache_config.layout.value!r}" + _override_hint()
            )
        config, kv_cache_config = vllm_imports.connector_args(
            connector_cls, config, kv_cache_config
        )
        # Positional, as vLLM's factory calls it: any parameter names, and *args pass-through.
        return connector_cls(config, role, kv_cache_config)


def _takes_kv_cache_config(connector_cls: type[KVConnectorBase]) -> bool:
    """Whether the constructor accepts ``kv_cache_config`` (by that name, or through
    ``**kwargs``), as vLLM's factory checks: what tells a 3-argument connector from a 2-argument
    one whatever its parameters are called."""
    try:
        params = inspect.signature(connector_cls.__init__).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: let the call decide
        return True
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "kv_cache_config" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in params
    )


def required_kv_cache_layout(
    connector_cls: type[KVConnectorBase], config: EngineConfig
) -> KVCacheLayout | None:
    """What ``connector_cls.get_required_kvcache_layout`` asks for, or None for any; a name
    kvferry does not allocate is a :class:`ConfigError`."""
    name = connector_cls.get_required_kvcache_layout(vllm_imports.config_arg(connector_cls, config))
    if name is None:
        return None
    layout = KVCacheLayout.named(str(name))
    if layout is None:
        raise ConfigError(
            f"{connector_cls.__name__} requires the {name!r} KV cache layout, which kvferry "
            f"does not allocate; it allocates {supported_layout_names()} (one tensor per "
            "layer, (2, num_blocks, block_size, num_kv_heads, head_dim) in either memory "
            "order; no block spans several layers)"
        )
    return layout


def resolve_kv_cache_layout(config: EngineConfig) -> KVCacheLayout:
    """The layout the KV pool is allocated in, decided once at start: ``KVFERRY_KV_CACHE_LAYOUT``
    when set, else what the configured connector requires, else ``NHD`` (vLLM's order of
    choice). An override that contradicts the connector's requirement, or a name kvferry does
    not allocate, is a :class:`ConfigError`."""
    kvt = config.kv_transfer_config
    required = None
    connector_name = None
    if kvt is not None and kvt.kv_connector is not None:
        connector_cls = KVConnectorFactory.get_connector_class(kvt)
        required = required_kv_cache_layout(connector_cls, config)
        connector_name = connector_cls.__name__
    override = envs.kv_cache_layout()
    if override is None:
        return required or KVCacheLayout.NHD
    layout = KVCacheLayout.named(override)
    if layout is None:
        raise ConfigError(
            f"KVFERRY_KV_CACHE_LAYOUT={override!r} is not a KV cache layout; "
            f"choose one of {supported_layout_names()}"
        )
    if required is not None and required is not layout:
        raise ConfigError(
            f"KVFERRY_KV_CACHE_LAYOUT={override!r}, but {connector_name} requires the "
            f"{required.value!r} KV cache layout; unset the variable or set it to {required.value}"
        )
    return layout


def _override_hint() -> str:
    override = envs.kv_cache_layout()
    return "" if override is None else f" (KVFERRY_KV_CACHE_LAYOUT={override!r})"


def import_module_path(module_path: str, what: str = "module") -> ModuleType:
    """Import a user's ``module_path``: a dotted module name, or a path to a ``.py`` file.

    A dotted name that ``sys.path`` cannot find is also looked up in the current working
    directory, as ``python -m`` would (the ``kvferry`` console script does not put it on
    ``sys.path``). A file is imported once per process under its stem (or a longer name when
    the stem is taken), so the scheduler and worker sides share its classes. Any failure is a
    :class:`ConfigError` naming ``what`` and the path.
    """
    if module_path.endswith(".py") or "/" in module_path or os.sep in module_path:
        return _import_file(Path(module_path), what)
    try:
        try:
            return importlib.import_module(module_path)
        except ModuleNotFoundError as e:
            top = module_path.partition(".")[0]
            cwd = os.getcwd()
            here = Path(cwd)
            found_here = (here / top).is_dir() or (here / f"{top}.py").is_file()
            on_path = {os.path.abspath(p or cwd) for p in sys.path}
            if e.name != top or not found_here or cwd in on_path:
                raise
            # Appended, not prepended: nothing installed is shadowed by the working directory.
            sys.path.append(cwd)
            importlib.invalidate_caches()
            return importlib.import_module(module_path)
    except Exception as e:  # the user's module may fail in any way while it runs
        raise ConfigError(f"cannot import {what} {module_path!r}: {e}") from None


def _import_file(path: Path, what: str) -> ModuleType:
    if not path.is_file():
        raise ConfigError(f"{what} file {str(path)!r} does not exist")
    resolved = path.resolve()
    if resolved in _FILE_MODULES:
        return _FILE_MODULES[resolved]
    name = path.stem
    if name in sys.modules or not name.isidentifier():
        digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
        name = f"_kvferry_user_{digest}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {what} {str(path)!r}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as a normal import does (dataclasses look themselves up).
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"cannot import {what} {str(path)!r}: {type(e).__name__}: {e}") from None
    _FILE_MODULES[resolved] = module
    return module


_FILE_MODULES: dict[Path, ModuleType] = {}


def _supports_hma(connector_cls: type[KVConnectorBase], kvt: KVTransferConfig) -> bool:
    support_check = getattr(connector_cls, "supports_hma_config", None)
    if support_check is not None:
        return bool(support_check(kvt))
    return supports_hma(connector_cls)


_CONNECTORS = "kvferry.kv_transfer.connectors"
for _name, _module in [
    ("ExampleConnector", f"{_CONNECTORS}.example_connector"),
    ("ExampleHiddenStatesConnector", f"{_CONNECTORS}.example_hidden_states"),
    ("DecodeBenchConnector", f"{_CONNECTORS}.decode_bench_connector"),
    ("MultiConnector", f"{_CONNECTORS}.multi_connector"),
    ("NixlConnector", f"{_CONNECTORS}.nixl.connector"),
    ("SimpleCPUOffloadConnector", f"{_CONNECTORS}.simple_cpu_offload_connector"),
    ("OffloadingConnector", f"{_CONNECTORS}.offloading_connector"),
    ("FaultInjectionConnector", f"{_CONNECTORS}.fault_injection"),
    ("MooncakeStoreConnector", f"{_CONNECTORS}.mooncake_store"),
    ("MooncakeConnector", f"{_CONNECTORS}.mooncake"),
    ("LMCacheMPConnector", f"{_CONNECTORS}.lmcache_mp"),
]:
    KVConnectorFactory.register_connector(_name, _module, _name)
