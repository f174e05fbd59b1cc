"""Leases on the blocks a prefill instance holds for decode instances.

A finished prefill request's blocks are *held* for ``lease`` seconds. A reader *claims* them
(side channel) before it reads; a claim names the exact blocks, token count and prompt
digest, and only one reader engine can hold a claim. Across tensor-parallel sizes several
ranks of that engine read the same blocks (a claim says how many: ``readers``); each claims
with its own transport agent, and the hold ends on READ completion only once every one of
them completed. Claims and heartbeats renew the lease (never
past ``max_hold`` seconds after the hold began). A hold ends, and its request is reported
``finished_sending`` so the scheduler frees the blocks, when:

* the claiming reader's READ-completion notification arrives (``complete``);
* the decode side releases it unread (``release``, refused while another reader's claim
  is active);
* its lease runs out (``reap``): a decode instance that never reads, or died, strands
  nothing.

One reader cannot pin the pool: a reader (its engine id and side-channel address) may keep at
most ``max_reader_blocks`` blocks (or one hold, however large) claimed or renewed at once.
Past that its claims are told to retry and its heartbeats renew nothing new, so the holds it asked for end at their lease.
No hold outlives ``max_hold`` whoever renews it.

The side-channel thread and the engine thread both use the table; one lock guards it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvferry.kv_transfer.connectors.pd.handshake import (
    Ack,
    ClaimRequest,
    Granted,
    PeerReply,
    Refused,
    ReleaseRequest,
    Renewed,
)

logger = logging.getLogger(__name__)

_MEMORY = 65536  # ended holds / expected ids remembered, for clear refusals
_MAX_RENEWERS = 8  # readers charged for one unclaimed hold (the least recent one makes room)


@dataclass
class Hold:
    req_id: str
    block_ids: list[int]
    num_tokens: int
    token_digest: str
    started: float
    deadline: float
    reader: str | None = None  # engine id of the claiming reader
    reader_agent: str | None = None  # the last claiming agent
    readers: int = 1  # agents of that engine expected to read (set by the first claim)
    agents: set[str] = field(default_factory=set)  # agents that claimed
    read_by: set[str] = field(default_factory=set)  # agents whose READ completed
    # Readers (identities) this hold counts against: its renewers, then only its claimer.
    charged: dict[str, None] = field(default_factory=dict)  # in order of last renewal


class LeaseTable:
    def __init__(
        self,
        engine_id: str,
        agent_name: str,
        lease_s: float,
        max_hold_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_reader_blocks: int | None = None,
        label: str = "P/D",
    ) -> None:
        self.label = label  # the transport family, for logs
        self.engine_id = engine_id
        self.agent_name = agent_name
        self.lease_s = lease_s
        self.max_hold_s = max_hold_s
        self.max_reader_blocks = max_reader_blocks  # None: no limit
        self._load: dict[str, int] = {}  # reader identity -> blocks it keeps claimed/renewed
        self._over: set[str] = set()  # identities at their limit (logged once each time)
        self._clock = clock
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # req id -> why it ended
        self._expected: OrderedDict[str, None] = OrderedDict()
        self._finished: dict[str, str] = {}  # ended since the last take_finished()

    # -- engine thread ---------------------------------------------------------------------

    def expect(self, req_ids: Iterable[str]) -> None:
        """Prefill requests now running here: a claim arriving before their hold is told to
        retry rather than that the request is unknown."""
        with self._lock:
            for req_id in req_ids:
                self._expected[req_id] = None
                self._expected.move_to_end(req_id)
            while len(self._expected) > _MEMORY:
                self._expected.popitem(last=False)

    def add(self, req_id: str, block_ids: list[int], num_tokens: int, digest: str) -> None:
        now = self._clock()
        with self._lock:
            self._expected.pop(req_id, None)
            self._ended.pop(req_id, None)
            self._holds[req_id] = Hold(
                req_id, list(block_ids), num_tokens, digest, now, now + self.lease_s
            )

    def complete(self, req_id: str, reader_engine_id: str, agent: str) -> bool:
        """A READ-completion notification from transport agent ``agent``: ends the hold if that
        reader had claimed it."""
        with self._lock:
            hold = self._holds.get(req_id)
            if hold is None or hold.reader != reader_engine_id or agent not in hold.agents:
                return False
            hold.read_by.add(agent)
            if len(hold.read_by) >= hold.readers:
                self._end(hold, f"read by engine {reader_engine_id}")
            return True

    def reap(self) -> list[str]:
        """End every hold whose lease ran out (the whole table: renewals reorder deadlines)."""
        now = self._clock()
        with self._lock:
            expired = [h for h in self._holds.values() if now >= h.deadline]
            for hold in expired:
                who = f"claimed by engine {hold.reader}" if hold.reader else "never claimed"
                self._end(hold, f"lease expired after {now - hold.started:.1f}s ({who})")
        for hold in expired:
            logger.warning(
                "%s: freeing the blocks of %s: its lease expired after %.1fs with no "
                "completed read (%s)",
                self.label,
                hold.req_id,
                now - hold.started,
                "claimed by engine " + hold.reader if hold.reader else "no reader came",
            )
        return [h.req_id for h in expired]

    def take_finished(self) -> dict[str, str]:
        """Holds ended since the last call: request id -> reason."""
        with self._lock:
            done, self._finished = self._finished, {}
            return done

    def drop_all(self) -> list[str]:
        with self._lock:
            ids = list(self._holds)
            for hold in list(self._holds.values()):
                self._end(hold, "engine shut down")
            return ids

    def num_held(self) -> int:
        with self._lock:
            return len(self._holds)

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((h.deadline for h in self._holds.values()), default=None)

    # -- side-channel thread ---------------------------------------------------------------

    def claim(self, req: ClaimRequest, peer: str = "") -> PeerReply:
        """``peer``: where the request came from, as the side channel knows it."""
        who = _identity(req.reader_engine_id, peer)
        with self._lock:
            hold, refusal = self._find(req.engine_id, req.request_id)
            if hold is None:
                return refusal
            mismatch = self._mismatch(hold, req.block_ids)
            if mismatch is None and req.num_tokens != hold.num_tokens:
                mismatch = f"it holds {hold.num_tokens} tokens, not {req.num_tokens}"
            if mismatch is None and req.token_digest != hold.token_digest:
                mismatch = "the reader's prompt differs from the prompt prefilled here"
            if mismatch is not None:
                return Refused(f"claim of {req.request_id!r} refused: {mismatch}")
            if hold.reader is not None and hold.reader != req.reader_engine_id:
                return Refused(
                    f"claim of {req.request_id!r} refused: engine {hold.reader} is reading it"
                )
            why = self._agent_refusal(hold, req)
            if why is not None:
                return Refused(f"claim of {req.request_id!r} refused: {why}")
            if not self._charge(hold, who):
                return Refused(
                    f"claim of {req.request_id!r} refused for now: reader "
                    f"{req.reader_engine_id} already keeps {self._load.get(who, 0)} blocks "
                    f"claimed or renewed here (limit {self.max_reader_blocks})",
                    retry=True,
                )
            self._uncharge(hold, [r for r in hold.charged if r != who])
            if hold.reader is None:
                hold.readers = req.readers
            hold.reader, hold.reader_agent = req.reader_engine_id, req.reader_agent
            if hold.readers == 1:
                hold.agents = {req.reader_agent}  # one reader: its latest agent (a restart)
            else:
                hold.agents.add(req.reader_agent)
            return Granted(self.agent_name, self._renew(hold))

    def heartbeat(
        self, engine_id: str, req_ids: Iterable[str], reader: str, peer: str = ""
    ) -> PeerReply:
        if engine_id != self.engine_id:
            return Refused(f"this is engine {self.engine_id}, not {engine_id}")
        held: dict[str, float] = {}
        read: list[str] = []
        done_by_reader = f"read by engine {reader}"
        who = _identity(reader, peer)
        with self._lock:
            for req_id in req_ids:
                hold = self._holds.get(req_id)
                if hold is None:
                    if self._ended.get(req_id) == done_by_reader:
                        read.append(req_id)
                elif hold.reader == reader or (hold.reader is None and self._charge(hold, who)):
                    held[req_id] = self._renew(hold)
        return Renewed(held, read)

    def load_of(self, reader: str, peer: str = "") -> int:
        """Blocks the reader keeps claimed or renewed here now."""
        with self._lock:
            return self._load.get(_identity(reader, peer), 0)

    def release(self, req: ReleaseRequest) -> PeerReply:
        with self._lock:
            hold, refusal = self._find(req.engine_id, req.request_id)
            if hold is None:
                # Releasing what is already gone is harmless (the proxy may release twice).
                return Ack(0) if not refusal.retry else refusal
            mismatch = self._mismatch(hold, req.block_ids)
            if mismatch is not None:
                return Refused(f"release of {req.request_id!r} refused: {mismatch}")
            if hold.reader is not None and hold.reader != req.reader_engine_id:
                return Refused(
                    f"release of {req.request_id!r} refused: engine {hold.reader} is reading it"
                )
            self._end(hold, f"released by engine {req.reader_engine_id}")
            return Ack(1)

    # -- internals (lock held) -------------------------------------------------------------

    def _find(self, engine_id: str, req_id: str) -> tuple[Hold | None, Refused]:
        if engine_id != self.engine_id:
            return None, Refused(f"this is engine {self.engine_id}, not {engine_id}")
        hold = self._holds.get(req_id)
        if hold is not None:
            return hold, Refused("")
        if req_id in self._ended:
            return None, Refused(f"the blocks of {req_id!r} are freed: {self._ended[req_id]}")
        if req_id in self._expected:
            return None, Refused(f"{req_id!r} is still being prefilled", retry=True)
        return None, Refused(f"engine {self.engine_id} holds no blocks for request {req_id!r}")

    @staticmethod
    def _agent_refusal(hold: Hold, req: ClaimRequest) -> str | None:
        """Why a claim by one more rank of the reading engine cannot join the hold."""
        if hold.reader is None:
            return None
        if req.readers != hold.readers:
            return f"it was claimed for {hold.readers} readers, not {req.readers}"
        joining = hold.readers > 1 and req.reader_agent not in hold.agents
        if joining and len(hold.agents) >= hold.readers:
            return f"its {hold.readers} readers claimed it already"
        return None

    @staticmethod
    def _mismatch(hold: Hold, block_ids: list[int]) -> str | None:
        if block_ids != hold.block_ids:
            return f"it holds other blocks for {hold.req_id!r} than the ones named"
        return None

    def _renew(self, hold: Hold) -> float:
        """Extend the lease (within max_hold_s); returns the seconds it has left."""
        now = self._clock()
        hold.deadline = max(hold.deadline, min(now + self.lease_s, hold.started + self.max_hold_s))
        return max(0.0, hold.deadline - now)

    def _charge(self, hold: Hold, who: str) -> bool:
        """Count ``hold`` against reader ``who`` unless that takes it past its limit."""
        if who in hold.charged:
            del hold.charged[who]
            hold.charged[who] = None  # the most recent renewer now
            return True
        cap = self.max_reader_blocks
        had = self._load.get(who, 0)
        load = had + len(hold.block_ids)
        if cap is not None and load > cap and had:  # one hold is always allowed
            if who not in self._over:
                self._over.add(who)
                logger.warning(
                    "%s: reader %s keeps %d blocks claimed or renewed here, the most one "
                    "reader may (max_reader_share); its further claims wait and renewals are "
                    "ignored",
                    self.label,
                    who,
                    had,
                )
            return False
        if len(hold.charged) >= _MAX_RENEWERS:
            self._uncharge(hold, [next(iter(hold.charged))])
        self._load[who] = load
        hold.charged[who] = None
        return True

    def _uncharge(self, hold: Hold, readers: Iterable[str] | None = None) -> None:
        """Stop counting ``hold`` against ``readers`` (default: all it is charged to)."""
        for who in list(hold.charged if readers is None else readers):
            del hold.charged[who]
            left = self._load.get(who, 0) - len(hold.block_ids)
            if left > 0:
                self._load[who] = left
            else:
                self._load.pop(who, None)
                self._over.discard(who)

    def _end(self, hold: Hold, reason: str) -> None:
        self._uncharge(hold)
        del self._holds[hold.req_id]
        self._finished[hold.req_id] = reason
        self._ended[hold.req_id] = reason
        while len(self._ended) > _MEMORY:
            self._ended.popitem(last=False)


def _identity(reader: str, peer: str) -> str:
    """Who a reader is for the per-reader limit: its engine id, and its host when known (a
    port would differ between its connections)."""
    host, _, port = peer.rpartition(":")
    return f"{reader}@{host if host and port.isdigit() else peer}" if peer else reader
