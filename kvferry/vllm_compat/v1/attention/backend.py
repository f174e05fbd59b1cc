"""``vllm.v1.attention.backend``: kvferry's ``AttentionMetadata`` (``slot_mapping``,
``block_table``, ``seq_lens``, ``query_start_loc``, ...), one per KV cache group of a step."""

from kvferry.model.attention_metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
