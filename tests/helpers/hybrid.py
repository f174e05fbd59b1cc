"""A fake worker that checks KV *content* across hybrid KV cache groups.

:class:`KVContentWorker` is a :class:`~tests.helpers.scheduler.FakeWorker` that also keeps,
per block id of the shared pool (the groups' layers share KV tensors), which token's KV each
slot holds. Before a step's tokens are "computed" it checks that every position they read
holds the right KV in the worker's own tables: all earlier positions for a full-attention
group, the last ``window - 1`` for a sliding-window one. A block the scheduler gave back
while a window still reads it, and that another request then overwrote, fails the check.
"""

from __future__ import annotations

from kvferry.step_types.runner_output import ModelRunnerOutput
from kvferry.step_types.scheduler_output import SchedulerOutput
from tests.helpers.scheduler import FakeWorker, _WorkerReq


def _markers(token_ids: list[int], end: int) -> list[int]:
    """One id per position naming the KV there: the hash of the tokens up to it (KV depends
    on the whole prefix, so requests sharing a prefix share markers)."""
    out, h = [], 0
    for t in token_ids[:end]:
        h = hash((h, t))
        out.append(h)
    return out


class KVContentWorker(FakeWorker):
    def __init__(self, scheduler, token=7) -> None:  # type: ignore[no-untyped-def]
        super().__init__(scheduler, token)
        managers = scheduler.kv_cache_manager.managers
        self.windows = [m.spec.sliding_window for m in managers]
        self.slots: dict[int, int] = {}  # block_id * block_size + offset -> marker
        self.checked_positions = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute(so)
        for req_id, n in so.num_scheduled_tokens.items():
            self._compute(self.reqs[req_id], n)
        return out

    def _compute(self, state: _WorkerReq, n: int) -> None:
        end = state.num_computed_tokens
        start = end - n
        marks = _markers(state.token_ids, end)
        bs = self.block_size
        for table, window in zip(state.groups, self.windows, strict=True):
            first = 0 if window is None else max(0, start - window + 1)
            for p in range(first, start):
                slot = table[p // bs] * bs + p % bs
                assert self.slots.get(slot) == marks[p], f"wrong KV at position {p}"
                self.checked_positions += 1
            for p in range(start, end):
                self.slots[table[p // bs] * bs + p % bs] = marks[p]
