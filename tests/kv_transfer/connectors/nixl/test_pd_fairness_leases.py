"""Fair P/D on the prefill side (issue 11): one reader cannot keep more than its share of
the pool renewed or claimed, and nothing outlives the maximum hold."""

from __future__ import annotations

import pytest

from kvferry.kv_transfer.connectors.pd import handshake as hs
from kvferry.kv_transfer.connectors.pd.lease import LeaseTable

pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")


# -- prefill side: per-reader limits ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _claim(req_id: str, blocks: list[int], reader: str) -> hs.ClaimRequest:
    return hs.ClaimRequest("P", req_id, blocks, 16 * len(blocks), "d", reader, f"agent-{reader}")


def test_one_reader_cannot_pin_the_pool():
    clock = Clock()
    t = LeaseTable("P", "agent-P", lease_s=10, max_hold_s=60, clock=clock, max_reader_blocks=4)
    for i, blocks in enumerate(([1, 2], [3, 4], [5, 6])):
        t.add(f"r{i}", blocks, 32, "d")
    # An outsider renews everything it can name: only up to its limit.
    renewed = t.heartbeat("P", ["r0", "r1", "r2"], "X", "10.0.0.9")
    assert isinstance(renewed, hs.Renewed) and sorted(renewed.held) == ["r0", "r1"]
    assert t.load_of("X", "10.0.0.9") == 4
    reply = t.claim(_claim("r2", [5, 6], "X"), "10.0.0.9")
    assert isinstance(reply, hs.Refused) and reply.retry and "limit 4" in reply.reason
    # Another reader is not affected, and its claim takes a hold the outsider was renewing.
    assert isinstance(t.claim(_claim("r0", [1, 2], "D"), "10.0.0.2"), hs.Granted)
    assert t.load_of("X", "10.0.0.9") == 2 and t.load_of("D", "10.0.0.2") == 2
    renewed = t.heartbeat("P", ["r0", "r1", "r2"], "X", "10.0.0.9")
    assert isinstance(renewed, hs.Renewed) and sorted(renewed.held) == ["r1", "r2"]
    # Whoever renews, nothing outlives max_hold; then nobody is charged any more.
    while t.num_held():
        clock.t += 5
        t.heartbeat("P", ["r1", "r2"], "X", "10.0.0.9")
        t.heartbeat("P", ["r0"], "D", "10.0.0.2")
        t.reap()
    assert clock.t - 100 <= 60
    assert t.load_of("X", "10.0.0.9") == 0 and t.load_of("D", "10.0.0.2") == 0
    # Many identities renewing one hold: the least recent makes room, so a legitimate
    # renewer always gets in; connections from one host count as one reader.
    t.add("s", [7], 16, "d")
    for i in range(20):
        t.heartbeat("P", ["s"], f"forged-{i}", "10.0.0.9")
    assert t.load_of("forged-0", "10.0.0.9") == 0 and t.load_of("forged-19", "10.0.0.9") == 1
    assert "s" in t.heartbeat("P", ["s"], "D", "10.0.0.2:41000").held  # type: ignore[union-attr]
    assert t.load_of("D", "10.0.0.2:52000") == 1
    # A hold larger than the limit can still be read (by one reader at a time).
    t.add("big", list(range(10, 20)), 160, "d")
    assert isinstance(t.claim(_claim("big", list(range(10, 20)), "E"), "10.0.0.3"), hs.Granted)
