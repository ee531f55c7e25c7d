"""The interface between the request service and a replication engine.

The service decides an entry on the master (`Store.decide_*`) and hands it
to `Engine.propose(entry, done)`. The engine appends it to the log under the
current vote_id, applies it to the master's store at once (so that the next
decision sees it), and calls `done(result, None)` when the entry is committed
in the engine's sense (quorum: stored on a majority; async: appended), or
`done(None, reason)` when it never will be (the master lost its role). Until
`done` runs, the client hears nothing: this is what makes an acknowledged
write durable.

This module does no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..state.entries import Entry
from ..stats import Histogram

__all__ = ["Engine", "EngineStatus", "LeaderInfo", "Done", "JsonObject", "Respond",
           "ForwardedHandler", "AnswerNow", "FatalHandler", "RoleHandler", "Cancel",
           "FORWARD_TIMEOUT_S", "Session", "Role", "TransferDone"]

# A client's request or answer: a decoded JSON object.
JsonObject = dict[str, Any]
# done(result, error): result is what Store.apply returned for the entry
# (its type depends on the entry's kind: see Store.apply); error a reason.
Done = Callable[[Any, "str | None"], None]
# Sends one answer to a client.
Respond = Callable[[JsonObject], None]
# A forwarded request that the master has not answered in this time is
# answered "forward timeout" (the write may or may not have happened). Long
# enough for a quorum write on a loaded cluster, short enough that a client
# of a master that hangs without dropping its links hears something. A
# consume that may wait is given its `wait` on top.
FORWARD_TIMEOUT_S = 10.0

# Drops something that waits for an answer (a forwarded request, a parked
# consume): its answer will never be sent.
Cancel = Callable[[], None]


class Session:
    """What a client connection has waiting (parked consumes, forwarded
    requests that may park): when the client goes, `close()` cancels each,
    so that nothing is taken for a consumer that is gone. UDP requests
    have no session (a datagram's sender cannot be seen to go)."""

    __slots__ = ("_cancels", "closed", "_next")

    def __init__(self) -> None:
        self._cancels: dict[int, Cancel] = {}  # key -> cancel, while it waits
        self.closed = False
        self._next = 0

    def add(self, cancel: Cancel) -> int:
        """Register a wait; returns the key that `discard` takes once it is
        answered."""
        self._next += 1
        self._cancels[self._next] = cancel
        return self._next

    def discard(self, key: int) -> None:
        self._cancels.pop(key, None)

    def close(self) -> None:
        """The client went: cancel everything still waiting."""
        self.closed = True
        cancels = list(self._cancels.values())
        self._cancels.clear()
        for cancel in cancels:
            cancel()

    def __len__(self) -> int:
        return len(self._cancels)


# The node's service, for a request a slave forwarded: (request, now_ms,
# respond, session); the session is closed if the slave's client goes.
ForwardedHandler = Callable[[JsonObject, int, Respond, Session | None], None]
# The service's fast path for a forwarded request (Service.answer_now): its
# answer at once, or None for the handler to take it.
AnswerNow = Callable[[JsonObject, int], JsonObject | None]
# Told when the engine cannot go on (a write or fsync failed): the node stops.
FatalHandler = Callable[[BaseException], None]
# Told when this node becomes master (True) or stops being master (False).
RoleHandler = Callable[[bool], None]
# Told how a leader transfer ended: (new master's node id, None) or (None,
# reason); see Engine.transfer_leader.
TransferDone = Callable[[int | None, str | None], None]


class Role(enum.Enum):
    """A node's role in replication."""

    SLAVE = "slave"
    CANDIDATE = "candidate"  # electing, or elected and not yet deciding
    MASTER = "master"


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaderInfo:
    """Where clients reach the master: its node id and client address."""

    node_id: int
    host: str
    port: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStatus:
    """What monitor reports about replication on this node."""

    role: Role
    vote_id: int  # current election epoch
    trans_id: int  # last trans_id in this node's log
    commit_id: int  # last trans_id known committed
    applied_id: int  # last trans_id applied to the store
    log_size: int  # records retained in memory
    # What readiness needs (Service.health); an engine that cannot tell
    # keeps the defaults. in_contact: a master heard from a majority (itself
    # included) within an election timeout; a slave heard from its master
    # within one. A master or slave cut off from the majority keeps its
    # role and its master for a while (a stopped peer's link stays up), so
    # the role alone does not say that this node sees a working cluster.
    in_contact: bool = True
    # The master's commit position as this node last heard it (a slave's
    # commit_id stops at the end of its own log, which may be far behind);
    # None: commit_id is the best known.
    master_commit_id: int | None = None


class Engine(Protocol):
    """A replication engine, as the node and the service use it: everything
    they call is here (nothing is probed with hasattr)."""

    # Whether this node is the master now. A plain attribute or a property:
    # the service reads it on every request.
    @property
    def is_master(self) -> bool: ...

    # True while the engine answers every entry as it is appended: always
    # for one node without storage (always master); for the native engine's
    # master alone with storage or in async mode (fsync off or batch) while
    # its log has room.
    # The service reads it on every request, and calls `commit_now` instead
    # of `propose` while it holds; it answers reads at once then too (the
    # engine waits for nobody: a lone node's state is committed, an async
    # master answers reads at once anyway).
    commits_at_once: bool

    # Set by the node before `start`: how a request that a slave forwarded
    # to this node is answered (the service), and what happens when the
    # engine cannot go on (the node stops at once).
    handle_forwarded: ForwardedHandler | None
    answer_forwarded_now: AnswerNow | None  # tried first (a request that may wait: never)
    on_fatal: FatalHandler | None
    on_role_change: RoleHandler | None
    # Set by the node: called by an engine that has just run a batch of
    # answers at the end of a loop turn (a commit's), so that the answered
    # connections are written at once instead of in one more loop turn.
    # An engine may never call it: the node then writes them at the end of
    # the turn (Node.flush_at_turn_end).
    on_answered: Callable[[], None] | None

    # While master: a positive number that no other master ever uses (the
    # native engine's vote_id; the raft engine's epoch): receipts carry it.
    @property
    def epoch(self) -> int: ...

    async def start(self) -> None:
        """Open links, timers and threads (on the running loop). Raises
        OSError if a port is taken."""

    async def close(self) -> None:
        """Orderly stop: fail what waits, close links, flush and close the
        storage."""

    def halt(self) -> None:
        """A fatal error elsewhere in the node: carry out nothing more
        (no write, send or answer); `close` then leaves the storage as a
        crash would."""

    def leader(self) -> LeaderInfo | None:
        """The current master, or None while none is known."""

    def propose(self, entry: Entry, done: Done) -> None:
        """Replicate `entry` (master only); call `done` when it is decided."""

    def commit_now(self, entry: Entry) -> Any:
        """Append, apply and commit `entry` at once and return what apply
        returned (only when `commits_at_once`)."""

    def read_index(self, done: Done) -> None:
        """Call `done(None, None)` once everything this master's state holds
        now is committed and it is known to have been master now (Raft's
        read index), `done(None, reason)` if it loses its role first. For
        answers that append no entry (master only)."""

    def forward(self, request: JsonObject, respond: Respond,
                timeout_s: float | None = None) -> Cancel | None:
        """Relay a client request to the master (slaves only); `respond`
        gets the master's answer, or a failure if none comes within
        `timeout_s` (forwarding.FORWARD_TIMEOUT_S if None). Returns what
        cancels it (the client went: the master drops it, `respond` is not
        called); None when no master is reachable, in which case `respond`
        is never called."""

    def transfer_leader(self, node_id: int, done: TransferDone) -> None:
        """Hand the master role to `node_id` (a leader transfer: it starts
        an election at once and wins it). `done(new_master_id, None)` once
        this node has seen a new master take over (normally `node_id`;
        another node if an election intervened); `done(own id, None)` at
        once for this node itself when it is master; else `done(None,
        reason)`, reason one of "not master", "no such node" (not a member
        of the cluster), "node not caught up" (it did not hold the master's
        whole log within an election timeout), "transfer timed out" (no new
        master within an election timeout of the hand-over), "transfer in
        progress" (one to another node is under way; one to the same node
        is joined). While a transfer is under way the master appends
        nothing: every write (a proposal, and `commits_at_once` is off) is
        refused at once with "no leader", which clients retry elsewhere;
        reads are answered as before (not by the raft engine in quorum
        mode, whose reads append a marker entry: "no leader" too). A master
        whose transfer failed takes writes again. May call `done` before
        returning."""

    def transfer_target(self) -> int | None:
        """The most up-to-date slave now, as a master sees it (for drain);
        None on a slave or when no slave answers."""

    def status(self) -> EngineStatus:
        """What monitor reports about replication on this node."""

    def slaves(self) -> list[JsonObject] | None:
        """Per slave, what monitor shows on a master (None: no replication)."""

    def snapshot_info(self) -> JsonObject | None:
        """What monitor shows about snapshots (None: nothing to show)."""

    def storage_info(self) -> JsonObject | None:
        """What monitor shows about the log on disk (None without storage)."""

    def timings(self) -> dict[str, Histogram]:
        """Histograms of the engine's own waits, for metrics: "fsync" (a
        log fsync, from its start to its end) and "snapshot_pause" (the
        event loop's pause to start a snapshot); one the engine does not
        have is left out."""
