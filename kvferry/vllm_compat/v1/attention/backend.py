"""``vllm.v1.attention.backend``: kvferry's ``AttentionMetadata`` (``slot_mapping``,
``block_table``, ``seq_lens``, ``query_start_loc``, ...), shared by every layer of a step."""

from kvferry.model.attention_metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
