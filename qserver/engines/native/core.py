"""The native replication engine: queue_server's design, made safe.

Theory of operation
-------------------
Each node runs one `NativeCore`. It takes events in (`tick(now_ms)`,
`step(msg, now_ms)`, `propose(entry, done)`, `link_up(peer)`,
`synced_to(trans_id)`) and collects what the node must do in a `Ready`
(`take_ready(now_ms)`): persist the vote, persist the log change (and fsync
it as `Ready.own_sync` says), send messages, then answer clients, in that
order.
It never reads a clock, a socket or a random source of its own: time comes
in as `now_ms`, randomness from the `random.Random` it is given.

Roles. An odd number of nodes; a node is SLAVE, CANDIDATE or MASTER. There is
at most one master per `vote_id` (the election epoch).

Election (ballot = (last entry's vote_id, last entry's trans_id), vote_id,
node_id, compared in that order). A slave that has not heard from a master
for a randomized election timeout first asks for pre-votes at vote_id + 1;
nobody changes state for a pre-vote. With a majority of pre-votes it starts
the real election: vote_id + 1, a vote for itself (persisted before anything
is sent), and a VoteRequest to every peer. A voter grants at most one vote
per vote_id (persisted before the reply), only to a candidate whose log
position is at least its own (the up-to-date rule: comparing the last
entry's epoch first is what stops a deposed master with a longer but older
log from winning), and never while it hears from a live master. A majority
of votes makes the candidate master; it appends a Noop so that entries of
earlier epochs commit. A master that has not heard from a majority within an
election timeout steps down.

Replication (push, then pull). The master appends each proposed entry to its
log under its vote_id and applies it to its store at once, keeping an undo
record until the entry commits, so that the next decision sees it. Everything
appended in one turn is pushed as one `Push` to each slave that is in step,
with the position of the entry before it (in async mode, where no client
waits for a push, the records of several turns may go together: at most
one push of new records per `push_interval_ms`; in quorum mode, where a
commit needs quorum - 1 slaves, the spare slaves beyond those that keep up
get the new records every SPARE_PUSH_MS, which spares them and the master a
message and a wake-up per turn). A slave whose log continues at that
position appends (replacing any conflicting uncommitted suffix) and answers
`PushReply(match_id)`. Otherwise it ignores the batch and sends `Pull` with
a position of its log; the master answers with the records after the last
common position it can find, as many as the slave's `sync_rate` budget
allows. A slave whose log ends before the master's retained log receives a
`Snapshot`.

Commit. The master's commit position is the highest trans_id stored on a
majority whose entry carries the current vote_id (or any entry before it).
Slaves apply only committed entries. In quorum mode a client is answered
when its entry commits; in async mode as soon as it is appended (what
queue_server did: faster, and the last entries can be lost on failover).
A master that steps down before its entries commit answers their clients
with an error ("outcome unknown"), rolls back nothing yet, and undoes them
only if the new master's log truncates them.

Reads (Raft's read index). An answer that appends no entry (a confirm of an
unknown id, an empty consume, monitor, list) is computed from the master's
store, which holds its uncommitted entries too, and from a master that may
already have been replaced without knowing it. In quorum mode such an answer
waits (`read_index`) until (1) every entry appended before it was asked for
is committed, and (2) a majority has answered a push sent after it was asked
for, still in this master's epoch: pushes carry `read_round`, slaves echo
it. By (2) no newer master existed when the read was asked for (its voters
and our repliers would share a node, whose vote_id never goes back), so the
master's state then held every committed entry; by (1) nothing it showed
can be undone. A master that steps down first answers "outcome unknown".
Reads asked for in one turn share one round; a write's push serves as it.

Our own copy on disk (the sync contract; etcd raft's storage
acknowledgement). The node writes a Ready's records before anything of it
is sent; when they are fsynced is the node's business (its fsync policy:
engines.native.durability), but `Ready.own_sync` says what the core's
counting assumes, for fsync=always to deliver:
- BEFORE_SEND: the core counts our records as stored once written (a
  slave's PushReply vouches for them, and so does a master without
  `deferred_sync`): they must be durable before this Ready's messages and
  answers go.
- NOW, MAY_WAIT (a master with `deferred_sync`: fsync=always in quorum
  mode): its records go out before its own fsync (Raft thesis 10.2.1), and
  it counts itself towards a majority only up to `durable_id`. NOW: the
  sync must start at once, as the slaves alone cannot make a majority
  (fewer than `quorum` keep up: everything pushed to them, a push of this
  epoch answered, heard from within two heartbeats). MAY_WAIT: they can
  (or nothing written is left unsynced), so the sync may wait for the
  node's batch timer; it counts once done, so a slave that stops answering
  delays commits by that much at most.
`own_sync` is decided in `take_ready`, after its pushes, so the node never
asks the core in the middle of carrying out a Ready. The node reports a
finished sync with `synced_to(trans_id)` (every record up to trans_id is
on stable storage), an input like `step`, at any time, even while it
carries out a Ready; what it releases (commits, answers) comes out in the
next Ready. A sync begun before the node carried out a truncation or a
snapshot install must not be reported (the records it covered may have been
replaced); `synced_to` never counts past the log's end.

Leader transfer (Raft's TimeoutNow; `transfer_leader`). The master stops
taking writes (`propose` answers "no leader", which clients retry
elsewhere; `append_now` is off; reads go on), so that its log stops
growing. The target catches up by the usual pushes and pulls; once its
match_id and the commit position are both the master's last trans_id (so
every write answered so far is committed, and the target holds it all),
the master sends it `TimeoutNow` (again with every heartbeat, in case it
was lost). The target, if it still follows that master in that epoch and
its log reaches the position the message names, starts an election at
once: no timeout, no pre-vote, and its VoteRequest says `transfer`, so that
voters answer it although they hear from a live master (the master itself
too: it steps down on the higher vote_id and votes). Its ballot is at least
every other's in log position (nobody holds an entry it lacks), so it
wins unless messages are lost. The old master reports the new master once
a push of a later epoch reaches it. Bounds: the target must be caught up
within an election timeout of the request ("node not caught up"), and a
new master must be seen within an election timeout of the TimeoutNow
("transfer timed out"); either way a master that still holds its role
takes writes again. Safety does not depend on the transfer: it only starts
an election early, with the usual ballots and one vote per vote_id.

A stall (`stalled`). Silence is judged by the clock: a slave elects
itself once its master has been quiet for an election timeout, and a master
steps down once a majority has not answered it for as long (check-quorum).
A node that could not run for a while (a long garbage collection, a paused
process or VM, an overloaded host) heard nothing meanwhile, through no
fault of the others; when every node of a cluster stalls together (one
host), each finds the others silent on its first tick after it (a paused
process runs its expired timers before it reads its sockets), and the
master stepped down at once. The adapter reports such a stall (its timer
fired that late) with `stalled(ms, now_ms)` before the tick: the times
that judge silence move on by that much, as if the stall had not happened,
but never past now (a stall inside a callback is followed by a read of the
sockets before the timer: what that read set is not moved again).
Heartbeats are not delayed. A master whose stall was long enough for the
slaves to elect another (an election timeout less two heartbeats) takes no
write (`propose` answers "no leader", as during a transfer) from `stalled`
until a majority has echoed a read round sent after it, which takes a
round trip: in async mode a write it answered at once, if it had been
replaced, would be lost. (Writes read before the adapter learns of the
stall, after a stall inside a callback, are taken as before.) Only
liveness depends on all this: ballots and majorities, not clocks, make the
role changes safe.

Invariants (checked by the simulated-network tests after every delivery):
at most one master per vote_id; a master holds every committed entry; two
logs with the same (vote_id, trans_id) entry are identical up to it; every
node applies the same entries in the same order.

This module does no I/O.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from ...errors import InvariantError
from ...state.entries import Entry, Noop, Record, entry_weight
from ...state.log import COMPACT_SLACK, LONE_LOG_RECORDS, Log
from ...state.store import SnapshotLoader, Store
from ..base import Done, EngineStatus, JsonObject, LeaderInfo, Role, TransferDone
from ..messages import (
    Hello,
    Message,
    Ping,
    Pull,
    Push,
    PushReply,
    Snapshot,
    TimeoutNow,
    VoteReply,
    VoteRequest,
)

__all__ = ["Role", "Timing", "OwnSync", "Ready", "NativeCore", "roll_back", "OUTCOME_UNKNOWN",
           "TRANSFERRING", "NOT_MASTER", "NO_SUCH_NODE", "NOT_CAUGHT_UP", "TRANSFER_TIMED_OUT",
           "TRANSFER_IN_PROGRESS"]

OUTCOME_UNKNOWN = "master changed before the write committed; outcome unknown"

# Leader transfer. A write to a master that is handing its role over is
# refused with the reason clients retry on, on another node, after a short
# backoff (qserver.client's NO_LEADER): the same answer a node gives while
# an election runs.
TRANSFERRING = "no leader"
# transfer_leader's failures (Engine.transfer_leader).
NOT_MASTER = "not master"
NO_SUCH_NODE = "no such node"
NOT_CAUGHT_UP = "node not caught up"
TRANSFER_TIMED_OUT = "transfer timed out"
TRANSFER_IN_PROGRESS = "transfer in progress"  # to another node than the one asked

# The most records one Push may carry, whatever the sync_rate budget: keeps
# one message (and one event-loop turn on both ends) small.
MAX_BATCH_RECORDS = 2_000
# ...and about the most bytes (entries.entry_weight): a batch produce is up
# to a request's size (1 MiB by default), so 2,000 of them would pass the
# peers' frame limit (64 MiB), which a push must stay far below.
MAX_BATCH_BYTES = 8 * 1024 * 1024
# Snapshots written on demand (snapshots_on_demand): the log is held past
# the newest snapshot, for a slave catching up from it, until it holds this
# many log_size runs of entries after it (and while a snapshot is wanted,
# not compacted at all: see _maybe_compact).
ON_DEMAND_HOLD_LOGS = 2
# Async mode with coalesced pushes (push_interval_ms): this many new records
# are pushed at once, whatever the interval.
PUSH_AT_ONCE_RECORDS = 500
# Quorum mode: the slaves beyond the quorum - 1 that get every turn's push
# (the spare ones) get new records at most this often, or once
# PUSH_AT_ONCE_RECORDS wait for them. Each of these pushes costs the master
# a timer, a flush and a frame, and the spare a wake-up, while no commit
# waits for it: 10 ms, not 2, took a quorum master's cluster from 148.7 to
# 133.5 us of CPU per request (8 TCP clients, 12 alternated rounds). A spare
# that must stand in for an eager slave gone silent does so within two
# heartbeats (_push_new), meanwhile commits wait up to this long for it.
SPARE_PUSH_MS = 10


def _within_bytes(records: Sequence[Record]) -> int:
    """How many of `records`, from the first, fit in MAX_BATCH_BYTES (at
    least one). O(len(records))."""
    total = 0
    for n, record in enumerate(records):
        total += entry_weight(record.entry)
        if total > MAX_BATCH_BYTES and n:
            return n
    return len(records)


class Rng(Protocol):
    """The randomness the core needs, given by its owner (a seeded
    random.Random in tests, a fresh one in the node)."""

    # positional-only: random.Random's first parameter is named `start`
    def randrange(self, stop: int, /) -> int: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """Protocol timers, in ms. An election timeout is drawn uniformly from
    [election_ms, 2 * election_ms)."""

    heartbeat_ms: int = 100  # master heartbeat and slave ping period
    election_ms: int = 1000  # no master heard for this long -> elect
    pull_retry_ms: int = 300  # a repeated pull of the same position waits this long


class OwnSync(enum.Enum):
    """How the core relies on the fsync of our own log ("Our own copy on
    disk" in the module docstring); what fsync=always must deliver."""

    BEFORE_SEND = "before send"  # durable before the Ready's messages and answers go
    NOW = "now"  # deferred: start the sync at once; report it with synced_to
    MAY_WAIT = "may wait"  # deferred, the slaves make a majority (or all synced): the batch timer


@dataclass(slots=True)
class Ready:
    """What the node must do, in this order: persist `vote`, persist the log
    change (`truncate_after`, then `records`) and fsync it as `own_sync`
    says, send `messages`, run `answers`."""

    vote: tuple[int, int] | None = None  # (vote_id, voted_for) to persist
    truncate_after: int | None = None  # drop persisted records after this trans_id
    records: list[Record] = field(default_factory=list)  # to append to the log on disk
    # (trans_id, vote_id, state) installed from the master; state as in
    # messages.Snapshot: Store.to_wire(), or the loader a file was decoded into
    snapshot: tuple[int, int, Sequence[Any] | SnapshotLoader] | None = None
    # external snapshots: (to node_id, trans_id, vote_id) of our snapshot file to stream to a slave
    snapshot_sends: list[tuple[int, int, int]] = field(default_factory=list)
    messages: list[tuple[int, Message]] = field(default_factory=list)  # (to node_id, message)
    answers: list[Callable[[], None]] = field(default_factory=list)
    # decided by take_ready; says nothing to do by itself (not in __bool__)
    own_sync: OwnSync = OwnSync.BEFORE_SEND

    def __bool__(self) -> bool:
        return bool(self.vote or self.truncate_after is not None or self.records
                    or self.snapshot or self.messages or self.answers or self.snapshot_sends)


class _Peer:
    """What the master (and everyone) knows about one other node."""

    __slots__ = ("node_id", "heard_ms", "sent_upto", "match_id", "acked_ms", "tokens",
                 "client", "pending_pull", "round_sent", "read_acked", "spare")

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.heard_ms = -1  # last time any message came from it
        self.sent_upto = 0  # master: last trans_id sent to it (optimistic)
        self.match_id = 0  # master: highest trans_id known to match our log
        self.acked_ms = -1  # master: last reply to our pushes (check-quorum)
        self.tokens = 0.0  # master: pull budget in records (sync_rate)
        self.client: LeaderInfo | None = None  # its client address (from Hello)
        self.pending_pull: Pull | None = None  # master: a pull waiting for budget
        self.round_sent = 0  # master: read_round of the last push sent to it
        self.read_acked = 0  # master: highest read_round it echoed in this epoch
        # master, quorum mode: a spare slave, which follows our pushes but
        # gets new records only every SPARE_PUSH_MS (its sent_upto may be
        # behind pushed_upto)
        self.spare = False


class _Transfer:
    """A leader transfer under way (see "Leader transfer" in the module
    docstring)."""

    __slots__ = ("target", "vote_id", "due_ms", "sent", "dones")

    def __init__(self, target: int, vote_id: int, due_ms: int, done: TransferDone) -> None:
        self.target = target  # the node the role goes to
        self.vote_id = vote_id  # our epoch when it began: a master of a later one ends it
        self.due_ms = due_ms  # catch-up, then hand-over, must be done by then
        self.sent = False  # TimeoutNow sent: the target was caught up
        self.dones = [done]  # told how it ended (one request per asker)


def roll_back(store: Store, undo: deque[tuple[int, list[Any]]], applied_id: int,
              commit_id: int, trans_id: int) -> int:
    """Undo the entries applied to `store` after `trans_id` (all uncommitted:
    not below `commit_id`), newest first, taking their records from the end
    of `undo`; returns the new applied position (trans_id). NativeCore's
    rollback, and what a forked snapshot writer does to its copies of the
    store and the undo records (`prepare_snapshot`; the simulation's writer
    copies only those two, as a fork would)."""
    if trans_id < commit_id:
        raise InvariantError(f"rollback to {trans_id} below commit {commit_id}")
    while applied_id > trans_id:
        if not undo or undo[-1][0] != applied_id:
            raise InvariantError(f"no undo record for applied entry {applied_id}")
        _, ops = undo.pop()
        store.revert(ops)
        applied_id -= 1
    return applied_id


class NativeCore:
    """One node's replication state machine (see the module docstring)."""

    def __init__(self, *, node_id: int, peer_ids: list[int], store: Store, log: Log,
                 me: LeaderInfo, rng: Rng, now_ms: int, timing: Timing = Timing(),
                 async_mode: bool = False, sync_rate: int = 3000, log_size: int = 100_000,
                 vote_id: int = 0, voted_for: int = 0, external_snapshots: bool = False,
                 deferred_sync: bool = False, push_interval_ms: int = 0,
                 snapshot: tuple[int, int] | None = None,
                 snapshots_on_demand: bool = False) -> None:
        # `snapshot`: (trans_id, vote_id) of the newest snapshot when the
        # log's base is past it (a node alone that applied the log after it
        # as it was read back: the store holds everything up to the base);
        # None: the log's base.
        self.node_id = node_id
        self.me = me
        self.peers: dict[int, _Peer] = {p: _Peer(p) for p in peer_ids if p != node_id}
        self.quorum = (len(self.peers) + 1) // 2 + 1  # a majority of all nodes
        self.store = store
        self.log = log
        self.rng = rng
        self.timing = timing
        self.async_mode = async_mode
        self.sync_rate = sync_rate
        # Records kept in memory for slaves that pull: queue_server's
        # log_size; a node alone has no slave, so it keeps only a few
        # (log.LONE_LOG_RECORDS).
        self.log_size = log_size if self.peers else min(log_size, LONE_LOG_RECORDS)
        self._compact_above = self.log_size + COMPACT_SLACK  # (append_entry_now's test)
        self._apply_by_kind = store.apply_by_kind  # Store.apply without its dispatch call
        self.vote_id = vote_id  # current epoch; persisted with voted_for
        self.voted_for = voted_for  # whom we voted for in vote_id (0: nobody)
        self.role = Role.SLAVE
        self.leader_id = 0  # master of vote_id as far as we know (0: none)
        self.commit_id = log.base_trans_id  # highest committed trans_id known
        self.applied_id = log.base_trans_id  # highest trans_id applied to the store
        # (trans_id, undo ops) of applied, uncommitted entries
        self.undo: deque[tuple[int, list[Any]]] = deque()
        # (trans_id, vote_id, done, result) of proposals not yet committed,
        # in log order (each is appended after the others, a truncation
        # drops the last ones)
        self.waiting: deque[tuple[int, int, Done, object]] = deque()
        self.votes: set[int] = set()  # votes (or pre-votes) granted to us this round
        self.pre_voting = False  # collecting pre-votes, not yet a candidate
        self.master_heard_ms = -(10 ** 12)  # last time a live master spoke to us
        self.leader_last = 0  # the master's last trans_id, from its pushes
        self.leader_commit = 0  # the master's commit_id, from its pushes
        self.became_master_ms = 0
        self.pushed_upto = log.last_trans_id  # master: last trans_id pushed to in-step slaves
        # Async mode may coalesce pushes (nobody waits for them): new records
        # go out at most every push_interval_ms, at once after a quiet spell
        # or once PUSH_AT_ONCE_RECORDS wait; 0 pushes every turn's records.
        self.push_interval_ms = push_interval_ms if async_mode else 0
        self.push_due_ms = 0  # master: when new records may be pushed next
        # Quorum mode: a commit needs quorum - 1 slaves, so only that many
        # (those that keep up) get every turn's records at once; the spare
        # ones get them every SPARE_PUSH_MS (see _push_new). Not with a
        # deferred sync, whose own fsync may wait only while a majority of
        # slaves has everything.
        self.spare_pushes = not async_mode and not deferred_sync
        self.spare_due_ms = 0  # master: when the spare slaves may be pushed next
        self.spares_behind = False  # master: a spare slave lacks records pushed to others
        self.last_pull: tuple[int, int] | None = None  # (trans_id, vote_id) of our last pull
        self.pull_due_ms = 0
        self.heartbeat_due_ms = now_ms
        # Alone, there is nobody to wait for: elect ourselves at the first tick.
        self.election_due_ms = now_ms if not self.peers else now_ms + self._election_timeout()
        self.refill_ms = now_ms  # last sync_rate budget refill
        # External snapshots (the node's adapter writes snapshot files and
        # streams them to slaves in chunks): the log is never compacted
        # past our newest snapshot, so that a slave that installs it finds
        # the records after it. Without, a snapshot is built in memory and
        # sent as one message (the simulated network's way).
        self.external_snapshots = external_snapshots
        # ...written on demand (a node without a data directory, whose
        # snapshots serve only slaves behind its log): none is written until
        # a slave needs one (`snapshot_wanted`, which the adapter answers
        # with a writer), and the log is held past the newest only while a
        # slave may be catching up from it (see _maybe_compact). Written
        # every log_size entries instead, each one the whole store, they
        # cost an async cluster's three nodes half a core under load.
        self.snapshots_on_demand = snapshots_on_demand and external_snapshots
        self.snapshot_wanted = False  # master, on demand: a slave needs a newer snapshot
        # Deferred sync (fsync=always): the master sends its records before
        # its own fsync has finished (which runs off the event loop) and
        # counts itself towards a majority only up to `durable_id`, which
        # the adapter advances with `synced_to` (Raft thesis 10.2.1; "Our
        # own copy on disk" above). Without it, the master's records count
        # once persisted.
        self.deferred_sync = deferred_sync
        self.durable_id = log.last_trans_id  # our records up to here are on stable storage
        # trans_id of our newest snapshot (0: none), and the vote_id of its entry
        self.snapshot_id, self.snapshot_vote = (
            (log.base_trans_id, log.base_vote_id) if snapshot is None else snapshot)
        if self.snapshot_id > log.base_trans_id or (self.snapshot_id < log.base_trans_id
                                                    and self.peers):
            raise InvariantError(f"snapshot at {self.snapshot_id} with the log's base at "
                                 f"{log.base_trans_id} (past it only for a node alone)")
        # Reads (read_index): every push carries read_round; a read waits
        # for a majority to echo a round sent after it was asked for.
        self.read_round = 0  # master: the round pushes carry now
        self.round_sent_any = False  # master: a push carried read_round already
        # master back from a long stall: the read round a majority must echo
        # before it takes writes again (`stalled`); 0: none
        self.confirming = 0
        # master: (trans_id, vote_id at it, round, done) of waiting reads, in
        # the order asked (so trans_id and round never decrease along it)
        self.reads: deque[tuple[int, int | None, int, Done]] = deque()
        # A leader transfer this node began as master, until it ends (it
        # may outlive the role: it ends once a later master is seen)
        self.transfer: _Transfer | None = None
        self.ready = Ready()

    # -- queries -----------------------------------------------------------

    @property
    def is_master(self) -> bool:
        return self.role is Role.MASTER

    @property
    def confirming_role(self) -> bool:
        """A master back from a long stall that takes no writes until a
        majority answers it (`stalled`)."""
        return self.confirming > 0

    @property
    def transferring(self) -> bool:
        """A master handing its role over: it takes no writes."""
        return self.transfer is not None and self.role is Role.MASTER

    def transfer_target(self, now_ms: int) -> int | None:
        """The most up-to-date slave that answered within an election
        timeout (highest match_id, then lowest node_id), on a master; None
        elsewhere or when there is none. O(peers)."""
        if self.role is not Role.MASTER:
            return None
        horizon = now_ms - self.timing.election_ms
        best: tuple[int, int] | None = None
        for p in self.peers.values():
            if p.acked_ms >= horizon and p.heard_ms >= horizon:
                key = (p.match_id, -p.node_id)
                if best is None or key > best:
                    best = key
        return None if best is None else -best[1]

    def leader(self) -> LeaderInfo | None:
        if self.role is Role.MASTER:
            return self.me
        peer = self.peers.get(self.leader_id)
        return peer.client if peer is not None else None

    def status(self, now_ms: int | None = None) -> EngineStatus:
        """What monitor and readiness report; `in_contact` (see `in_contact`)
        only with `now_ms`, else True."""
        master = self.role is Role.MASTER
        return EngineStatus(role=self.role, vote_id=self.vote_id,
                            trans_id=self.log.last_trans_id, commit_id=self.commit_id,
                            applied_id=self.applied_id, log_size=len(self.log),
                            in_contact=True if now_ms is None else self.in_contact(now_ms),
                            master_commit_id=self.commit_id if master else self.leader_commit)

    def in_contact(self, now_ms: int) -> bool:
        """A master: a majority (us included) answered our pushes within an
        election timeout (check-quorum's test, which it takes only once per
        tick); anyone else: a live master spoke to us within one. O(peers)."""
        if self.role is Role.MASTER:
            horizon = now_ms - self.timing.election_ms
            acked = 1 + sum(1 for p in self.peers.values() if p.acked_ms >= horizon)
            return acked >= self.quorum
        return self._hears_master(now_ms)

    def applied_since_snapshot(self) -> int:
        """Entries both committed and applied after our newest snapshot (the
        snapshot writer's test, every turn: no vote lookup)."""
        commit_id, applied_id = self.commit_id, self.applied_id
        return (commit_id if commit_id < applied_id else applied_id) - self.snapshot_id

    def snapshot_point(self) -> tuple[int, int]:
        """(trans_id, vote_id) of the newest state a snapshot may hold: the
        last entry both committed and applied."""
        trans_id = min(self.commit_id, self.applied_id)
        return trans_id, self.log.vote_id_at(trans_id) or 0

    def prepare_snapshot(self, trans_id: int) -> None:
        """Undo the applied entries after `trans_id` (uncommitted ones, on a
        master) and nothing else: for a forked copy of the node about to
        write its store as the snapshot at trans_id. Never on the live node."""
        self._rollback_to(trans_id)

    def snapshot_taken(self, trans_id: int, vote_id: int) -> None:
        """A snapshot at trans_id is on disk: the log may be compacted up to
        it, and slaves behind the log get it."""
        if trans_id > self.snapshot_id:
            self.snapshot_id, self.snapshot_vote = trans_id, vote_id
        if self.snapshot_id >= self.log.base_trans_id:
            self.snapshot_wanted = False  # slaves behind the log get this one

    def slaves(self) -> list[JsonObject]:
        """Per slave: match position and lag (meaningful on the master)."""
        last = self.log.last_trans_id
        return [{"node_id": p.node_id, "match_id": p.match_id, "lag": last - p.match_id}
                for p in sorted(self.peers.values(), key=lambda p: p.node_id)]

    def connected_count(self, now_ms: int) -> int:
        """Nodes (us included) heard from within an election timeout."""
        horizon = now_ms - self.timing.election_ms
        return 1 + sum(1 for p in self.peers.values() if p.heard_ms >= horizon)

    def next_deadline(self) -> int:
        """The time at which `tick` has something to do."""
        due = self._next_deadline()
        if self.transfer is not None:
            due = min(due, self.transfer.due_ms)
        return due

    def _next_deadline(self) -> int:
        if self.role is Role.MASTER:
            due = self.heartbeat_due_ms
            if self.push_interval_ms and self.log.last_trans_id > self.pushed_upto:
                due = min(due, self.push_due_ms)
            if self.spares_behind:
                due = min(due, self.spare_due_ms)
            if any(p.pending_pull for p in self.peers.values()):
                due = min(due, self.refill_ms + 10)
            return due
        due = min(self.election_due_ms, self.heartbeat_due_ms)
        if self.leader_id and self.leader_last > self.log.last_trans_id:
            due = min(due, self.pull_due_ms)
        return due

    def push_at(self) -> int:
        """A master: when `take_ready` pushes the records appended so far,
        as a time of the core's clock (the adapter's timer need not run
        before it): 0 for the next call, unless pushes are coalesced
        (push_interval_ms) and fewer than PUSH_AT_ONCE_RECORDS wait, then
        push_due_ms."""
        if (not self.push_interval_ms
                or self.log.last_trans_id - self.pushed_upto >= PUSH_AT_ONCE_RECORDS):
            return 0
        return self.push_due_ms

    def take_ready(self, now_ms: int) -> Ready:
        """Hand over what must be done, and start collecting afresh.
        `now_ms` decides `own_sync` (whether the slaves keep up) and, with
        coalesced pushes, whether new records are pushed now."""
        if self.role is Role.MASTER:
            if self.transfer is not None and not self.transfer.sent:
                # here: whatever input made the target caught up (a reply,
                # a commit, our own sync) is followed by a take_ready
                self._maybe_hand_over(now_ms)
            unpushed = self.log.last_trans_id - self.pushed_upto
            if unpushed > 0 and (not self.push_interval_ms or now_ms >= self.push_due_ms
                                 or unpushed >= PUSH_AT_ONCE_RECORDS) or (
                    self.spares_behind and now_ms >= self.spare_due_ms):
                self._push_new(now_ms)
                self.push_due_ms = now_ms + self.push_interval_ms
            if (self.reads or self.confirming) and self.peers:
                # Waiting reads need a push of the current round to everyone
                # who has not had one (a heartbeat where no records went).
                for peer in self.peers.values():
                    if peer.round_sent < self.read_round or not self.round_sent_any:
                        self._send_push(peer, peer.sent_upto, ())
        ready, self.ready = self.ready, Ready()
        if self.deferred_sync:
            ready.own_sync = self._own_sync(now_ms)
        return ready

    def _own_sync(self, now_ms: int) -> OwnSync:
        """Ready.own_sync: how our counting relies on the fsync of what we
        wrote ("Our own copy on disk" in the module docstring)."""
        if not self.deferred_sync or self.role is not Role.MASTER:
            return OwnSync.BEFORE_SEND
        return OwnSync.NOW if self._own_sync_urgent(now_ms) else OwnSync.MAY_WAIT

    def _own_sync_urgent(self, now_ms: int) -> bool:
        """Deferred sync, as master: must our own fsync start now, or can
        the slaves alone make a majority for what we just sent? They can
        when at least `quorum` of them keep up: everything was pushed to
        them, and each has answered a push of this epoch (match_id > 0)
        and answered us within two heartbeats. Nothing left to sync is
        never urgent."""
        if self.durable_id >= self.log.last_trans_id:
            return False
        horizon = now_ms - 2 * self.timing.heartbeat_ms
        last = self.log.last_trans_id  # take_ready pushed everything up to it
        keeping_up = sum(1 for p in self.peers.values()
                         if p.sent_upto >= last and p.match_id > 0 and p.acked_ms >= horizon)
        return keeping_up < self.quorum

    # -- inputs ------------------------------------------------------------

    def synced_to(self, trans_id: int) -> None:
        """Input: our records up to trans_id are on stable storage (a sync
        finished; see "Our own copy on disk" in the module docstring). As a
        deferring master we may now count them towards a majority; what
        that commits comes out in the next Ready. Never counts past the
        log's end. Fed at any time, even while a Ready is carried out."""
        if trans_id > self.durable_id:
            self.durable_id = min(trans_id, self.log.last_trans_id)
            self._maybe_commit()

    def propose(self, entry: Entry, done: Done) -> None:
        """Append and apply `entry` (master only); `done` runs when it
        commits (quorum) or once persisted (async)."""
        if self.role is not Role.MASTER:
            done(None, NOT_MASTER)
            return
        if self.transfer is not None or self.confirming:
            done(None, TRANSFERRING)  # at once, nothing appended: as for "not master"
            return
        record = self.log.append_entry(entry, self.vote_id)
        result = self._apply_speculative(record)
        self.ready.records.append(record)
        if self.async_mode:
            self.ready.answers.append(lambda: done(result, None))
        else:
            self.waiting.append((record.trans_id, self.vote_id, done, result))
        if not self.peers:
            self._maybe_commit()

    def append_now(self, entry: Entry) -> tuple[Record, object]:
        """Input, for a master whose writes are answered without waiting for
        another node: alone (no peers), or in async mode; not deferring its
        sync; with nothing of the current Ready's log change left to carry
        out. Appends and applies `entry` at once and returns its record,
        which the caller must persist before it answers (it does not go into
        the Ready), and what apply returned. Alone, the entry commits at
        once. In async mode it is pushed to the slaves with the next Ready
        and commits once a majority holds it, as a proposal does (applied
        with its undo: a new master may roll it back). This is the adapter's
        fast path (ClusterEngine.commit_now): the same log and state as
        `propose` then `take_ready`, without the callback or the turn's
        wait."""
        result = self.append_entry_now(entry)
        return self.log.records[-1], result

    def append_entry_now(self, entry: Entry) -> object:
        """`append_now` without the record in the result: what apply
        returned. The record is (log.last_trans_id + 1, vote_id, entry) as
        of the call, which the adapter's fast path encodes first (it
        reserves the exact size on disk before anything is appended)."""
        ready = self.ready
        if (self.role is not Role.MASTER or self.deferred_sync or self.transfer is not None
                or self.confirming or (self.peers and not self.async_mode)
                or ready.records or ready.truncate_after is not None
                or ready.snapshot is not None):
            raise InvariantError("append_now needs a master alone or in async mode, nothing "
                                 "deferred, no transfer and no log change pending in the Ready")
        log = self.log
        record = log.append_entry(entry, self.vote_id)
        if self.peers:
            return self._apply_speculative(record)
        apply = self._apply_by_kind.get(type(entry))
        result = self.store.apply(entry) if apply is None else apply(entry, None)
        self.applied_id = self.commit_id = record.trans_id
        if len(log.records) > self._compact_above:
            self._maybe_compact()
        return result

    def read_index(self, done: Done) -> None:
        """Answer a read (an answer that appends no entry) once it rests on
        committed state only (see "Reads" in the module docstring):
        `done(None, None)` then, `done(None, OUTCOME_UNKNOWN)` if this node
        stops being master first; at once in async mode; "not master" if
        it is not master. The answer runs from `take_ready().answers`."""
        if self.role is not Role.MASTER:
            done(None, "not master")
            return
        if self.async_mode:
            self.ready.answers.append(lambda: done(None, None))
            return
        if self.round_sent_any:  # a push sent before now must not vouch for this read
            self.read_round += 1
            self.round_sent_any = False
        last = self.log.last_trans_id
        self.reads.append((last, self.log.vote_id_at(last), self.read_round, done))
        self._maybe_answer_reads()

    def _maybe_answer_reads(self) -> None:
        """Answer the waiting reads whose entries are committed and whose
        round a majority has echoed (we count as echoing every round)."""
        reads = self.reads
        if not reads:
            return
        confirmed = self._echoed_round()
        commit_id = self.commit_id
        answers = self.ready.answers
        while reads and reads[0][0] <= commit_id and reads[0][2] <= confirmed:
            trans_id, vote, _round, done = reads.popleft()
            if self.log.vote_id_at(trans_id) == vote:
                answers.append(partial(done, None, None))
            else:  # cannot happen on a master (it never truncates); be safe
                answers.append(partial(done, None, OUTCOME_UNKNOWN))

    def _echoed_round(self) -> int:
        """The newest read round a majority has echoed (we count as echoing
        every round): what waiting reads and a role confirmation wait for."""
        if not self.peers:
            return self.read_round
        echoed = sorted([self.read_round] + [p.read_acked for p in self.peers.values()],
                        reverse=True)
        return echoed[self.quorum - 1]

    def _confirmed(self) -> None:
        """After a long stall (`stalled`): writes again once a majority has
        echoed the round we confirm."""
        if self._echoed_round() >= self.confirming:
            self.confirming = 0

    def transfer_leader(self, node_id: int, done: TransferDone, now_ms: int) -> None:
        """Input: hand the master role to `node_id` (see "Leader transfer"
        in the module docstring). `done` runs from a Ready's answers:
        done(new_master_id, None) once this node has seen a master of a
        later epoch (normally `node_id`; another node if an election
        intervened), done(self's id, None) at once for this node itself,
        else done(None, reason): NOT_MASTER, NO_SUCH_NODE (not a peer),
        NOT_CAUGHT_UP (not within an election timeout), TRANSFER_TIMED_OUT
        (no new master seen within an election timeout of the TimeoutNow),
        TRANSFER_IN_PROGRESS (to another node; a second request for the
        same node joins the first). Until it ends, a master refuses writes
        (TRANSFERRING)."""
        answers = self.ready.answers
        if self.role is not Role.MASTER:
            answers.append(partial(done, None, NOT_MASTER))
            return
        if node_id == self.node_id:
            answers.append(partial(done, self.node_id, None))
            return
        peer = self.peers.get(node_id)
        if peer is None:
            answers.append(partial(done, None, NO_SUCH_NODE))
            return
        t = self.transfer
        if t is not None:
            if t.target == node_id:
                t.dones.append(done)
            else:
                answers.append(partial(done, None, TRANSFER_IN_PROGRESS))
            return
        self.transfer = _Transfer(node_id, self.vote_id, now_ms + self.timing.election_ms, done)
        # Where we are, now: its answer (or pull) tells us how far it is.
        self._send_push(peer, peer.sent_upto, ())

    def _maybe_hand_over(self, now_ms: int) -> None:
        """As a transferring master: once the target holds our whole log
        and all of it is committed, send it TimeoutNow."""
        t = self.transfer
        if t is None or t.sent or self.role is not Role.MASTER:
            return
        last = self.log.last_trans_id
        if self.peers[t.target].match_id < last or self.commit_id < last:
            return
        t.sent = True
        t.due_ms = now_ms + self.timing.election_ms
        self._send_timeout_now(t)

    def _send_timeout_now(self, t: _Transfer) -> None:
        vote, last = self.log.last_position()
        self._send(t.target, TimeoutNow(vote_id=self.vote_id, node_id=self.node_id,
                                        last_vote_id=vote, last_trans_id=last))

    def _end_transfer(self, leader_id: int | None, reason: str | None) -> None:
        t, self.transfer = self.transfer, None
        if t is not None:
            for done in t.dones:
                self.ready.answers.append(partial(done, leader_id, reason))

    def _maybe_end_transfer(self, now_ms: int) -> None:
        """A master of a later epoch seen (this node included): the
        transfer is done. Its deadline passed: it failed, and a master
        still holding its role takes writes again."""
        t = self.transfer
        if t is None:
            return
        if self.vote_id > t.vote_id and self.leader_id:
            self._end_transfer(self.leader_id, None)
        elif now_ms >= t.due_ms:
            sent = t.sent or self.role is not Role.MASTER
            self._end_transfer(None, TRANSFER_TIMED_OUT if sent else NOT_CAUGHT_UP)

    def _handle_timeout_now(self, msg: TimeoutNow, now_ms: int) -> None:
        """The master asks us to take over: elect ourselves at once, if it
        is our master in our epoch and we hold its whole log (else it is
        stale, or not meant for the log we have: the master times out)."""
        if (self.role is not Role.SLAVE or msg.vote_id != self.vote_id
                or self.leader_id != msg.node_id
                or self.log.last_position() < (msg.last_vote_id, msg.last_trans_id)):
            return
        self._start_election(now_ms, transfer=True)

    def link_up(self, peer_id: int) -> None:
        """A link to `peer_id` came up: introduce ourselves."""
        if peer_id in self.peers:
            self._send(peer_id, Hello(vote_id=self.vote_id, node_id=self.node_id,
                                      client_host=self.me.host, client_port=self.me.port))

    def stalled(self, ms: int, now_ms: int) -> None:
        """Input: this node could not run for the `ms` milliseconds before
        `now_ms` (see "A stall" in the module docstring). When we last
        heard each peer, the master, and the master's slaves' answers move
        on by `ms`, never past now (what was read since the stall, as the
        node may read before it learns of it, is not moved again); the
        election timeout moves on by `ms` too unless the master was heard
        since, to at most two election timeouts from now; a transfer's
        deadline by `ms`. A master that may have been replaced meanwhile
        confirms its role first (`confirming`). Call it before the next
        `tick`."""
        if ms <= 0:
            return
        if self.master_heard_ms < now_ms - ms:  # (else the election timeout restarted since)
            self.election_due_ms = min(self.election_due_ms + ms,
                                       now_ms + 2 * self.timing.election_ms)
        self.master_heard_ms = min(self.master_heard_ms + ms, now_ms)
        for peer in self.peers.values():
            if peer.heard_ms >= 0:
                peer.heard_ms = min(peer.heard_ms + ms, now_ms)
            if peer.acked_ms >= 0:
                peer.acked_ms = min(peer.acked_ms + ms, now_ms)
        if self.transfer is not None:
            self.transfer.due_ms += ms
        if (self.role is Role.MASTER and self.peers
                and ms >= self.timing.election_ms - 2 * self.timing.heartbeat_ms):
            # Long enough for the slaves to have elected another master:
            # no write until a majority answers a push sent from now on
            # (a read round; `_confirmed`), or a newer epoch deposes us.
            self.read_round += 1  # (a round of its own, sent after now)
            self.round_sent_any = False
            self.confirming = self.read_round

    def tick(self, now_ms: int) -> None:
        """Advance timers to `now_ms`."""
        if self.transfer is not None:
            self._maybe_end_transfer(now_ms)
        if self.role is Role.MASTER:
            self._refill(now_ms)
            for peer in self.peers.values():
                if peer.pending_pull is not None and peer.tokens >= 1:
                    pull, peer.pending_pull = peer.pending_pull, None
                    self._serve_pull(peer, pull, now_ms)
            if now_ms >= self.heartbeat_due_ms:
                self.heartbeat_due_ms = now_ms + self.timing.heartbeat_ms
                for peer in self.peers.values():
                    self._send_push(peer, peer.sent_upto, ())
                if self.transfer is not None and self.transfer.sent:
                    self._send_timeout_now(self.transfer)  # in case it was lost
            # Check-quorum: a master cut off from the majority steps down.
            if now_ms - self.became_master_ms >= self.timing.election_ms:
                horizon = now_ms - self.timing.election_ms
                acked = 1 + sum(1 for p in self.peers.values() if p.acked_ms >= horizon)
                if acked < self.quorum:
                    self._become_slave(now_ms, leader_id=0)
            return
        if now_ms >= self.heartbeat_due_ms:
            self.heartbeat_due_ms = now_ms + self.timing.heartbeat_ms
            vote, last = self.log.last_position()
            ping = Ping(vote_id=self.vote_id, node_id=self.node_id, leader_id=self.leader_id,
                        last_vote_id=vote, last_trans_id=last)
            for peer_id in self.peers:
                self._send(peer_id, ping)
        if now_ms >= self.election_due_ms:
            self.election_due_ms = now_ms + self._election_timeout()
            if self.role is Role.CANDIDATE:
                # Our election failed (split vote): start over as a slave,
                # or the pre-vote replies below would be ignored for good.
                self.role = Role.SLAVE
            if self.connected_count(now_ms) >= self.quorum:
                self._start_pre_vote(now_ms)
        if self.leader_id and self.leader_last > self.log.last_trans_id:
            self._maybe_pull(now_ms)

    def step(self, msg: Message, now_ms: int) -> None:
        """Take one message from a peer."""
        peer = self.peers.get(msg.node_id)
        if peer is None:
            return  # not one of our peers: ignore (the link layer drops them too)
        peer.heard_ms = now_ms
        # `type(msg) is C` written out each time: mypy narrows `msg` on it
        # (not on a saved type(msg)), and it costs no more (measured).
        if type(msg) is VoteRequest:
            self._handle_vote_request(peer, msg, now_ms)  # never shows a new master
            return
        if msg.vote_id > self.vote_id and not (type(msg) is VoteReply and msg.pre):
            # A newer epoch exists: whatever we were, we follow it now. (A
            # pre-vote reply names the epoch we asked about, not a real one.)
            self._set_vote(msg.vote_id, 0)
            leader = msg.node_id if type(msg) is Push or type(msg) is Snapshot else 0
            self._become_slave(now_ms, leader_id=leader)
        if type(msg) is Push:
            self._handle_push(peer, msg, now_ms)
        elif type(msg) is PushReply:
            self._handle_push_reply(peer, msg, now_ms)
        elif type(msg) is Pull:
            self._handle_pull(peer, msg, now_ms)
        elif type(msg) is VoteReply:
            self._handle_vote_reply(peer, msg, now_ms)
        elif type(msg) is Snapshot:
            self._handle_snapshot(peer, msg, now_ms)
        elif type(msg) is Hello:
            peer.client = LeaderInfo(node_id=msg.node_id, host=msg.client_host,
                                     port=msg.client_port)
        elif type(msg) is TimeoutNow:
            self._handle_timeout_now(msg, now_ms)
        # Ping and Hello only refresh what we know of the peer; we learn the
        # master from its own push, never from hearsay.
        if self.transfer is not None:
            self._maybe_end_transfer(now_ms)

    # -- elections ---------------------------------------------------------

    def _election_timeout(self) -> int:
        e = self.timing.election_ms
        return e + self.rng.randrange(e)

    def _hears_master(self, now_ms: int) -> bool:
        if self.role is Role.MASTER:
            return True
        return self.leader_id != 0 and now_ms - self.master_heard_ms < self.timing.election_ms

    def _ballot_ok(self, msg: VoteRequest) -> bool:
        return (msg.last_vote_id, msg.last_trans_id) >= self.log.last_position()

    def _start_pre_vote(self, now_ms: int) -> None:
        self.pre_voting = True
        self.votes = {self.node_id}
        if len(self.votes) >= self.quorum:
            self._start_election(now_ms)
            return
        vote, last = self.log.last_position()
        req = VoteRequest(vote_id=self.vote_id + 1, node_id=self.node_id, last_vote_id=vote,
                          last_trans_id=last, pre=True)
        for peer_id in self.peers:
            self._send(peer_id, req)

    def _start_election(self, now_ms: int, *, transfer: bool = False) -> None:
        self.pre_voting = False
        self._set_vote(self.vote_id + 1, self.node_id)
        self.role = Role.CANDIDATE
        self.leader_id = 0
        self.votes = {self.node_id}
        self.election_due_ms = now_ms + self._election_timeout()
        if len(self.votes) >= self.quorum:
            self._become_master(now_ms)
            return
        vote, last = self.log.last_position()
        req = VoteRequest(vote_id=self.vote_id, node_id=self.node_id, last_vote_id=vote,
                          last_trans_id=last, pre=False, transfer=transfer)
        for peer_id in self.peers:
            self._send(peer_id, req)

    def _handle_vote_request(self, peer: _Peer, msg: VoteRequest, now_ms: int) -> None:
        if msg.pre:
            granted = (msg.vote_id > self.vote_id and not self._hears_master(now_ms)
                       and self._ballot_ok(msg))
            self._send(peer.node_id, VoteReply(vote_id=msg.vote_id, node_id=self.node_id,
                                               granted=granted, pre=True))
            return
        # A transfer's election was asked for by the master: a live master
        # is no reason to refuse it (the master itself steps down below).
        if msg.vote_id < self.vote_id or (self._hears_master(now_ms) and not msg.transfer):
            self._send(peer.node_id, VoteReply(vote_id=self.vote_id, node_id=self.node_id,
                                               granted=False, pre=False))
            return
        if msg.vote_id > self.vote_id:
            self._set_vote(msg.vote_id, 0)
            self._become_slave(now_ms, leader_id=0)
        granted = self.voted_for in (0, msg.node_id) and self._ballot_ok(msg)
        if granted:
            if self.voted_for != msg.node_id:
                self._set_vote(self.vote_id, msg.node_id)  # persisted before the reply goes out
            self.election_due_ms = now_ms + self._election_timeout()
        self._send(peer.node_id, VoteReply(vote_id=self.vote_id, node_id=self.node_id,
                                           granted=granted, pre=False))

    def _handle_vote_reply(self, peer: _Peer, msg: VoteReply, now_ms: int) -> None:
        if not msg.granted:
            return
        if msg.pre:
            if self.pre_voting and self.role is Role.SLAVE and msg.vote_id == self.vote_id + 1:
                self.votes.add(peer.node_id)
                if len(self.votes) >= self.quorum:
                    self._start_election(now_ms)
            return
        if self.role is Role.CANDIDATE and msg.vote_id == self.vote_id:
            self.votes.add(peer.node_id)
            if len(self.votes) >= self.quorum:
                self._become_master(now_ms)

    def _become_master(self, now_ms: int) -> None:
        self.role = Role.MASTER
        self.snapshot_wanted = False  # (a former term's)
        self.leader_id = self.node_id
        self.pre_voting = False
        self.became_master_ms = now_ms
        last = self.log.last_trans_id
        for peer in self.peers.values():
            peer.sent_upto = last
            peer.match_id = 0
            peer.acked_ms = now_ms
            peer.tokens = float(self.sync_rate)
            peer.pending_pull = None
            peer.round_sent = peer.read_acked = 0  # echoes of another epoch vouch for nothing
            peer.spare = False
        self.spares_behind = False
        self.refill_ms = now_ms
        # Our decisions must see the whole log: apply what is not yet applied.
        while self.applied_id < last:
            record = self.log.get(self.applied_id + 1)
            if record is None:
                raise InvariantError(f"entry {self.applied_id + 1} to apply is not in the log")
            self._apply_speculative(record)
        self.pushed_upto = last
        self.heartbeat_due_ms = now_ms  # announce at once
        # A Noop in our epoch commits every earlier entry with it.
        record = self.log.append_entry(Noop(), self.vote_id)
        self._apply_speculative(record)
        self.ready.records.append(record)
        if not self.peers:
            self._maybe_commit()

    def _become_slave(self, now_ms: int, *, leader_id: int) -> None:
        was_master = self.role is Role.MASTER
        self.role = Role.SLAVE
        self.pre_voting = False
        self.confirming = 0
        self.leader_id = leader_id
        self.election_due_ms = now_ms + self._election_timeout()
        if was_master:
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        waiting, self.waiting = self.waiting, deque()
        for _t, _vote, done, _result in waiting:
            self.ready.answers.append(partial(done, None, OUTCOME_UNKNOWN))
        reads, self.reads = self.reads, deque()
        for _t, _vote_at, _round, done in reads:
            self.ready.answers.append(partial(done, None, OUTCOME_UNKNOWN))

    def _set_vote(self, vote_id: int, voted_for: int) -> None:
        self.vote_id, self.voted_for = vote_id, voted_for
        self.ready.vote = (vote_id, voted_for)

    # -- replication: master side ------------------------------------------

    def _send(self, peer_id: int, msg: Message) -> None:
        self.ready.messages.append((peer_id, msg))

    def _send_push(self, peer: _Peer, prev: int, records: Sequence[Record],
                   following: bool | None = None) -> None:
        """Send `peer` the records after `prev`. `following`: whether it
        gets the rest by push; by default, whether it is in step (sent at
        least what was pushed: see _push_new) or spare."""
        prev_vote = self.log.vote_id_at(prev)
        if prev_vote is None:  # compacted past what it was sent: restart from the base
            prev, prev_vote, records = self.log.base_trans_id, self.log.base_vote_id, ()
        # The last trans_id it is told of (a slave behind it pulls): to a
        # slave that gets the rest by push (records held by the push
        # interval, the pieces of a split push, a spare's next turn), the
        # end of what it has been sent with this push: telling it our log's
        # end made it pull them too, each pull a detour through the
        # sync_rate budget; to one catching up by pulls, our log's end.
        end = prev + len(records)
        if following is None:
            following = end >= self.pushed_upto or peer.spare
        announced = end if following else self.log.last_trans_id
        self._send(peer.node_id, Push(vote_id=self.vote_id, node_id=self.node_id,
                                      prev_vote_id=prev_vote, prev_trans_id=prev,
                                      records=tuple(records), commit_id=self.commit_id,
                                      last_trans_id=announced, read_round=self.read_round))
        peer.round_sent = self.read_round
        self.round_sent_any = True

    def _push_new(self, now_ms: int) -> None:
        """Push what they lack to the slaves that follow our pushes (in
        step: everything up to pushed_upto was sent to them, or more when
        a pull was answered before the push of what it took; or spare):
        everything appended since what each was sent. In quorum mode only
        quorum - 1 of them get it at once, those that keep up (answered
        within two heartbeats) first, as a commit needs no more; the others
        (spare) get it at most every SPARE_PUSH_MS, or once
        PUSH_AT_ONCE_RECORDS wait for them. A spare slave's pushes still
        commit entries, and it takes an eager one's place once that one
        stops answering. Slaves catching up by pulls (sent less than
        pushed_upto) get nothing here: a push would not continue their
        logs."""
        start = self.pushed_upto
        last = self.log.last_trans_id
        following = [p for p in self.peers.values() if p.sent_upto >= start or p.spare]
        eager = following
        if self.spare_pushes and len(following) >= self.quorum:
            horizon = now_ms - 2 * self.timing.heartbeat_ms
            eager = ([p for p in following if p.acked_ms >= horizon]
                     + [p for p in following if p.acked_ms < horizon])[:self.quorum - 1]
        spare_now = now_ms >= self.spare_due_ms
        pushes: dict[int, list[tuple[int, tuple[Record, ...]]]] = {}  # from -> pushes
        behind = spared = False
        for peer in following:
            since = peer.sent_upto
            if peer in eager:
                peer.spare = False
            else:
                peer.spare = True
                if since >= last:
                    continue
                if not spare_now and last - since < PUSH_AT_ONCE_RECORDS:
                    behind = True
                    continue
                spared = True
            if since >= last:
                continue
            batches = pushes.get(since)
            if batches is None:  # one push, or several in order if they are large
                batches = pushes[since] = []
                pending = self.log.slice(since + 1, last - since)
                prev = since
                while pending:
                    n = _within_bytes(pending)
                    batches.append((prev, tuple(pending[:n])))
                    prev += n
                    del pending[:n]
            for prev, records in batches:  # (pushed_upto moves to `last` below)
                self._send_push(peer, prev, records, following=True)
            peer.sent_upto = last
        if spared:
            self.spare_due_ms = now_ms + SPARE_PUSH_MS
        self.spares_behind = behind
        self.pushed_upto = last

    def _handle_push_reply(self, peer: _Peer, msg: PushReply, now_ms: int) -> None:
        if self.role is not Role.MASTER or msg.vote_id != self.vote_id:
            return
        peer.acked_ms = now_ms
        if msg.match_id > peer.match_id:
            peer.match_id = min(msg.match_id, self.log.last_trans_id)
            self._maybe_commit()
        if msg.read_round > peer.read_acked:
            peer.read_acked = min(msg.read_round, self.read_round)
            self._maybe_answer_reads()
            if self.confirming:
                self._confirmed()

    def _refill(self, now_ms: int) -> None:
        elapsed = now_ms - self.refill_ms
        if elapsed <= 0:
            return
        self.refill_ms = now_ms
        add = elapsed * self.sync_rate / 1000.0
        cap = float(max(self.sync_rate, 1))
        for peer in self.peers.values():
            peer.tokens = min(cap, peer.tokens + add)

    def _handle_pull(self, peer: _Peer, msg: Pull, now_ms: int) -> None:
        if self.role is not Role.MASTER or msg.vote_id > self.vote_id:
            return
        peer.acked_ms = now_ms
        self._refill(now_ms)
        if peer.tokens < 1:
            peer.pending_pull = msg  # answered by tick when the budget allows
            return
        self._serve_pull(peer, msg, now_ms)

    def _serve_pull(self, peer: _Peer, msg: Pull, now_ms: int) -> None:
        log = self.log
        t = msg.trans_id
        if t < log.base_trans_id:
            self._send_snapshot(peer)
            return
        if log.vote_id_at(t) == msg.log_vote_id:
            common = t
        else:
            # The slave's entry at t is not ours: step back past the run of
            # entries of our epoch at that point; the slave checks the match.
            common = min(t, log.last_trans_id)
            if common == t:
                common -= 1
            common = self._back_to_vote(common, msg.log_vote_id)
        if common < log.base_trans_id:
            # The slave's entry at our base (committed, compacted) differs:
            # a push from before the base cannot exist, only a snapshot helps.
            self._send_snapshot(peer)
            return
        budget = int(min(peer.tokens, MAX_BATCH_RECORDS))
        records = log.slice(common + 1, budget)
        del records[_within_bytes(records):]
        peer.tokens -= len(records)
        end = common + len(records)
        # In step once the answer reaches what was pushed (the rest follows
        # by push), else catching up by pulls (a spare too, from now on).
        self._send_push(peer, common, records, following=end >= self.pushed_upto)
        peer.sent_upto = end
        peer.spare = False  # catching up by pulls, or eager once in step

    def _send_snapshot(self, peer: _Peer) -> None:
        """Send the state at our commit position (undoing and redoing our
        uncommitted entries around the dump so that it holds no guess), or
        with external snapshots, ask the adapter to stream our newest one."""
        if self.external_snapshots:
            if self.snapshot_id <= 0 or self.snapshot_id < self.log.base_trans_id:
                if self.snapshots_on_demand:
                    # None covers our log's base: the adapter writes one now
                    # (its point is past the base, which stays meanwhile:
                    # _maybe_compact); the slave's next pull gets it.
                    self.snapshot_wanted = True
                    return
                raise InvariantError(f"log compacted to {self.log.base_trans_id} past "
                                     f"the newest snapshot {self.snapshot_id}")
            self.ready.snapshot_sends.append((peer.node_id, self.snapshot_id, self.snapshot_vote))
            peer.sent_upto = self.snapshot_id
            peer.spare = False
            return
        trans_id = self.commit_id
        vote = self.log.vote_id_at(trans_id)
        if vote is None:
            return  # cannot happen: we keep every record after the commit point
        redo: list[Record] = []
        for i in range(trans_id + 1, self.applied_id + 1):
            record = self.log.get(i)
            if record is None:
                raise InvariantError(f"applied entry {i} is not in the log")
            redo.append(record)
        self._rollback_to(trans_id)
        state = self.store.to_wire()
        for record in redo:
            self._apply_speculative(record)
        self._send(peer.node_id, Snapshot(vote_id=self.vote_id, node_id=self.node_id,
                                          trans_id=trans_id, log_vote_id=vote, state=state))
        peer.sent_upto = trans_id
        peer.spare = False

    def _maybe_commit(self) -> None:
        if self.role is not Role.MASTER:
            return
        own = self.log.last_trans_id
        if self.deferred_sync and self.durable_id < own:
            own = self.durable_id
        matches = sorted([own] + [p.match_id for p in self.peers.values()], reverse=True)
        candidate = matches[self.quorum - 1]
        if candidate <= self.commit_id:
            return
        if self.log.vote_id_at(candidate) != self.vote_id:
            return  # only an entry of our own epoch commits by counting (Raft's rule)
        self._commit_to(candidate)

    def _commit_to(self, commit_id: int) -> None:
        self.commit_id = commit_id
        undo = self.undo
        while undo and undo[0][0] <= commit_id:
            undo.popleft()
        if self.applied_id < commit_id:
            # Applied as one run of the log (a push commits many at once).
            log = self.log
            count = commit_id - self.applied_id
            if self.applied_id < log.base_trans_id or commit_id > log.last_trans_id:
                raise InvariantError(f"entries {self.applied_id + 1}..{commit_id} to apply "
                                     f"are not in the log")
            apply = self.store.apply
            for record in log.slice(self.applied_id + 1, count):
                apply(record.entry)
                self.applied_id = record.trans_id
        waiting = self.waiting
        if waiting and waiting[0][0] <= commit_id:
            vote_id_at = self.log.vote_id_at
            answers = self.ready.answers
            while waiting and waiting[0][0] <= commit_id:
                trans_id, vote, done, result = waiting.popleft()
                answers.append(partial(done, result, None) if vote_id_at(trans_id) == vote
                               else partial(done, None, OUTCOME_UNKNOWN))
        if self.reads:
            self._maybe_answer_reads()
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Drop the log's oldest committed records beyond log_size, in bulk,
        keeping what a slave may still need."""
        if len(self.log) <= self.log_size + COMPACT_SLACK:
            return
        upto = min(self.commit_id, self.applied_id)
        if self.external_snapshots and self.peers:  # a slave may need the log after it
            if not self.snapshots_on_demand:
                upto = min(upto, self.snapshot_id)
            elif self.snapshot_wanted and self.role is Role.MASTER:
                # Until the snapshot is written, however long that takes
                # (a store of millions of messages: seconds), its slave
                # goes on after it; a cap would leave it stale when adopted
                # and start another, without end under a steady load.
                return
            elif self.log.last_trans_id - self.snapshot_id < ON_DEMAND_HOLD_LOGS * self.log_size:
                upto = min(upto, self.snapshot_id)  # a slave may be catching up from it
        if self.role is Role.MASTER and self.peers:
            # Records not yet pushed (coalesced, or appended this turn)
            # are pushed from the log to the slaves in step, even once
            # a pull took them to another slave and they committed.
            upto = min(upto, self.pushed_upto)
            if self.spares_behind:  # and those a spare slave still lacks
                upto = min([upto] + [p.sent_upto for p in self.peers.values() if p.spare])
        if upto - self.log.base_trans_id >= COMPACT_SLACK:  # prefix drops in bulk only
            self.log.compact(self.log_size, upto)

    def _apply_speculative(self, record: Record) -> object:
        ops: list[Any] = []
        result = self.store.apply(record.entry, ops)
        self.undo.append((record.trans_id, ops))
        self.applied_id = record.trans_id
        return result

    def _rollback_to(self, trans_id: int) -> None:
        """Undo applied entries after `trans_id` (all uncommitted)."""
        self.applied_id = roll_back(self.store, self.undo, self.applied_id, self.commit_id,
                                    trans_id)

    # -- replication: slave side -------------------------------------------

    def _back_to_vote(self, t: int, vote_id: int) -> int:
        """The last position at or before `t` (base < t <= last) whose entry
        has a vote_id of at most `vote_id`, or the log's base: votes never
        decrease along a log, so the entries after it are not in a log
        whose entry there has `vote_id`."""
        log = self.log
        while t > log.base_trans_id:
            vote = log.vote_id_at(t)
            if vote is None:
                raise InvariantError(f"no entry at {t} inside the log")
            if vote <= vote_id:
                break
            t -= 1
        return t

    def _handle_push(self, peer: _Peer, msg: Push, now_ms: int) -> None:
        if msg.vote_id < self.vote_id:
            # A deposed master: tell it our epoch so that it steps down.
            self._send(peer.node_id, PushReply(vote_id=self.vote_id, node_id=self.node_id,
                                               match_id=0))
            return
        if self.role is not Role.SLAVE or self.leader_id != msg.node_id:
            self._become_slave(now_ms, leader_id=msg.node_id)
        self.master_heard_ms = now_ms
        self.election_due_ms = now_ms + self._election_timeout()
        self.leader_last = msg.last_trans_id
        self.leader_commit = msg.commit_id
        log = self.log
        prev, records = msg.prev_trans_id, msg.records
        if prev < log.base_trans_id:
            # Records we already hold in our snapshot: skip them.
            skip = log.base_trans_id - prev
            if skip > len(records):
                self._maybe_pull(now_ms)
                return
            if skip:
                if records[skip - 1].vote_id != log.base_vote_id:
                    raise InvariantError("master's record at our snapshot base differs")
                records = records[skip:]
                prev = log.base_trans_id
        if log.vote_id_at(prev) != msg.prev_vote_id:
            # Votes never decrease along a log, so none of our entries up to
            # prev with a newer vote than the master's entry at prev is in
            # its log: pull from before all of them, not one per round trip
            # (heartbeats restart a slow walk back from our last entry, and
            # it never ends).
            near = self._back_to_vote(min(prev, log.last_trans_id), msg.prev_vote_id)
            self._maybe_pull(now_ms, near=near)
            return
        if prev == log.last_trans_id:
            # The common push: every record after our last (a push's records
            # are consecutive), appended as one run.
            log.extend(records)
            self.ready.records.extend(records)
        else:
            for record in records:
                mine = log.get(record.trans_id)
                if mine is not None:
                    if mine.vote_id == record.vote_id:
                        continue
                    self._truncate_after(record.trans_id - 1)
                log.append(record)
                self.ready.records.append(record)
        match = prev + len(records)
        self._send(peer.node_id, PushReply(vote_id=self.vote_id, node_id=self.node_id,
                                           match_id=match, read_round=msg.read_round))
        commit = min(msg.commit_id, match)
        if commit > self.commit_id:
            self._commit_to(commit)
        if self.leader_last > log.last_trans_id:
            self._maybe_pull(now_ms)
        elif log.last_trans_id > match and msg.last_trans_id > match:
            # We hold entries after `match` that this master has not
            # confirmed (it lost track of us, e.g. by answering a stale
            # pull): without a pull our commit_id would wait for the next
            # client write.
            self._maybe_pull(now_ms, near=match)

    def _truncate_after(self, trans_id: int) -> None:
        if trans_id < self.commit_id:
            raise InvariantError(f"truncating committed entries after {trans_id} "
                                 f"(commit {self.commit_id})")
        if self.applied_id > trans_id:
            self._rollback_to(trans_id)
        waiting = self.waiting
        dropped = []
        while waiting and waiting[-1][0] > trans_id:
            dropped.append(waiting.pop()[2])
        # In log order, as they were proposed (a slice, not reversed():
        # mypyc cannot compile a loop over reversed() of this list).
        for done in dropped[::-1]:
            self.ready.answers.append(partial(done, None, OUTCOME_UNKNOWN))
        self.log.truncate_after(trans_id)
        self.durable_id = min(self.durable_id, trans_id)
        r = self.ready
        r.records = [rec for rec in r.records if rec.trans_id <= trans_id]
        r.truncate_after = trans_id if r.truncate_after is None else min(r.truncate_after, trans_id)

    def _maybe_pull(self, now_ms: int, near: int | None = None) -> None:
        """Ask the master for records after a position of our log: our last
        one, or the one at `near` when a push did not match there."""
        if not self.leader_id:
            return
        t = self.log.last_trans_id if near is None else min(near, self.log.last_trans_id)
        t = max(t, self.log.base_trans_id)
        position = (t, self.log.vote_id_at(t) or 0)
        if position == self.last_pull and now_ms < self.pull_due_ms:
            return
        self.last_pull = position
        self.pull_due_ms = now_ms + self.timing.pull_retry_ms
        self._send(self.leader_id, Pull(vote_id=self.vote_id, node_id=self.node_id,
                                        trans_id=position[0], log_vote_id=position[1]))

    def _handle_snapshot(self, peer: _Peer, msg: Snapshot, now_ms: int) -> None:
        if msg.vote_id < self.vote_id:
            return
        self.master_heard_ms = now_ms
        self.election_due_ms = now_ms + self._election_timeout()
        if msg.trans_id <= self.commit_id:
            return  # we already have all of it
        if self.log.vote_id_at(msg.trans_id) == msg.log_vote_id:
            # Our log holds the snapshot's last entry, hence (log matching)
            # all of it; it may hold more that the master already counted
            # for a commit (a late snapshot, overtaken by pushes): keep it.
            self._commit_to(msg.trans_id)
            if self.leader_last > self.log.last_trans_id:
                self._maybe_pull(now_ms)
            return
        self.store.load_wire(msg.state)
        self.undo.clear()
        for _t, _vote, done, _result in self.waiting:
            self.ready.answers.append(partial(done, None, OUTCOME_UNKNOWN))
        self.waiting.clear()
        self.log.records.clear()
        self.log.base_trans_id, self.log.base_vote_id = msg.trans_id, msg.log_vote_id
        self.commit_id = self.applied_id = msg.trans_id
        self.ready.records = []
        self.ready.truncate_after = None
        self.ready.snapshot = (msg.trans_id, msg.log_vote_id, msg.state)
        self.snapshot_id, self.snapshot_vote = msg.trans_id, msg.log_vote_id
        self.durable_id = msg.trans_id  # installed durably before anything else happens
        self.last_pull = None
        self._maybe_pull(now_ms)
