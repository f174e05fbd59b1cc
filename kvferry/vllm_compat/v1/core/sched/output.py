"""``vllm.v1.core.sched.output``: kvferry's ``SchedulerOutput``, ``NewRequestData`` and
``CachedRequestData``, which carry vLLM's field names (and aliases where kvferry's differ)."""

from kvferry.step_types.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)

__all__ = ["CachedRequestData", "NewRequestData", "SchedulerOutput"]
