"""``vllm.v1.core.sched``: the scheduler's output types."""
