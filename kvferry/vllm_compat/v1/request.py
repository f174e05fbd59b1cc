"""``vllm.v1.request``: kvferry's ``Request`` and ``RequestStatus`` (vLLM's names)."""

from kvferry.request import Request, RequestStatus

__all__ = ["Request", "RequestStatus"]
