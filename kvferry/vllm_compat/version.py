"""The vLLM version whose connector API the surface follows, marked as kvferry's."""

__version__ = "0.33.0+kvferry"
__version_tuple__ = (0, 33, 0, "kvferry")
