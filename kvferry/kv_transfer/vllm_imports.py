"""The ``vllm`` import surface for out-of-tree connectors: a meta-path finder, and the vLLM views
a vLLM-style connector is constructed with.

When vLLM itself is not installed, :func:`install` puts a finder first on ``sys.meta_path``
that resolves ``vllm`` and every ``vllm.X.Y`` to the module ``kvferry.vllm_compat.X.Y``: the
very same module object, registered under both names, so ``isinstance`` and ``is`` hold across
the two spellings. A name the surface does not cover raises ``ModuleNotFoundError`` naming it
(``except ImportError`` fallbacks in connectors keep working). When a real vLLM is importable,
:func:`install` does nothing and kvferry never shadows it.

A connector class whose module (or a base class's module) imports from ``vllm`` is
"vLLM-style": :func:`connector_args` hands it vLLM's config views (``VllmConfig`` over the
engine config, vLLM's ``KVCacheConfig`` over the KV pool layout) instead of kvferry's objects.
The views live in ``kvferry.vllm_compat``, a layer above this module, so they are reached by
name like every module the finder serves.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_PREFIX = "vllm"
_TARGET = "kvferry.vllm_compat"
_DOCS = "docs/connectors.md"


class _AliasLoader(importlib.abc.Loader):
    """Loads ``vllm.X`` as the already importable module ``kvferry.vllm_compat.X``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the target module ran when it was imported."""


class VllmShimFinder(importlib.abc.MetaPathFinder):
    """Serves ``vllm`` and ``vllm.*`` from ``kvferry.vllm_compat``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _PREFIX and not fullname.startswith(_PREFIX + "."):
            return None
        target_name = _TARGET + fullname[len(_PREFIX) :]
        try:
            target_spec = importlib.util.find_spec(target_name)
        except ModuleNotFoundError:
            target_spec = None
        if target_spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: vLLM is not installed and kvferry's vllm import "
                f"surface does not cover it (see {_DOCS} for what it covers)",
                name=fullname,
            )
        is_package = target_spec.submodule_search_locations is not None
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(target_name), is_package=is_package
        )


_FINDER = VllmShimFinder()


def real_vllm_installed() -> bool:
    """True when an actual vLLM is importable (kvferry's own finder left out of the question)."""
    loaded = sys.modules.get(_PREFIX)
    if loaded is not None:
        return getattr(loaded, "__name__", _PREFIX) != _TARGET
    active = _FINDER in sys.meta_path
    if active:
        sys.meta_path.remove(_FINDER)
    try:
        return importlib.util.find_spec(_PREFIX) is not None
    finally:
        if active:
            sys.meta_path.insert(0, _FINDER)


def install() -> bool:
    """Serve ``vllm.*`` imports from kvferry unless a real vLLM is installed. Idempotent;
    returns whether the surface is active."""
    if _FINDER in sys.meta_path:
        return True
    if real_vllm_installed():
        return False
    # First, before the path finder: it would otherwise load kvferry.vllm_compat's files a
    # second time under their vllm.* names.
    sys.meta_path.insert(0, _FINDER)
    return True


def uninstall() -> None:
    """Stop serving ``vllm.*`` and forget the aliases (modules already imported keep theirs)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n == _PREFIX or n.startswith(_PREFIX + ".")]:
        if getattr(sys.modules[name], "__name__", "").startswith(_TARGET):
            del sys.modules[name]


def is_vllm_style(connector_cls: type) -> bool:
    """True when the class or one of its bases is defined in a module that imports ``vllm``."""
    return any(_imports_vllm(c.__module__) for c in connector_cls.__mro__)


_MODULE_VERDICTS: dict[str, bool] = {}


def _imports_vllm(module_name: str) -> bool:
    if module_name.startswith("kvferry.") or module_name in ("builtins", "abc"):
        return False
    verdict = _MODULE_VERDICTS.get(module_name)
    if verdict is None:
        verdict = _MODULE_VERDICTS[module_name] = _source_imports_vllm(sys.modules.get(module_name))
    return verdict


def _source_imports_vllm(module: ModuleType | None) -> bool:
    if module is None:
        return False
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        if any(n == _PREFIX or n.startswith(_PREFIX + ".") for n in names):
            return True
    return False


def config_arg(connector_cls: type, config: Any) -> Any:
    """The ``vllm_config`` to ask ``connector_cls``'s classmethods with: vLLM's view over
    kvferry's config for a vLLM-style connector, kvferry's config otherwise."""
    if not is_vllm_style(connector_cls) or not install():
        return config
    views: Any = importlib.import_module(f"{_TARGET}.config")
    return views.VllmConfig.of(config)


def connector_args(connector_cls: type, config: Any, kv_cache_config: Any) -> tuple[Any, Any]:
    """The ``(vllm_config, kv_cache_config)`` to construct ``connector_cls`` with: vLLM's views
    over kvferry's objects for a vLLM-style connector, kvferry's objects otherwise."""
    if not is_vllm_style(connector_cls) or not install():
        return config, kv_cache_config
    views: Any = importlib.import_module(f"{_TARGET}.config")
    layouts: Any = importlib.import_module(f"{_TARGET}.v1.kv_cache_interface")
    return views.VllmConfig.of(config), layouts.KVCacheConfig.of(kv_cache_config)
