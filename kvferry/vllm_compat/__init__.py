"""kvferry's ``vllm`` import surface: modules at vLLM's paths (``kvferry.vllm_compat.X.Y`` is
served as ``vllm.X.Y`` when vLLM is not installed; see ``kvferry.kv_transfer.vllm_imports``).

Every name is kvferry's own object or a view over one, never a copy, following vLLM 0.33's
published names. Importing this package imports nothing else.
"""

from kvferry.vllm_compat.version import __version__, __version_tuple__

__all__ = ["__version__", "__version_tuple__"]
