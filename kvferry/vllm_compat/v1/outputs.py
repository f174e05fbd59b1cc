"""``vllm.v1.outputs``: kvferry's ``KVConnectorOutput`` (vLLM 0.33's fields)."""

from kvferry.step_types.kv_connector_output import KVConnectorOutput

__all__ = ["KVConnectorOutput"]
