"""A deterministic simulated network of NativeCore nodes (etcd raft's test
`network`, in spirit): one process, one seeded random.Random, virtual time.

Theory of operation
-------------------
`Network` holds n `SimNode`s, each a `NativeCore` plus what the node keeps
on disk (its log records since its last snapshot, that snapshot, and its
vote) and what its adapter (qserver/engines/native/driver.py, durability.py,
snapshots.py) holds in memory. `step()` delivers the next message, fires
the next core timer, or runs the next adapter or client event, then
flushes the stepped node's `Ready` in the order the adapter does (persist
the vote, the snapshot, the log change, then send, answer clients, stream
snapshots, maybe start a snapshot writer). Messages go through the wire encoding
(message_to_wire/message_from_wire), so the codec is exercised too. The
network drops (`drop_rate`), delays and reorders (each message takes
1..`max_delay_ms`), duplicates (`dup_rate`), cuts directed links (`cut`,
`isolate`, `partition`, `heal`), and crashes and restarts nodes. Like the
cluster adapter, a node may collect the Ready of several deliveries before
flushing it at the end of the instant (`batch_rate`); a crash in between
loses what was not flushed. Scenarios drop (`drop_if`) or park (`hold_if`,
`release`) chosen messages, inject a stale one (`deliver`), and record what
was sent (`sent`).

Two configurations (Network arguments):
- The production one, as `ClusterEngine` builds its core
  (`external_snapshots=True`, and `deferred_sync=True` in quorum mode, i.e.
  fsync=always). Snapshots are files: once `log_size` entries are applied
  past the newest snapshot the node "forks" a writer (copies of the core's
  store and undo records, rolled back with `roll_back`, as the child's
  `prepare_snapshot` does) that finishes
  after `snapshot_write_ms`; the node then adopts the file (it becomes the
  newest snapshot on disk, the records it covers go) and calls
  `snapshot_taken`. The core's `snapshot_sends` stream the node's newest
  file to a slave in `snapshot_chunks` (a range) chunks, at most
  SNAPSHOT_WINDOW_CHUNKS ahead of the slave's acks, in order on the link; a
  lost chunk or ack is a broken link and drops the stream (the slave's next
  pull starts it again), as `SnapshotFiles` does. The slave installs the
  last chunk's file the way `SnapshotFiles._install_received` does: a
  `Snapshot` whose state is a `SnapshotLoader`, stepped into the core, and
  the file whose loader the core took moved into place by the next flush
  (the others received since the last flush are discarded). Deferred sync: a master's
  records are written at the flush and fsynced later, by a sync that takes
  `fsync_ms` and starts at once when the Ready's `own_sync` is NOW, else on
  the BATCH_SYNC_MS timer (as engines/native/durability.py does); `synced_to`
  arrives when it ends, unless a truncation or an install came in between,
  and the node flushes then. Slaves (and a node that is not a deferring
  master: `own_sync` BEFORE_SEND) fsync in the flush.
- The simulated network's own (both False): a snapshot is a `Snapshot`
  message built in memory, and every flush is durable.

Async mode's fast path (both configurations): while `commits_at_once`
holds on a master (ClusterEngine's conditions: master, no deferred sync,
no log change pending in its Ready), a client write that service.py
hands to commit_now is appended and applied at once (`append_now`,
NativeCore.append_now), its record is written at once (the disk checks
that trans_ids follow each other: a proposal's Ready turns the fast path
off until it is carried out) and the answer goes right after; the push
follows with a Ready, whenever the core decides (in async mode
`run_schedule` draws the core's push_interval_ms: 0, the driver's
ASYNC_PUSH_INTERVAL_MS or 20 ms). With `batch_rate` that flush waits for
the end of the instant. Its writes are durable, as flushes are: the
driver's fast path needs fsync off or batch, whose loss of unsynced
records on a power loss async mode allows anyway; what a slave
acknowledges is fsynced either way.

A crash loses the node's memory and its adapter's state (syncs, timers,
writers, streams in progress), never its fsynced disk: records written but
not yet fsynced (only a deferring master has any) survive up to a random
point (a power loss in the middle of the page cache's write-back), as its
vote, snapshots and everything synced do. A restart builds the store from
the disk snapshot only and the log from the records after it; the core
starts with commit_id = applied_id = the snapshot's trans_id, so the store
must be the snapshot state at that position (it is: the snapshot is the
state at the log's base). The records after the base are applied again
when the node learns the commit position from a master, or speculatively if
it becomes master itself.

`Checker` checks design.md's invariants 1 to 4 after every delivery and
every timer (`Network.observe`):
1. at most one master per vote_id;
2. a node that becomes master holds every entry committed so far under
   earlier vote_ids, i.e. by a master of an earlier vote_id (Raft's
   leader completeness): the epoch of the commit, not the entry's own
   vote_id, which may be older (a master's Noop commits the entries of
   earlier epochs before it);
3. log matching: every (trans_id, vote_id) ever written names one entry,
   whose predecessor always has the same vote_id (so, by induction, two
   logs holding the same (trans_id, vote_id) are identical up to it);
4. every node applies, up to its commit position, the global committed
   sequence (learned from every node's commit_id advances), and its store
   equals a reference store built from that sequence; so does every
   snapshot a node writes, installs or restarts from.
`Workload` is the clients: requests go to a node, which executes them if it
believes it is master and forwards them to the master it knows otherwise,
the way service.py does (Store.decide_* then NativeCore.propose, or
NativeCore.read_index for an answer that appends no entry: a confirm of an
unknown id, an empty consume, a "stale receipt" or "not in flight"
refusal). A client whose request got no answer, or an "outcome unknown",
retries it after a backoff, on the same node or another. Besides produce,
consume and confirm, clients consume with count, from several queues and
with a lease, confirm, nack and touch with receipts (their last
delivery's, an older one, garbage, none), and configure max_deliveries and
dead_letter; masters move out final deliveries whose lease ran out (the
service's expiry tick), and a message a consume finds over max_deliveries.
The receipt epoch is the master's vote_id (service.py uses Engine.epoch,
which is the native core's vote_id). Producers (issue 15) send produces
with a dedup_id, a priority, or `messages` (a batch, each message with its
own dedup id), and a producer that heard nothing resends the same request
with the same dedup ids (its retries, and now and then the whole request
again as a new one, acknowledged or not: a restarted producer); clients
clear queues and configure dedup_window, max_size and paused.
Every acknowledged answer, writes and reads alike, is held against the
committed history (invariants 6 and 7): it must rest on a committed
position, a read must not be older than any answer acknowledged before it
was asked, and no message is delivered again after its confirm (or a
confirm answered "unknown id") was acknowledged. As each entry commits it
is held against a model of every message built from the committed entries
alone (`_Msg`): a receipt confirms (nacks, touches) only the delivery it
names, the very one its client got it with; a message's `deliveries`
never exceeds its queue's max_deliveries; a delivery is due at the
decision's clock, its lease ends where its lease says; a retry=0 message
is delivered once; a lease reaching the ttl is the last; a dead-letter
move was due and goes to the queue's dead_letter; a produce went into a
queue neither paused in nor full, a delivery came from one not paused out;
a dedup id is never stored twice within its window, whichever master the
resend reached, after any number of failovers (details: `Workload`).

Leader transfers (`Network.transfer`, NativeCore.transfer_leader): a
master handing its role over refuses every write at once with "no
leader", appending nothing (NativeCore.propose), as the service sees it:
the Workload's clients retry elsewhere, a consume's dead-letter move and
the expiry tick stop and try again later; `commits_at_once` is off
meanwhile. `Transfers` asks for them at random amid the faults (one
schedule in two) and checks each answer.

`run_schedule(seed, ...)` runs one random schedule of faults and client
operations, lets the cluster settle, checks that no final delivery whose
lease ran out is left in flight, and checks everything; any failure is an
AssertionError that names the seed.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from qserver.engines.base import LeaderInfo
from qserver.engines.messages import Snapshot, VoteReply, message_from_wire, message_to_wire
from qserver.engines.native import core as native
from qserver.engines.native.core import NativeCore, Role, Timing, roll_back
from qserver.engines.native.driver import ASYNC_PUSH_INTERVAL_MS
from qserver.engines.native.durability import BATCH_SYNC_MS
from qserver.engines.native.snapshots import (
    SNAPSHOT_STALL_S,
    SNAPSHOT_WINDOW_CHUNKS,
    snapshot_due,
)
from qserver.service import EXPIRE_BATCH, EXPIRE_RETRY_MS
from qserver.state.entries import (
    FINAL_EXPIRED,
    FINAL_MAX_DELIVERIES,
    FINAL_NONE,
    SETTINGS,
    Clear,
    Configure,
    Confirm,
    Consume,
    ConsumeMany,
    DeadLetter,
    Nack,
    Produce,
    ProduceBatch,
    Record,
    Touch,
)
from qserver.state.log import Log
from qserver.state.store import Store
from qserver.wire.requests import (
    DEFAULT_PRIORITY,
    ConfirmRequest,
    ConsumeRequest,
    ProduceBatchRequest,
    ProduceItem,
    ProduceRequest,
)

START_MS = 1_700_000_000_000

# A step that does not advance virtual time this many times in a row is a
# livelock in the core (a timer that never moves its own deadline).
MAX_STEPS_AT_ONE_INSTANT = 20_000


class SimFailure(AssertionError):
    """An invariant of design.md section 2 does not hold."""


@contextlib.contextmanager
def compaction_slack(slack: int):
    """Run with the log compacted once it holds `slack` records over its
    bound (the product waits for COMPACT_SLACK = 1024, more entries than a
    simulated schedule writes, so snapshots would never be exercised)."""
    old = native.COMPACT_SLACK
    native.COMPACT_SLACK = slack
    try:
        yield
    finally:
        native.COMPACT_SLACK = old


def same(a, b) -> bool:
    """Two entries are the same decision (entries may be tuples, and
    Confirm('q', 1) must not equal some other 2-tuple)."""
    return type(a) is type(b) and a == b


def message_data(msg) -> str:
    """A stored message's data, whether the store keeps an object or a tuple."""
    return msg[0] if type(msg) is tuple else msg.data


@dataclass(slots=True)
class _Stream:
    """A snapshot file being streamed to a slave (snapshots._Outgoing),
    counted in chunks."""

    trans_id: int
    vote_id: int
    state: list  # the file's content
    chunks: int
    acked_at: int  # virtual ms of the last progress
    sent: int = 0
    acked: int = 0


@dataclass(frozen=True, slots=True)
class _Chunk:
    """SnapshotChunk: a piece of a snapshot file (the last one carries it whole)."""

    vote_id: int
    trans_id: int
    log_vote_id: int
    offset: int  # in chunks
    last: bool
    state: list


@dataclass(frozen=True, slots=True)
class _Ack:
    """SnapshotAck: the slave stored `offset` chunks of the file at trans_id."""

    vote_id: int
    trans_id: int
    offset: int


@dataclass
class SimNode:
    node_id: int
    core: NativeCore | None
    # What this node has "on disk": log records, the newest snapshot, the
    # vote. Records after `synced_upto` are written but not yet fsynced: a
    # crash may lose them.
    disk_records: list[Record] = field(default_factory=list)
    disk_base: tuple[int, int] = (0, 0)  # (trans_id, vote_id) of the snapshot
    disk_state: list | None = None  # snapshot state at disk_base
    disk_vote: tuple[int, int] = (0, 0)
    synced_upto: int = 0
    # Checker's view of the store: entries applied (and not reverted), in
    # order, the first at trans_id applied_base + 1.
    applied: list = field(default_factory=list)
    applied_base: int | None = 0  # None: a snapshot was just loaded
    loaded_state: list | None = None  # the state passed to the last load_wire
    verified_upto: int = 0  # applied entries up to here match the committed sequence
    seen_commit: int = 0  # the commit_id last observed
    was_master_of: int = -1  # vote_id in which it was last seen master (-1: not master)
    # The adapter's state, lost in a crash. `incarnation` tells an event
    # scheduled before a crash from one scheduled after the restart.
    incarnation: int = 0
    sync_busy: bool = False  # a sync off the event loop is under way
    sync_again: bool = False  # ...and another was asked for meanwhile
    batch_timer: bool = False  # the BATCH_SYNC_MS timer is armed
    sync_epoch: int = 0  # bumped by truncations and installs
    writer: int | None = None  # trans_id of the snapshot a forked writer is writing
    snapshot_messages: int = 0  # messages the store held at the last fork (snapshot_due)
    outgoing: dict[int, _Stream] = field(default_factory=dict)  # snapshot streams, by slave
    incoming: list | None = None  # [source, trans_id, vote_id, chunks stored]
    # Files received since the last flush: (the loader stepped into the core
    # as the Snapshot's state, the file's content, its trans_id).
    received: list[tuple[object, list, int]] = field(default_factory=list)

    def received_file(self, loader) -> tuple[object, list, int] | None:
        return next((r for r in self.received if r[0] is loader), None)

    def disk_vote_at(self, trans_id: int) -> int | None:
        base_t, base_v = self.disk_base
        if trans_id == base_t:
            return base_v
        i = trans_id - base_t - 1
        if 0 <= i < len(self.disk_records):
            return self.disk_records[i].vote_id
        return None

    def disk_record(self, trans_id: int) -> Record | None:
        i = trans_id - self.disk_base[0] - 1
        if 0 <= i < len(self.disk_records):
            return self.disk_records[i]
        return None

    def last_written(self) -> int:
        return self.disk_records[-1].trans_id if self.disk_records else self.disk_base[0]

    def reset_adapter(self) -> None:
        self.incarnation += 1
        self.sync_busy = self.sync_again = self.batch_timer = False
        self.writer = self.incoming = None
        self.received = []
        self.outgoing = {}


class Network:
    def __init__(self, n: int, seed: int, *, timing: Timing | None = None, async_mode: bool = False,
                 log_size: int = 100_000, sync_rate: int = 100_000, queue_size: int = 1_000_000,
                 virtual_queues: dict | None = None, check: bool = True,
                 external_snapshots: bool = False, deferred_sync: bool = False,
                 fsync_ms: tuple[int, int] = (1, 5), snapshot_write_ms: tuple[int, int] = (1, 20),
                 snapshot_chunks: tuple[int, int] = (1, 3), push_interval_ms: int = 0,
                 snapshots_on_demand: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = START_MS
        self.timing = timing or Timing(heartbeat_ms=50, election_ms=300, pull_retry_ms=100)
        self.async_mode = async_mode
        self.log_size = log_size
        self.sync_rate = sync_rate
        self.queue_size = queue_size
        self.virtual_queues = virtual_queues or {}
        # The production configuration (see the module docstring); as in
        # ClusterEngine, async mode never defers the master's fsync.
        self.external_snapshots = external_snapshots
        # ...written only when a slave needs one (as ClusterEngine does for
        # a node without a data directory; here with the disk model still)
        self.snapshots_on_demand = snapshots_on_demand and external_snapshots
        self.deferred_sync = deferred_sync and not async_mode
        self.fsync_ms = fsync_ms  # (min, max) duration of a sync off the event loop
        self.snapshot_write_ms = snapshot_write_ms  # (min, max) time a forked writer takes
        self.snapshot_chunks = snapshot_chunks  # (min, max) chunks of a streamed file
        # Async mode's coalesced pushes (NativeCore push_interval_ms; the
        # driver's ASYNC_PUSH_INTERVAL_MS): nothing here waits for a push.
        self.push_interval_ms = push_interval_ms
        self.ids = list(range(1, n + 1))
        self.nodes: dict[int, SimNode] = {}
        self.queue: list = []  # heap of (deliver_at, seq, src, dst, wire or _Chunk/_Ack)
        self.events: list = []  # heap of (at, seq, node_id or None, incarnation, fn)
        # snapshot streams keep their order per link
        self.link_clock: dict[tuple[int, int], int] = {}
        self.seq = 0
        self.cut: set[tuple[int, int]] = set()  # directed links that drop everything
        self.drop_rate = 0.0
        self.max_delay_ms = 5
        # Scenario hooks, called with (src, dst, message) at delivery time:
        # `drop_if` drops a message (a snapshot stream's _Chunk or _Ack too,
        # which breaks the link), `hold_if` parks one until release().
        self.drop_if = None
        self.hold_if = None
        self.held: list[tuple[int, int, list]] = []
        # The cluster adapter flushes a node's Ready once per event-loop
        # turn, after all the messages that arrived together: with this
        # probability a delivery leaves the Ready to collect more, until
        # virtual time moves on (a crash in between loses it unsent).
        self.batch_rate = 0.0
        self.dup_rate = 0.0  # chance that a message is delivered twice
        self.dirty: set[int] = set()
        # Paused nodes (SIGSTOP) and what waits for them to run again:
        # ("msg", src, wire) or ("event", (node or None, incarnation), handle).
        self.paused: dict[int, list] = {}
        # (time, src, dst, msg) when recording
        self.sent: list[tuple[int, int, int, object]] | None = None
        self.masters_by_vote: dict[int, set[int]] = {}
        # Called with the ids of the nodes that just stepped, after the
        # Checker (the Workload arms its masters' expiry ticks there).
        self.observers: list = []
        self.delivered = 0  # messages delivered (statistics)
        self.stats = collections.Counter()  # snapshots installed, truncations, reverts (statistics)
        self._same_instant = 0
        self.checker = Checker(self) if check else None
        for i in self.ids:
            self.nodes[i] = SimNode(i, None)
            self.start(i)

    # -- lifecycle -------------------------------------------------------

    def _make_core(self, node: SimNode) -> NativeCore:
        store = Store(queue_size=self.queue_size, virtual_queues=self.virtual_queues)
        base_t, base_v = node.disk_base
        if node.disk_state is not None:
            store.load_wire(node.disk_state)
        elif base_t:
            raise SimFailure(f"seed {self.seed}: node {node.node_id} has a snapshot base {base_t} "
                             "but no snapshot state")
        log = Log(base_trans_id=base_t, base_vote_id=base_v)
        for r in node.disk_records:
            log.append(r)
        node.applied = []
        node.applied_base = base_t
        node.loaded_state = node.disk_state
        node.verified_upto = base_t
        node.seen_commit = base_t
        node.was_master_of = -1
        if self.checker is not None and base_t:
            self.checker.check_state(node, node.disk_state, base_t, "snapshot on disk")
        self._instrument(node, store)
        vote_id, voted_for = node.disk_vote
        core = NativeCore(node_id=node.node_id, peer_ids=self.ids, store=store, log=log,
                          me=LeaderInfo(node_id=node.node_id, host="127.0.0.1",
                                        port=10000 + node.node_id),
                          rng=random.Random(self.rng.random()), now_ms=self.now, timing=self.timing,
                          async_mode=self.async_mode, sync_rate=self.sync_rate,
                          log_size=self.log_size, vote_id=vote_id, voted_for=voted_for,
                          external_snapshots=self.external_snapshots,
                          deferred_sync=self.deferred_sync,
                          push_interval_ms=self.push_interval_ms,
                          snapshots_on_demand=self.snapshots_on_demand)
        return core

    def _instrument(self, node: SimNode, store: Store) -> None:
        """Record what the core applies to, reverts from and loads into the
        store (one revert call takes back one entry: see NativeCore._rollback_to)."""
        apply, revert, load_wire = store.apply, store.revert, store.load_wire
        stats = self.stats

        def apply_(entry, undo=None):
            result = apply(entry, undo)
            node.applied.append(entry)
            return result

        def revert_(ops):
            revert(ops)
            node.applied.pop()
            stats["reverts"] += 1

        def load_wire_(state):
            load_wire(state)
            node.applied = []
            node.applied_base = None  # known after the step, from core.applied_id
            # A SnapshotLoader is fed from the received file's content.
            node.loaded_state = state if type(state) is list else node.received_file(state)[1]

        store.apply, store.revert, store.load_wire = apply_, revert_, load_wire_

    def start(self, i: int) -> None:
        node = self.nodes[i]
        node.reset_adapter()
        # Recovery fsyncs what it reads back.
        node.synced_upto = node.last_written()
        node.core = self._make_core(node)
        for p in self.ids:
            if p != i:
                node.core.link_up(p)
        self._flush(i)
        self.observe((i,))

    def crash(self, i: int, *, drop_outgoing: bool = False,
              keep_unsynced: bool | None = None) -> None:
        """Stop node i. Its disk survives, except records written and not
        yet fsynced: all of them stay (`keep_unsynced=True`, a process
        crash), none (False), or a random prefix (None: a power loss).
        Messages to it are lost; with `drop_outgoing`, so are the ones it
        sent that are still in flight (it died before its socket buffers
        drained). Its peers drop their snapshot streams to it (the link
        went down)."""
        node = self.nodes[i]
        node.core = None
        node.reset_adapter()
        self.paused.pop(i, None)
        unsynced = len(node.disk_records) - sum(1 for r in node.disk_records
                                                if r.trans_id <= node.synced_upto)
        if unsynced and keep_unsynced is not True:
            keep = 0 if keep_unsynced is False else self.rng.randrange(unsynced + 1)
            if unsynced > keep:
                del node.disk_records[len(node.disk_records) - (unsynced - keep):]
                self.stats["unsynced_lost"] += unsynced - keep
        node.synced_upto = node.last_written()
        for other in self.nodes.values():
            other.outgoing.pop(i, None)
        self.dirty.discard(i)
        self.queue = [m for m in self.queue
                      if m[3] != i and not (drop_outgoing and m[2] == i)]
        heapq.heapify(self.queue)
        self.held = [h for h in self.held if h[1] != i and not (drop_outgoing and h[0] == i)]

    def alive(self, i: int) -> bool:
        return self.nodes[i].core is not None

    def pause(self, i: int) -> None:
        """SIGSTOP node i: no timer fires, nothing it receives is read, none
        of its events runs, until `resume`; its peers see silence."""
        if self.alive(i) and i not in self.paused:
            if i in self.dirty:  # the loop turn it was in finishes first
                self._flush(i)
                self.observe((i,))
            self.paused[i] = []

    def resume(self, i: int) -> None:
        """SIGCONT: what arrived meanwhile is read at once, before its overdue
        timers fire (asyncio runs the callbacks of ready sockets before due
        timers): peer messages in order, then client requests."""
        parked = self.paused.pop(i, None)
        if not parked or not self.alive(i):
            return
        for kind, a, b in parked:
            self.seq += 1
            if kind == "msg":
                heapq.heappush(self.queue, (0, self.seq, a, i, b))
            else:
                heapq.heappush(self.events, (0, self.seq, *a, b))

    def run_on(self, i: int, fn) -> None:
        """Run `fn()` on node i now, or when it resumes (a client request
        waiting in its socket buffer)."""
        parked = self.paused.get(i)
        if parked is None:
            fn()
        else:
            parked.append(("event", (None, 0), [fn]))

    # -- network faults ----------------------------------------------------

    def isolate(self, i: int) -> None:
        for p in self.ids:
            if p != i:
                self.cut.add((i, p))
                self.cut.add((p, i))

    def partition(self, group: set[int]) -> None:
        for a in self.ids:
            for b in self.ids:
                if (a in group) != (b in group):
                    self.cut.add((a, b))

    def heal(self) -> None:
        self.cut.clear()

    def release(self) -> None:
        """Deliver the held messages again, in the order they were held."""
        held, self.held = self.held, []
        for src, dst, wire in held:
            self.seq += 1
            heapq.heappush(self.queue, (self.now + 1, self.seq, src, dst, wire))

    # -- events: the adapter's timers and syncs, clients -------------------

    def schedule(self, delay_ms: int, fn, node: int | None = None) -> list:
        """Run `fn()` `delay_ms` from now; an event of a node is dropped if
        the node crashes first. Returns a handle for `cancel`."""
        self.seq += 1
        incarnation = self.nodes[node].incarnation if node is not None else 0
        handle = [fn]
        heapq.heappush(self.events, (self.now + delay_ms, self.seq, node, incarnation, handle))
        return handle

    @staticmethod
    def cancel(handle: list) -> None:
        handle[0] = None

    # -- the adapter: persisting a Ready, syncs off the loop ----------------

    def _flush(self, i: int) -> None:
        """ClusterEngine._flush: persist, send, answer, stream snapshots,
        maybe start a snapshot writer."""
        self.dirty.discard(i)
        node = self.nodes[i]
        core = node.core
        ready = core.take_ready(self.now)
        self._persist(node, ready)
        stats = self.stats
        if ready.snapshot is not None:
            stats["snapshots"] += 1
        if ready.truncate_after is not None:
            stats["truncations"] += 1
        if self.checker is not None:
            self.checker.on_persist(node, ready)
        node.received = []  # files the core did not take (SnapshotFiles.discard_unwanted)
        for dst, msg in ready.messages:
            if self.sent is not None:
                self.sent.append((self.now, i, dst, msg))
            self.seq += 1
            delay = self.rng.randrange(1, self.max_delay_ms + 1)
            wire = message_to_wire(msg)
            heapq.heappush(self.queue, (self.now + delay, self.seq, i, dst, wire))
            if self.dup_rate and self.rng.random() < self.dup_rate:
                self.seq += 1
                delay = self.rng.randrange(1, self.max_delay_ms + 1)
                heapq.heappush(self.queue, (self.now + delay, self.seq, i, dst, wire))
        for answer in ready.answers:
            answer()
        for peer, trans_id, vote_id in ready.snapshot_sends:
            self._stream(node, peer, trans_id, vote_id)
        self._maybe_write(node)

    def _persist(self, node: SimNode, ready) -> None:
        """ClusterEngine._persist and Durability.after_write (fsync=always):
        the vote, a snapshot installed from the master, the log change;
        then fsync now, or leave it to a sync off the loop (a deferring
        master), as the Ready's own_sync says."""
        core = node.core
        if ready.vote is not None:
            node.disk_vote = ready.vote
        if ready.snapshot is not None:
            trans_id, vote_id, state = ready.snapshot
            if type(state) is not list:  # received as a file: SnapshotFiles.install_into
                received = node.received_file(state)
                if received is None or received[2] != trans_id:
                    raise SimFailure(f"seed {self.seed}: node {node.node_id} installs a snapshot "
                                     f"at {trans_id}; the file it received holds "
                                     f"{received and received[2]}")
                node.received.remove(received)
                state = received[1]
            node.disk_base = (trans_id, vote_id)
            node.disk_state = state
            node.disk_records = []
            node.synced_upto = trans_id
        if ready.truncate_after is not None and ready.truncate_after < node.last_written():
            keep = ready.truncate_after
            node.disk_records = [r for r in node.disk_records if r.trans_id <= keep]
            node.synced_upto = node.last_written()  # the cut segment is fsynced
        if ready.snapshot is not None or ready.truncate_after is not None:
            node.sync_epoch += 1
        self._append_disk(node, ready.records)
        if node.synced_upto < node.last_written():
            if ready.own_sync is native.OwnSync.BEFORE_SEND:
                node.synced_upto = node.last_written()
                core.synced_to(node.synced_upto)
            else:  # a deferring master: its records go out before its own fsync
                self._sync_when_due(node, ready.own_sync)

    def _append_disk(self, node: SimNode, records: list[Record], note: bool = False) -> None:
        """DiskStorage.append: the log file holds trans_ids in order, without
        a gap (why the adapter's fast path waits behind a pending proposal).
        `note`: tell the Checker (invariant 3) now (the fast path's record,
        written outside a flush)."""
        for record in records:
            if record.trans_id != node.last_written() + 1:
                raise SimFailure(f"seed {self.seed}: node {node.node_id} writes {record} after "
                                 f"trans_id {node.last_written()} on its disk")
            if note and self.checker is not None:
                self.checker.note_record(node.node_id, record,
                                         node.disk_vote_at(record.trans_id - 1))
            node.disk_records.append(record)

    def _sync_when_due(self, node: SimNode, own_sync: native.OwnSync) -> None:
        """Durability.after_write: at once if our own copy must count now,
        else by the batch timer."""
        if own_sync is native.OwnSync.NOW:
            self._start_sync(node)
        elif not node.batch_timer:
            node.batch_timer = True
            self.schedule(BATCH_SYNC_MS, partial(self._batch_sync, node), node.node_id)

    def _batch_sync(self, node: SimNode) -> None:
        node.batch_timer = False
        if node.synced_upto < node.last_written():
            self._start_sync(node)

    def _start_sync(self, node: SimNode) -> None:
        if node.sync_busy:
            node.sync_again = True
            return
        last = node.last_written()
        if node.synced_upto >= last:
            node.core.synced_to(last)
            return
        node.sync_busy = True
        self.schedule(self.rng.randint(*self.fsync_ms),
                      partial(self._sync_finished, node, last, node.sync_epoch), node.node_id)

    def _sync_finished(self, node: SimNode, covered: int, epoch: int) -> None:
        node.sync_busy = False
        self.stats["deferred_syncs"] += 1
        if epoch == node.sync_epoch:
            node.synced_upto = max(node.synced_upto, min(covered, node.last_written()))
            node.core.synced_to(covered)
        if node.sync_again:
            node.sync_again = False
            self._start_sync(node)
        self._flush(node.node_id)  # its Ready says how soon what is left must be synced
        self.observe((node.node_id,))

    # -- the adapter: snapshot files -----------------------------------------

    def _maybe_write(self, node: SimNode) -> None:
        """SnapshotFiles.maybe_write: once log_size entries were applied past
        the newest snapshot (alone: see snapshot_due), fork a writer. The
        child's copy of the store is rolled back to the snapshot point with
        roll_back, as prepare_snapshot does in SnapshotFiles._fork_snapshot; the file is
        ready `snapshot_write_ms` later."""
        if not self.external_snapshots or node.writer is not None:
            return
        core = node.core
        trans_id, vote_id = core.snapshot_point()
        if self.snapshots_on_demand:
            if not (core.snapshot_wanted and core.is_master):
                return
        elif not snapshot_due(trans_id - core.snapshot_id, max(1, self.log_size), not core.peers,
                              node.snapshot_messages):
            return
        node.snapshot_messages = core.store.message_count()
        # The fork: a copy of the store's memory and of the undo records,
        # which share objects with it (a clear's record holds the queue's
        # former containers) that the child's rollback changes; without the
        # Checker's hooks (the class's methods again).
        # (NativeCore.prepare_snapshot is roll_back on the core's own; a
        # compiled core, qserver.compiled, cannot be copied.)
        store, undo = copy.deepcopy((core.store, core.undo))
        for hook in ("apply", "revert", "load_wire"):
            vars(store).pop(hook, None)
        roll_back(store, undo, core.applied_id, core.commit_id, trans_id)
        state = store.to_wire()
        node.writer = trans_id
        self.schedule(self.rng.randint(*self.snapshot_write_ms),
                      partial(self._snapshot_written, node, trans_id, vote_id, state), node.node_id)

    def _snapshot_written(self, node: SimNode, trans_id: int, vote_id: int, state: list) -> None:
        """SnapshotFiles._snapshot_written with DiskStorage.adopt_snapshot."""
        node.writer = None
        if trans_id < node.disk_base[0] or trans_id > node.last_written():
            self.stats["snapshots_overtaken"] += 1  # an installed one is newer: removed
            return
        if self.checker is not None:
            self.checker.check_state(node, state, trans_id, "snapshot file it wrote")
        node.disk_base = (trans_id, vote_id)
        node.disk_state = state
        node.disk_records = [r for r in node.disk_records if r.trans_id > trans_id]
        node.synced_upto = max(node.synced_upto, trans_id)
        node.core.snapshot_taken(trans_id, vote_id)
        self.stats["snapshots_written"] += 1
        self._flush(node.node_id)
        self.observe((node.node_id,))

    def _stream(self, node: SimNode, peer: int, trans_id: int, vote_id: int) -> None:
        """SnapshotFiles.stream: send our newest snapshot file to `peer`."""
        current = node.outgoing.get(peer)
        if current is not None:
            if (current.trans_id == trans_id
                    and self.now - current.acked_at < SNAPSHOT_STALL_S * 1000):
                return  # under way
            del node.outgoing[peer]
        if node.disk_base[0] > trans_id:
            # A newer file was adopted between the core's decision and this
            # flush (the Ready waited for the end of the loop turn): the
            # adapter cannot open the old one, logs it, and the slave's next
            # pull gets the newer one.
            self.stats["snapshot_sends_overtaken"] += 1
            return
        if node.disk_base != (trans_id, vote_id) or node.disk_state is None:
            raise SimFailure(f"seed {self.seed}: node {node.node_id} is to stream its snapshot at "
                             f"{(trans_id, vote_id)}; its newest file is at {node.disk_base}")
        if not self.alive(peer):
            return  # the link is down
        node.outgoing[peer] = _Stream(trans_id, vote_id, node.disk_state,
                                      chunks=self.rng.randint(*self.snapshot_chunks),
                                      acked_at=self.now)
        self.stats["snapshot_streams"] += 1
        self._pump(node, peer)

    def _pump(self, node: SimNode, peer: int) -> None:
        out = node.outgoing[peer]
        while out.sent < out.chunks and out.sent - out.acked < SNAPSHOT_WINDOW_CHUNKS:
            self._send_stream(node.node_id, peer, _Chunk(
                node.core.vote_id, out.trans_id, out.vote_id, out.sent, out.sent + 1 == out.chunks,
                out.state))
            out.sent += 1

    def _send_stream(self, src: int, dst: int, msg) -> None:
        """A chunk or an ack: like every message on a TCP link, in order."""
        self.seq += 1
        at = max(self.now + self.rng.randrange(1, self.max_delay_ms + 1),
                 self.link_clock.get((src, dst), 0))
        self.link_clock[(src, dst)] = at
        heapq.heappush(self.queue, (at, self.seq, src, dst, msg))

    def _link_broke(self, a: int, b: int) -> None:
        """A stream message was lost: the link went down (ClusterEngine._on_link)."""
        for x, y in ((a, b), (b, a)):
            if self.nodes[x].core is not None and self.nodes[x].outgoing.pop(y, None) is not None:
                self.stats["snapshot_streams_broken"] += 1

    def _on_chunk(self, node: SimNode, src: int, chunk: _Chunk) -> bool:
        """SnapshotFiles.on_chunk and _install_received; True if the core
        was stepped."""
        inc = node.incoming
        if chunk.offset == 0:
            inc = node.incoming = [src, chunk.trans_id, chunk.log_vote_id, 0]
        elif inc is None or inc[0] != src or inc[1] != chunk.trans_id or inc[3] != chunk.offset:
            return False  # out of step: the master's stream stalls and restarts
        inc[3] += 1
        self._send_stream(node.node_id, src, _Ack(node.core.vote_id, chunk.trans_id, inc[3]))
        if not chunk.last:
            return False
        node.incoming = None
        loader = node.core.store.snapshot_loader()
        for item in chunk.state:  # [name, max_id, messages] or [..., extras] (Store.to_wire)
            loader.queue(item[0], item[1], item[3] if len(item) > 3 else None)
            if item[2]:  # (a virtual queue's dedup table has no messages)
                loader.messages(item[2])
        node.received.append((loader, chunk.state, chunk.trans_id))
        self.stats["snapshot_files_received"] += 1
        node.core.step(Snapshot(vote_id=chunk.vote_id, node_id=src, trans_id=chunk.trans_id,
                                log_vote_id=chunk.log_vote_id, state=loader), self.now)
        return True

    def _on_ack(self, node: SimNode, src: int, ack: _Ack) -> None:
        """SnapshotFiles.on_ack."""
        out = node.outgoing.get(src)
        if out is None or out.trans_id != ack.trans_id or ack.offset <= out.acked:
            return
        out.acked = min(ack.offset, out.sent)
        out.acked_at = self.now
        if out.acked >= out.chunks:
            del node.outgoing[src]
        else:
            self._pump(node, src)

    # -- running -----------------------------------------------------------

    def _next_times(self) -> tuple[int | None, int | None, int | None]:
        next_msg = self.queue[0][0] if self.queue else None
        paused = self.paused
        next_timer = min([n.core.next_deadline() for n in self.nodes.values()
                          if n.core and n.node_id not in paused], default=None)
        events, nodes = self.events, self.nodes
        while events:  # cancelled events, and those of a node that crashed since, go
            _at, _seq, i, incarnation, handle = events[0]
            if handle[0] is not None and (i is None or (nodes[i].core is not None
                                                         and nodes[i].incarnation == incarnation)):
                if i is None or i not in paused:
                    break
                paused[i].append(("event", (i, incarnation), handle))  # runs when it resumes
            heapq.heappop(events)
        next_event = events[0][0] if events else None
        return next_msg, next_timer, next_event

    def step(self, times: tuple | None = None) -> bool:
        """Deliver the next message, fire the next timer or run the next
        event (`times`: what _next_times just said); False if idle."""
        next_msg, next_timer, next_event = times or self._next_times()
        times = [t for t in (next_msg, next_timer, next_event) if t is not None]
        if not times:
            return False
        earliest = min(times)
        if self.dirty and earliest > self.now:
            for i in sorted(self.dirty):  # the end of this instant's event-loop turn
                self._flush(i)
            self.observe()
            return True
        before = self.now
        if next_msg == earliest:
            self._deliver_next()
        elif next_event == earliest:
            at, _, _i, _incarnation, handle = heapq.heappop(self.events)
            self.now = max(self.now, at)
            handle[0]()
        else:
            self.now = max(self.now, next_timer)
            ticked = []
            for n in self.nodes.values():
                if n.core and n.node_id not in self.paused and n.core.next_deadline() <= self.now:
                    n.core.tick(self.now)
                    self._flush(n.node_id)
                    ticked.append(n.node_id)
            self.observe(ticked)
        if self.now == before:
            self._same_instant += 1
            if self._same_instant > MAX_STEPS_AT_ONE_INSTANT:
                raise SimFailure(f"seed {self.seed}: livelock: {self._same_instant} steps "
                                 f"at t={self.now}")
        else:
            self._same_instant = 0
        return True

    def _deliver_next(self) -> None:
        at, _, src, dst, wire = heapq.heappop(self.queue)
        self.now = max(self.now, at)
        node = self.nodes[dst]
        lost = node.core is None or (src, dst) in self.cut or self.rng.random() < self.drop_rate
        if not lost and dst in self.paused:
            self.paused[dst].append(("msg", src, wire))  # in its socket buffer
            return
        if type(wire) is not list:  # a snapshot stream's chunk or ack
            if lost or (self.drop_if is not None and self.drop_if(src, dst, wire)):
                self._link_broke(src, dst)
                return
            if self.hold_if is not None and self.hold_if(src, dst, wire):
                self.held.append((src, dst, wire))
                return
            self.delivered += 1
            if type(wire) is _Ack:
                self._on_ack(node, src, wire)
                return
            if not self._on_chunk(node, src, wire):
                return
        else:
            if lost:
                return
            msg = message_from_wire(wire)
            if self.drop_if is not None and self.drop_if(src, dst, msg):
                return
            if self.hold_if is not None and self.hold_if(src, dst, msg):
                self.held.append((src, dst, wire))
                return
            node.core.step(msg, self.now)
            self.delivered += 1
        if self.batch_rate and self.rng.random() < self.batch_rate:
            self.dirty.add(dst)
        else:
            self._flush(dst)
        self.observe((dst,))

    def deliver(self, src: int, dst: int, msg) -> None:
        """Hand `msg` (as if sent by `src`) to `dst` now, through the wire
        codec: a scenario's stale or late message."""
        self.nodes[dst].core.step(message_from_wire(message_to_wire(msg)), self.now)
        self.delivered += 1
        self._flush(dst)
        self.observe((dst,))

    def run_for(self, ms: int) -> None:
        end = self.now + ms
        while self.step():
            if self.now >= end:
                break
        self.now = max(self.now, end)

    def run_to(self, at_ms: int) -> None:
        """Run every event due before `at_ms`, then set the clock to it."""
        while True:
            times = self._next_times()
            nxt = min(t for t in (*times, at_ms) if t is not None)
            if nxt >= at_ms:
                break
            self.step(times)
        self.now = max(self.now, at_ms)

    def run_until(self, predicate, max_ms: int = 60_000) -> bool:
        end = self.now + max_ms
        while self.now < end:
            if predicate():
                return True
            if not self.step():
                self.now += 1
        return predicate()

    # -- observation ---------------------------------------------------------

    def observe(self, ids=None) -> None:
        """Record masters and check the invariants for the nodes that just
        stepped (all nodes when `ids` is None)."""
        ids = self.ids if ids is None else ids
        for i in ids:
            core = self.nodes[i].core
            if core is not None and core.role is Role.MASTER:
                masters = self.masters_by_vote.setdefault(core.vote_id, set())
                masters.add(i)
                if len(masters) > 1:
                    raise SimFailure(f"seed {self.seed}: invariant 1: two masters in vote_id "
                                     f"{core.vote_id}: {sorted(masters)}")
        if self.checker is not None:
            self.checker.observe(ids)
        for observer in self.observers:
            observer(ids)

    def master(self) -> int | None:
        masters = [n.node_id for n in self.nodes.values() if n.core and n.core.role is Role.MASTER]
        if not masters:
            return None
        return max(masters, key=lambda i: self.nodes[i].core.vote_id)

    def core(self, i: int) -> NativeCore:
        return self.nodes[i].core

    def propose(self, i: int, entry, results: list) -> None:
        core = self.nodes[i].core
        core.propose(entry, lambda result, error: results.append((result, error)))
        self._flush(i)
        self.observe((i,))

    def transfer(self, i: int, target: int, results: list) -> None:
        """Engine.transfer_leader on node i: results gets (new master, reason)
        when it ends (ClusterEngine runs it from a flush, as here)."""
        core = self.nodes[i].core
        core.transfer_leader(target, lambda leader, reason: results.append((leader, reason)),
                             self.now)
        self._flush(i)
        self.observe((i,))

    def commits_at_once(self, i: int) -> bool:
        """ClusterEngine.commits_at_once on node i in async mode: it is
        master, does not defer its sync, hands no role over (a leader
        transfer), and its Ready holds no log change
        (a proposal's record, a truncation, a snapshot), so that the fast
        path's records follow every earlier one in the log file. (The
        driver also turns the fast path off while its disk is short of
        room; the sim's disk never is.)"""
        core = self.nodes[i].core
        if (core is None or not self.async_mode or core.role is not Role.MASTER
                or core.deferred_sync or core.transferring):
            return False
        ready = core.ready
        return not ready.records and ready.truncate_after is None and ready.snapshot is None

    def append_now(self, i: int, entry, done) -> tuple[Record, Callable[[], None]]:
        """ClusterEngine.commit_now on node i (while `commits_at_once`):
        NativeCore.append_now appends and applies `entry` at once and its
        record is written at once (durable, as a flush's writes are).
        Returns the record and the answer (`done(result, None)`), which the
        caller runs once it has noted the write: the service answers as
        commit_now returns. The push to the slaves goes with a Ready, when
        the core decides: the caller flushes, or leaves the node dirty
        until the end of the instant."""
        node = self.nodes[i]
        record, result = node.core.append_now(entry)
        self._append_disk(node, [record], note=True)
        if node.synced_upto < node.last_written():
            node.synced_upto = node.last_written()
            node.core.synced_to(node.synced_upto)
        self.stats["appended_now"] += 1
        return record, partial(done, result, None)

    def converged(self) -> bool:
        """One master that every live node follows, every log identical to
        its log and fully committed and applied everywhere."""
        m = self.master()
        if m is None:
            return False
        mc = self.nodes[m].core
        last = mc.log.last_position()
        if mc.commit_id != last[1] or mc.applied_id != last[1]:
            return False
        for node in self.nodes.values():
            c = node.core
            if c is None or c is mc:
                continue
            if (c.role is not Role.SLAVE or c.leader_id != m or c.vote_id != mc.vote_id
                    or c.log.last_position() != last or c.commit_id != last[1]
                    or c.applied_id != last[1]):
                return False
        return True


class Checker:
    """Invariants 1 to 4 of design.md section 2, checked as the run goes."""

    # Compare stores with the reference every this many observations: a
    # to_wire per node is too dear to do after every message.
    STORE_CHECK_EVERY = 400

    def __init__(self, net: Network) -> None:
        self.net = net
        self.committed: list[Record] = []  # the global committed sequence; [t - 1] is trans_id t
        # [t - 1]: the vote_id under which trans_id t was committed (that of
        # the node first seen to commit it: its master, whose vote_id a
        # slave that learns the commit from it shares); >= the entry's own
        self.commit_votes: list[int] = []
        # (t, v) -> (entry, vote at t-1)
        self.written: dict[tuple[int, int], tuple[object, int | None]] = {}
        self.ref = Store(queue_size=net.queue_size, virtual_queues=net.virtual_queues)
        self.ref_pos = 0
        self.ref_cache: dict[int, list] = {0: []}
        self.observations = 0
        self.granted: dict[tuple[int, int], int] = {}  # (voter, vote_id) -> candidate
        self.listeners: list = []  # called with each record as it joins the committed sequence

    def fail(self, text: str) -> None:
        raise SimFailure(f"seed {self.net.seed}: t={self.net.now - START_MS}ms: {text}")

    # -- invariant 3 ---------------------------------------------------------

    def note_record(self, node_id: int, record: Record, prev_vote: int | None) -> None:
        key = (record.trans_id, record.vote_id)
        seen = self.written.get(key)
        if seen is None:
            self.written[key] = (record.entry, prev_vote)
        elif not same(seen[0], record.entry) or seen[1] != prev_vote:
            self.fail(f"invariant 3: node {node_id} holds {key} = {record.entry} after vote "
                      f"{prev_vote}, another log holds {seen[0]} after vote {seen[1]}")

    def on_persist(self, node: SimNode, ready) -> None:
        """Called by Network._flush once the Ready is on disk, before its
        messages go out."""
        for dst, msg in ready.messages:
            if type(msg) is VoteReply and msg.granted and not msg.pre:
                # A node votes at most once per vote_id, and persists the
                # vote before the reply goes out (or has moved on to a later
                # epoch within the same Ready).
                key = (node.node_id, msg.vote_id)
                first = self.granted.setdefault(key, dst)
                if first != dst:
                    self.fail(f"node {node.node_id} granted vote {msg.vote_id} to {first} "
                              f"and to {dst}")
                vote = node.disk_vote
                if vote != (msg.vote_id, dst) and vote[0] <= msg.vote_id:
                    self.fail(f"node {node.node_id} grants vote {msg.vote_id} to {dst} "
                              f"with {vote} on disk")
        for record in ready.records:
            self.note_record(node.node_id, record, node.disk_vote_at(record.trans_id - 1))
        if ready.snapshot is not None:
            t, v = ready.snapshot[:2]
            if t > len(self.committed) or self.committed[t - 1].vote_id != v:
                self.fail(f"node {node.node_id} installed a snapshot at {ready.snapshot[:2]} "
                          f"that is not a committed position")

    def check_logs(self) -> None:
        """Log matching over every live node's whole in-memory log."""
        for node in self.net.nodes.values():
            core = node.core
            if core is None:
                continue
            log = core.log
            prev = log.base_vote_id
            if log.base_trans_id:
                if (log.base_trans_id > len(self.committed)
                        or self.committed[log.base_trans_id - 1].vote_id != log.base_vote_id):
                    self.fail(f"node {node.node_id}: log base {log.base_trans_id} is not committed")
            for record in log.records:
                self.note_record(node.node_id, record, prev)
                prev = record.vote_id
            # The log may start before the newest snapshot on disk (not yet
            # compacted) or after it (compacted past a snapshot in memory).
            lo = max(log.base_trans_id, node.disk_base[0])
            if ([r for r in log.records if r.trans_id > lo]
                    != [r for r in node.disk_records if r.trans_id > lo]):
                self.fail(f"node {node.node_id}: in-memory log differs from its disk")

    # -- invariants 2 and 4 --------------------------------------------------

    def observe(self, ids) -> None:
        nodes = self.net.nodes
        for i in ids:
            node = nodes[i]
            if node.core is not None:
                self._observe_commit(node)
        for i in ids:
            node = nodes[i]
            core = node.core
            if core is None:
                continue
            if core.role is Role.MASTER:
                if node.was_master_of != core.vote_id:
                    node.was_master_of = core.vote_id
                    self._check_new_master(node)
            else:
                node.was_master_of = -1
            self._check_applied(node)
        self.observations += 1
        if self.observations % self.STORE_CHECK_EVERY == 0:
            self.check_stores(strict=False)

    def _observe_commit(self, node: SimNode) -> None:
        core = node.core
        c = core.commit_id
        if c <= node.seen_commit:
            if c < node.seen_commit:
                self.fail(f"node {node.node_id}: commit_id went back from {node.seen_commit} "
                          f"to {c}")
            return
        committed = self.committed
        log = core.log
        for t in range(node.seen_commit + 1, c + 1):
            record = log.get(t)
            if record is None:
                if t <= len(committed):
                    # Compacted, or inside a snapshot it installed: what it
                    # applied there is checked by _check_applied.
                    continue
                record = self._unlogged_record(node, t)
                if record is None:
                    self.fail(f"node {node.node_id} commits trans_id {t} that nobody holds")
            if t <= len(committed):
                known = committed[t - 1]
                if known.vote_id != record.vote_id or not same(known.entry, record.entry):
                    self.fail(f"invariant 4: node {node.node_id} commits {record} at {t}, "
                              f"but {known} was committed there")
            elif t == len(committed) + 1:
                committed.append(record)
                self.commit_votes.append(core.vote_id)
                for listener in self.listeners:
                    listener(record)
            else:
                self.fail(f"node {node.node_id} commits {t} past the known end {len(committed)}")
        node.seen_commit = c

    @staticmethod
    def _unlogged_record(node: SimNode, t: int) -> Record | None:
        """The record at t that the node committed and compacted away in
        the same step: in its unflushed Ready, or on its disk (unless the
        unflushed Ready replaces that part of the disk)."""
        ready = node.core.ready
        for record in ready.records:
            if record.trans_id == t:
                return record
        if ready.snapshot is not None or (ready.truncate_after is not None
                                          and t > ready.truncate_after):
            return None
        return node.disk_record(t)

    def _check_new_master(self, node: SimNode) -> None:
        log = node.core.log
        committed = self.committed
        base = log.base_trans_id
        if base > len(committed) or (base and committed[base - 1].vote_id != log.base_vote_id):
            self.fail(f"invariant 2: new master {node.node_id} has a log base {base} that is "
                      f"not a committed position (committed end {len(committed)})")
        vote_id = node.core.vote_id
        commit_votes = self.commit_votes
        for t in range(base + 1, len(committed) + 1):
            if commit_votes[t - 1] >= vote_id:
                # Committed under a later vote_id (or ours): this master is
                # stale (it won an old election whose votes reached it late,
                # e.g. after a pause) and can neither commit nor confirm a
                # read. The entry's own vote_id may be earlier than ours:
                # entries of vote 3 that only the master of vote 3 held,
                # committed by the Noop of that node as master of vote 5,
                # are not in the log of a master of vote 4 that a voter
                # lacking them elected (seed 6346).
                continue
            known = committed[t - 1]
            record = log.get(t)
            if (record is None or record.vote_id != known.vote_id
                    or not same(record.entry, known.entry)):
                self.fail(f"invariant 2: node {node.node_id} became master of vote "
                          f"{node.core.vote_id} without committed entry {known} (has {record})")

    def _check_applied(self, node: SimNode) -> None:
        core = node.core
        if node.applied_base is None:  # a snapshot was loaded during this step
            node.applied_base = core.applied_id - len(node.applied)
            node.verified_upto = node.applied_base
            self.check_state(node, node.loaded_state, node.applied_base, "snapshot")
        base = node.applied_base
        if core.applied_id != base + len(node.applied):
            self.fail(f"node {node.node_id}: applied_id {core.applied_id} but "
                      f"{len(node.applied)} entries applied after {base}")
        if core.commit_id > core.applied_id:
            self.fail(f"node {node.node_id}: commit_id {core.commit_id} "
                      f"> applied_id {core.applied_id}")
        upto = core.commit_id
        if upto > len(self.committed):
            self.fail(f"node {node.node_id}: commit {upto} beyond the known end "
                      f"{len(self.committed)}")
        applied, committed = node.applied, self.committed
        for t in range(node.verified_upto + 1, upto + 1):
            if not same(applied[t - base - 1], committed[t - 1].entry):
                self.fail(f"invariant 4: node {node.node_id} applied {applied[t - base - 1]} at "
                          f"{t}; the committed entry is {committed[t - 1]}")
        if upto > node.verified_upto:
            node.verified_upto = upto

    # -- stores against the reference ------------------------------------------

    def reference(self, t: int) -> list:
        """Store.to_wire() of the committed sequence applied up to t."""
        cached = self.ref_cache.get(t)
        if cached is not None:
            return cached
        if t < self.ref_pos:
            store = Store(queue_size=self.net.queue_size, virtual_queues=self.net.virtual_queues)
            for record in self.committed[:t]:
                store.apply(record.entry)
            wire = store.to_wire()
        else:
            for record in self.committed[self.ref_pos:t]:
                self.ref.apply(record.entry)
            self.ref_pos = t
            wire = self.ref.to_wire()
        if len(self.ref_cache) > 64:
            self.ref_cache = {0: []}
        self.ref_cache[t] = wire
        return wire

    def check_state(self, node: SimNode, state: list | None, t: int, what: str) -> None:
        if t > len(self.committed):
            self.fail(f"node {node.node_id}: {what} at {t} beyond the committed end")
        if (state or []) != self.reference(t):
            self.fail(f"invariant 4: node {node.node_id}'s {what} at trans_id {t} differs "
                      f"from the committed sequence applied up to it")

    def check_stores(self, strict: bool) -> None:
        """Every live node whose store holds no speculative entry must equal
        the reference at its position (strict: every live node, which must
        then be fully applied)."""
        for node in self.net.nodes.values():
            core = node.core
            if core is None:
                continue
            core.store._check()
            if core.applied_id != core.commit_id:
                if strict:
                    self.fail(f"node {node.node_id}: applied {core.applied_id} "
                              f"!= commit {core.commit_id}")
                # A master's (or deposed master's) speculative entries are its log's.
                for k, entry in enumerate(node.applied[core.commit_id - node.applied_base:]):
                    record = core.log.get(core.commit_id + 1 + k)
                    if record is None or not same(record.entry, entry):
                        self.fail(f"node {node.node_id}: applied entry {entry} at "
                                  f"{core.commit_id + 1 + k} is not its log's {record}")
                continue
            if strict or core.applied_id >= self.ref_pos:
                self.check_state(node, core.store.to_wire(), core.applied_id, "store")

    def final_check(self) -> None:
        for i in sorted(self.net.dirty):
            self.net._flush(i)
        self.check_logs()
        self.check_stores(strict=True)


# -- clients, and invariants 6 and 7 ---------------------------------------------


# The refusals that rest on the state (a receipt that does not name the
# current delivery, a message not in flight): service.py answers them after
# the read index, as an answer that appends no entry.
READ_REFUSALS = frozenset({"stale receipt", "not in flight"})

# What a client sends for a receipt that is not one (garbage parses to this
# and matches nothing: wire/requests._receipt).
NO_RECEIPT = (0, 0, 0)


def _ignore(_result, _error) -> None:
    pass


class _Msg(NamedTuple):
    """One message as the committed history made it (Workload's model, kept
    apart from the store's code): what invariants 6 and 7 are held against."""

    deliveries: int  # committed deliveries so far
    epoch: int  # of the current delivery: its receipt is (epoch, msg_id, deliveries); 0: none
    retry_at_ms: int  # when the current lease runs out; 0: not in flight
    final: int  # FINAL_*: the current delivery is its last (leaves when the lease runs out)
    ready_ms: int  # deliverable from then, when not in flight
    ttl_ms: int
    retry_ms: int  # 0: at-most-once
    delivered_at: tuple[int, int] = (0, 0)  # (trans_id, vote_id) of the current delivery

    def receipt(self, msg_id: int) -> tuple[int, int, int] | None:
        return (self.epoch, msg_id, self.deliveries) if self.epoch else None

    def in_flight(self, now_ms: int) -> bool:
        """Delivered, unconfirmed, and its lease running: what nack and
        touch act on (a final delivery whose lease ran out is not, though it
        stays until the master moves it out)."""
        return bool(self.retry_at_ms) and self.retry_at_ms > now_ms


@dataclass(slots=True)
class _Decision:
    """What a master decided an entry from, kept until the entry commits (or
    forever, if it never does): the checks on the committed history need
    the decision's clock and the receipt it accepted."""

    kind: str  # the request's kind, "move" (a consume's dead-letter move) or "expire"
    now_ms: int
    receipt: tuple[int, int, int] | None = None
    receipt_from: tuple[int, int] | None = None  # (trans_id, vote_id) of the delivery it came with
    # a consume's or touch's lease, a nack's delay (ms; a lease of 0: the retry)
    lease_ms: int = 0


@dataclass
class _Produced:
    """One message a client produces (its data names it: a retry, or a
    resend with its dedup_id, sends the same data), and the messages
    masters decided for it: ((queue, msg_id), ...) per decision that
    stored it (a Produce, or an item of a ProduceBatch)."""

    retry_ms: int
    decisions: list = field(default_factory=list)  # targets stored, one per decision
    # The messages answers named, in the order acknowledged (a resend
    # stores a second copy once its dedup window has passed, or when the
    # first was never committed; an answer `duplicate: true` names the
    # first's).
    acked_targets: list = field(default_factory=list)
    acked_at: int | None = None  # event number of the first ack

    @property
    def targets(self) -> tuple:
        return self.acked_targets[0] if self.acked_targets else self.decisions[-1]


class _Accepted(NamedTuple):
    """A committed acceptance of a dedup id: the item of a ProduceBatch
    that stored it (the dedup table's entry, as the model keeps it)."""

    trans_id: int
    accepted_ms: int
    targets: tuple  # ((queue, msg_id), ...): the message(s) it made
    data: str


@dataclass
class _Delivery:
    decided_at: int  # event number of the decision
    now_ms: int
    retry_at_ms: int
    queue: str
    msg_id: int
    data: str
    deliveries: int = 1  # as the answer said, counting this one
    epoch: int = 0  # the entry's (0: no receipt)
    final: int = FINAL_NONE
    position: tuple[int, int] = (0, 0)  # (trans_id, vote_id) of the entry

    @property
    def receipt(self) -> tuple[int, int, int] | None:
        return (self.epoch, self.msg_id, self.deliveries) if self.epoch else None

    def committed_form(self) -> tuple:
        """(queue, msg_id, retry_at_ms, epoch, final): one delivery of a
        Consume or of a ConsumeMany's items."""
        return self.queue, self.msg_id, self.retry_at_ms, self.epoch, self.final


@dataclass(eq=False)
class _Request:
    """A client request and its attempts. `kind`: produce, consume, confirm,
    nack, touch, configure, clear."""

    kind: str
    queue: str
    produce: ProduceRequest | None = None
    # produce with a priority, dedup ids or several messages (decide_produce_batch)
    batch: ProduceBatchRequest | None = None
    data: str | None = None  # produce: the (first) message's data
    consume: ConsumeRequest | None = None  # consume
    msg_id: int = 0  # confirm, nack, touch
    receipt: tuple[int, int, int] | None = None  # confirm, nack, touch
    receipt_from: tuple[int, int] | None = None  # (trans_id, vote_id) of its delivery
    delay_ms: int = 0  # nack
    lease_ms: int = 0  # touch
    settings: dict | None = None  # configure
    # produce with `batch`: per item, (the messages the answer names,
    # duplicate?), from the acknowledged answer
    answer: list | None = None
    max_attempts: int = 1
    node: int | None = None  # the node the client sent its last attempt to
    attempts: int = 0
    live: int = 0  # the attempt whose answer the client waits for (0: none)
    finished: bool = False  # answered, refused, or given up
    acked: _Attempt | None = None  # the attempt whose answer was acknowledged
    outcomes: list = field(default_factory=list)  # per attempt: "ok", a reason, "timeout"
    executed: list = field(default_factory=list)  # (node, "read" or "write") of each execution

    @property
    def key(self) -> tuple[str, int]:
        return self.queue, self.msg_id


@dataclass(eq=False)
class _Attempt:
    request: _Request
    number: int
    node: int  # where the client sent it
    target: int  # where it was executed (node, or the master node forwarded it to)
    entry: object  # the decided entry; None: an answer that appends no entry (a read)
    refusal: str | None = None  # a read: the refusal it answers ("stale receipt", ...)
    plan: list | None = None  # a produce with `batch`: decide_produce_batch's plan
    trans_id: int = 0  # the entry's position; for a read, the master's last entry
    vote_id: int = 0  # ...and that entry's vote_id
    decided_at: int = 0  # event number
    now_ms: int = 0
    need: int = 0  # a read: the newest position an answer acknowledged before it rests on
    answered: bool = False
    timeout: list | None = None  # the client's timer (Network.schedule handle)


RANDOM = object()  # Workload.produce and friends: draw this argument at random


class Workload:
    """Clients, and what they were told. A request goes to a node (at random,
    or `at_master`); a node that believes it is master executes it
    (Store.decide_*, then NativeCore.propose, or NativeCore.read_index for
    an answer that appends no entry, as service.py does), any other node
    forwards it to the master it knows, if its link to it is up. In async
    mode a master takes a produce, a plain consume or a confirm (what
    service.py hands to commit_now) to `Network.append_now` while
    `Network.commits_at_once` holds, and answers once its record is
    written, as an async proposal is answered once persisted. A client
    that gets no answer within `timeout_ms`, or an error ("outcome unknown",
    "not master", "no leader"), retries after a backoff that doubles with
    each attempt, on the same node (`same_node_rate`; never after "no
    leader") or another, up to `max_attempts` attempts.

    Requests (issue 14's consumer controls included): produce; consume
    (one queue or several, with `count`, with a `lease`; the receipt of
    each delivery is (the deciding master's vote_id, msg_id, deliveries),
    as service.py makes it from Engine.epoch); confirm, nack (with a delay)
    and touch (with a lease), each with the receipt of the client's last
    delivery, an older one, garbage, or none; configure (max_deliveries,
    dead_letter, and issue 15's dedup_window, max_size, paused); clear.
    Issue 15's produces: with a dedup_id and/or a priority (the single form
    of decide_produce_batch), or a batch (`messages`) whose items mostly
    carry their own dedup ids, now and then one listed twice. A request
    with dedup ids that got no answer is retried as every request is (on
    another node after "no leader", so mostly on a new master after a
    failover), and `resend` sends an earlier one again as a new request,
    whatever its client was told (a restarted producer). One schedule in
    three starts with a short dedup window on one queue, so that resends
    straddle its end. An answer of duplicates only appends no entry: it is
    sent after the read index, as service.py does. Like service.py, a
    master moves a message that a consume finds over its queue's
    max_deliveries out first (a DeadLetter no client waits for), and moves
    out final deliveries whose lease ran out (its tick: decide_expired,
    armed for next_final_ms whenever a node is seen master with final
    leases). Long poll (`wait`) is not simulated. Delivery order (FIFO,
    priorities) is not checked here: the store's stateful test does it.

    On the committed history, in both modes, as each entry commits (the
    Checker's listener; `_Msg` is the model, built from the entries alone):
    a delivery is of a message the history holds, due at the decision's
    clock (its ready time, or its lease ran out and was not final), its
    receipt's epoch is the vote_id of the master that wrote it, and its
    `deliveries` never exceeds its queue's max_deliveries (the one that
    reaches it is final); a retry=0 message is delivered once; a confirm
    decided with a receipt, and a nack or touch decided with one, found
    the delivery the receipt names current (invariant 7: a receipt
    confirms only the delivery it names); a nack or touch found the
    message in flight; a dead-letter move was due (its final lease ran
    out, it was over max_deliveries, or nacked in flight) and goes where
    its queue's dead_letter says; a produce went into queues neither
    paused in nor full (max_size), all the messages of a batch at once;
    nothing was delivered from a queue paused out; a clear removed every
    message. Dedup ids (`_commit_produce_batch`): each committed acceptance
    of a dedup id by a queue is its first, or comes at least the queue's
    shortest window since (a shorter window may have pruned it) after the
    last one: a resend within the window is never stored twice, whichever
    master it reached, after any number of failovers, snapshots and
    restarts; the entry prunes the table by its own clock and window.

    `strict` (quorum mode) checks what async mode does not promise: every
    acknowledged answer rests on the committed history. A write's entry is
    committed at the position it was appended at; a read's state (the
    master's last entry when it answered) is committed, and no older than
    anything acknowledged before the read was asked (linearizable); an
    "unknown id" confirm was answered from a state where the committed
    history had deleted the message, an empty consume from one where
    nothing was ready, a "stale receipt" from one where the receipt did not
    name the current delivery, a "not in flight" from one where the message
    was not in flight; a delivery's `deliveries` is the committed count;
    and no delivery commits after an acknowledged confirm of that message
    (invariant 6, issue 12). A produce with dedup ids: each id of an
    acknowledged answer names the message of the newest committed
    acceptance of it at or before the position the answer rests on (a
    `duplicate: true` names a committed message with the same data,
    accepted within the window: never one a master lost), and every answer
    decided within the window of an acceptance an earlier answer named
    names it too (`_check_dedup_answer`). A batch's answer rests on its
    one entry, committed whole. A clear's `cleared` is what the committed
    state held. After the run, every acknowledged produce is still stored,
    or deleted by a delivery, a confirm, a dead-letter move (whose copies
    are, in turn, accounted for the same way) or a clear; in both modes the
    model holds as many messages per queue as the master's store."""

    def __init__(self, net: Network, rng: random.Random, *, queues=("a", "b"),
                 dead_letters=("dl",), strict: bool = True, at_master: bool = False,
                 max_attempts: int = 4, timeout_ms: int = 400,
                 backoff_ms: tuple[int, int] = (20, 250), same_node_rate: float = 0.5) -> None:
        self.net = net
        self.rng = rng
        self.queues = queues
        self.dead_letters = dead_letters  # queues configure names as dead-letter queues
        self.strict = strict
        self.at_master = at_master
        self.max_attempts = max_attempts
        self.timeout_ms = timeout_ms
        self.backoff_ms = backoff_ms
        self.same_node_rate = same_node_rate
        self.events = 0
        self.counter = 0
        self.requests: list[_Request] = []
        self.open_requests = 0
        self.produced: dict[str, _Produced] = {}  # data -> its request's decisions
        # Messages are (queue, msg_id); a produce to a virtual queue makes one per real queue.
        self.deliveries: dict[tuple[str, int], list[_Delivery]] = {}  # acknowledged deliveries
        # message -> event number of a confirm's ack
        self.confirmed: dict[tuple[str, int], int] = {}
        self.answers = collections.Counter()
        # What masters decided (committed or not): message -> data, and the
        # earliest ready time, of the produces and dead-letter moves that made it.
        self.key_data: dict[tuple[str, int], set[str]] = {}
        self.key_ready: dict[tuple[str, int], int] = {}
        # (trans_id, vote_id) -> the decision of the entry a master appended there
        self.decisions_at: dict[tuple[int, int], _Decision] = {}
        # node -> (at_ms, incarnation) of its armed expiry tick
        self.expiry_armed: dict[int, tuple[int, int]] = {}
        # node -> (now_ms, incarnation, vote_id) of its last expiry tick as master:
        # what was due then and is still there, it failed to move (no new
        # tick for it; run_schedule then fails, rather than spin)
        self.expiry_ran: dict[int, tuple[int, int, int]] = {}
        # Against the committed history (strict):
        self.acked_upto = 0  # the newest position an acknowledged answer rests on
        self.waiting_commit: dict[int, list] = {}  # position -> checks once it is committed
        self.confirm_pos: dict[tuple[str, int], int] = {}  # message -> position of an acked confirm
        # (position, consume request, now_ms) of acked empty consumes
        self.empty_reads: list[tuple[int, ConsumeRequest, int]] = []
        # What the committed history did to each message:
        self.consumed_at: dict[tuple[str, int], list[int]] = {}
        self.deleted_at: dict[tuple[str, int], int] = {}
        self.retry_of: dict[tuple[str, int], int] = {}
        self.moved: dict[tuple[str, int], tuple] = {}  # dead-lettered -> its copies (targets)
        # message -> [(trans_id, _Msg or None once deleted)], oldest first
        self.history: dict[tuple[str, int], list[tuple[int, _Msg | None]]] = {}
        self.settings: dict[str, dict] = {}  # queue -> its committed settings, where set
        # queue -> [(trans_id, dedup_window_ms)] of the committed changes
        self.window_changes: dict[str, list[tuple[int, int]]] = {}
        self.live: dict[str, set[int]] = {}  # queue -> msg_ids the committed history holds
        # (queue produced to, dedup_id) -> its committed acceptances, oldest first
        self.accepted: dict[tuple[str, str], list[_Accepted]] = {}
        # (queue produced to, dedup_id) -> (trans_id, accepted_ms, targets)
        # of each acceptance an acknowledged answer named
        self.dedup_acked: dict[tuple[str, str], list[tuple[int, int, tuple]]] = {}
        self.dedup_counter = 0
        if net.checker is not None:
            net.checker.listeners.append(self.on_commit)
        net.observers.append(self._on_observe)

    def fail(self, text: str, invariant: int = 6) -> None:
        raise SimFailure(f"seed {self.net.seed}: t={self.net.now - START_MS}ms: "
                         f"invariant {invariant}: {text}")

    def _tick(self) -> int:
        self.events += 1
        return self.events

    def idle(self) -> bool:
        """No request waits for an answer or a retry."""
        return self.open_requests == 0

    def stop(self) -> None:
        """The clients go away: no more attempts; what is still open is
        given up (a late answer is not acknowledged). The masters' expiry
        ticks go on."""
        for req in self.requests:
            self._finish(req)

    def delivered(self, data: str) -> list[_Delivery]:
        """The acknowledged deliveries of the messages made from `data`."""
        return [d for ds in self.deliveries.values() for d in ds if d.data == data]

    # -- operations ------------------------------------------------------------

    def random_op(self) -> None:
        r = self.rng.random()
        if r < 0.30:
            self.produce(dedup_id=RANDOM, priority=RANDOM)
        elif r < 0.34:
            self.produce_batch()
        elif r < 0.42:
            self.resend()
        elif r < 0.72:
            self.consume(**self._random_consume())
        elif r < 0.84:
            self.confirm(receipt=RANDOM)
        elif r < 0.91:
            self.nack()
        elif r < 0.965:
            self.touch()
        elif r < 0.995:
            self.configure()
        else:
            self.clear()

    def _random_consume(self) -> dict:
        rng = self.rng
        r = rng.random()
        if r < 0.1:
            names = list(self.queues)
            rng.shuffle(names)
            args: dict = {"queues": tuple(names)}
        elif r < 0.22 and self.dead_letters:
            args = {"queue": rng.choice(self.dead_letters)}
        else:
            args = {"queue": rng.choice(self.queues)}
        if rng.random() < 0.15:
            args["count"] = rng.choice((2, 3, 5))
        if rng.random() < 0.2:
            args["lease_ms"] = rng.choice((100, 400, 1500))
        return args

    def _produce_queue(self, queue: str | None) -> str:
        rng = self.rng
        if queue is None:
            virtual = sorted(self.net.virtual_queues)
            queue = (rng.choice(virtual) if virtual and rng.random() < 0.15
                     else rng.choice(self.queues))
        return queue

    def _new_item(self, retry_s, delay_s, ttl_s, dedup_id,
                  priority) -> tuple[ProduceItem, bool]:
        """A new message's data ("m<n>") and fields, and whether it has a
        priority or a dedup id (a plain produce has neither); unset fields
        drawn at random (dedup_id RANDOM: "d<n>" now and then, True:
        always)."""
        rng = self.rng
        if retry_s is None:
            retry_s = rng.choice((0, 0, 0.2, 1))
        if delay_s is RANDOM:
            delay_s = rng.choice((0.1, 0.5)) if rng.random() < 0.3 else None
        if ttl_s is RANDOM:
            ttl_s = rng.choice((0.3, 1.5)) if retry_s and rng.random() < 0.3 else None
        if dedup_id is RANDOM:
            dedup_id = rng.random() < 0.4
        if dedup_id is True:
            self.dedup_counter += 1
            dedup_id = f"d{self.dedup_counter}"
        if priority is RANDOM:
            priority = rng.choice((0, 7, DEFAULT_PRIORITY, 5000)) if rng.random() < 0.15 else None
        self.counter += 1
        data = f"m{self.counter}"
        self.produced[data] = _Produced(retry_ms=round(retry_s * 1000))
        item = ProduceItem(data, delay_s, ttl_s, retry_s,
                           DEFAULT_PRIORITY if priority is None else priority, dedup_id or "")
        return item, bool(dedup_id) or priority is not None

    def produce(self, queue: str | None = None, *, retry_s: float | None = None,
                delay_s: object = RANDOM, ttl_s: object = RANDOM, node: int | None = None,
                max_attempts: int | None = None, dedup_id: object = None,
                priority: object = None) -> str:
        """A client produces a new message (data "m<n>"); returns its data.
        Unset arguments are drawn at random; delay_s/ttl_s None mean none.
        With a `dedup_id` (a string, True for a new one, RANDOM: now and
        then) or a `priority` (RANDOM: now and then) it is the single form
        of a batch produce (decide_produce_batch), as service.py makes it."""
        queue = self._produce_queue(queue)
        item, extended = self._new_item(retry_s, delay_s, ttl_s, dedup_id, priority)
        if extended:
            req = _Request("produce", queue, data=item.data,
                           batch=ProduceBatchRequest(queue, (item,), False))
        else:
            req = _Request("produce", queue, data=item.data, produce=ProduceRequest(
                queue=queue, data=item.data, delay_s=item.delay_s, ttl_s=item.ttl_s,
                retry_s=item.retry_s))
        self._start(req, node, max_attempts)
        return item.data

    def produce_batch(self, queue: str | None = None, count: int | None = None, *,
                      node: int | None = None, max_attempts: int | None = None,
                      dedup: object = RANDOM, retry_s: float | None = None,
                      delay_s: object = RANDOM, ttl_s: object = RANDOM) -> _Request:
        """A produce with `messages`: `count` new messages (drawn: 2 to 6),
        each with its own dedup id (`dedup` True; RANDOM: most of them),
        now and then a priority; now and then one listed twice (the same
        data and dedup id: the answer names the first for both)."""
        rng = self.rng
        queue = self._produce_queue(queue)
        if count is None:
            count = rng.randint(2, 6)
        items = [self._new_item(retry_s, delay_s, ttl_s,
                                (rng.random() < 0.8) if dedup is RANDOM else dedup, RANDOM)[0]
                 for _ in range(count)]
        with_ids = [item for item in items if item.dedup_id]
        if with_ids and dedup is RANDOM and rng.random() < 0.2:
            items.insert(rng.randrange(1, len(items) + 1), rng.choice(with_ids))
        req = _Request("produce", queue, data=items[0].data,
                       batch=ProduceBatchRequest(queue, tuple(items), True))
        return self._start(req, node, max_attempts)

    def resend(self, req: _Request | None = None, *, node: int | None = None,
               max_attempts: int | None = None) -> _Request | None:
        """A producer sends an earlier produce with dedup ids again as a new
        request (a restarted producer, a retried Spark task), whatever it
        was told: by default one drawn from those that carried dedup ids."""
        if req is None:
            sent = [r for r in self.requests
                    if r.batch is not None and any(i.dedup_id for i in r.batch.items)]
            if not sent:
                self.produce(dedup_id=True)
                return None
            req = self.rng.choice(sent)
        self.answers["resends"] += 1
        return self._start(_Request("produce", req.queue, data=req.data, batch=req.batch),
                           node, max_attempts)

    def clear(self, queue: str | None = None, *, node: int | None = None) -> _Request:
        """Remove every message of a queue (action 6)."""
        if queue is None:
            queue = self.rng.choice(self.queues + self.dead_letters[:1])
        return self._start(_Request("clear", queue), node)

    def consume(self, queue: str | None = None, *, node: int | None = None,
                queues: tuple[str, ...] | None = None, count: int | None = None,
                lease_ms: int = 0) -> _Request:
        """A consume of `queue` (or of `queues`, naming each message's
        queue), of up to `count` messages, with a lease (0: the retry)."""
        names = queues or (queue or self.rng.choice(self.queues),)
        creq = ConsumeRequest(names, count, 0, lease_ms, queues is not None)
        return self._start(_Request("consume", names[0], consume=creq), node)

    def _pick(self, in_flight_rate: float) -> tuple[str, int] | None:
        """A delivered message: mostly one still in flight as far as the
        client knows, now and then any (confirmed, gone, redelivered)."""
        keys = sorted(self.deliveries)
        if not keys:
            return None
        candidates = [k for k in keys
                      if self.deliveries[k][-1].retry_at_ms and k not in self.confirmed]
        if candidates and self.rng.random() < in_flight_rate:
            return self.rng.choice(candidates)
        return self.rng.choice(keys)

    def _receipt_for(self, key: tuple[str, int]) -> tuple:
        """The receipt a client sends, and the position of the delivery it
        came with: its last delivery's mostly, else an older delivery's,
        garbage, or none."""
        r = self.rng.random()
        ds = [d for d in self.deliveries.get(key, ()) if d.receipt is not None]
        if not ds or r >= 0.8:
            return None, None
        if r >= 0.75:
            return NO_RECEIPT, None
        d = ds[-1] if r < 0.6 or len(ds) == 1 else self.rng.choice(ds[:-1])
        return d.receipt, d.position

    def _receipt_arg(self, key: tuple[str, int], receipt: object) -> tuple:
        """(receipt, position of its delivery) for a request's `receipt`
        argument: RANDOM (drawn), a _Delivery (its receipt), a receipt
        tuple, or None."""
        if receipt is RANDOM:
            return self._receipt_for(key)
        if type(receipt) is _Delivery:
            return receipt.receipt, receipt.position
        return receipt, None

    def confirm(self, key: tuple[str, int] | None = None, *, node: int | None = None,
                receipt: object = None) -> _Request | None:
        """Confirm a delivered message: by default one still in flight, now
        and then one already confirmed or gone (an unknown id). `receipt`:
        see `_receipt_arg`."""
        key = key or self._pick(0.85)
        if key is None:
            return None
        receipt, receipt_from = self._receipt_arg(key, receipt)
        return self._start(_Request("confirm", key[0], msg_id=key[1], receipt=receipt,
                                    receipt_from=receipt_from), node)

    def nack(self, key: tuple[str, int] | None = None, *, node: int | None = None,
             receipt: object = RANDOM, delay_ms: int | None = None) -> _Request | None:
        """Give a delivered message back, deliverable after `delay_ms`."""
        key = key or self._pick(0.85)
        if key is None:
            return None
        receipt, receipt_from = self._receipt_arg(key, receipt)
        if delay_ms is None:
            delay_ms = self.rng.choice((0, 0, 100, 500))
        return self._start(_Request("nack", key[0], msg_id=key[1], receipt=receipt,
                                    receipt_from=receipt_from, delay_ms=delay_ms), node)

    def touch(self, key: tuple[str, int] | None = None, *, node: int | None = None,
              receipt: object = RANDOM, lease_ms: int | None = None) -> _Request | None:
        """Change a delivered message's lease to `lease_ms` from now (0: its retry)."""
        key = key or self._pick(0.85)
        if key is None:
            return None
        receipt, receipt_from = self._receipt_arg(key, receipt)
        if lease_ms is None:
            lease_ms = self.rng.choice((0, 100, 300, 1500))
        return self._start(_Request("touch", key[0], msg_id=key[1], receipt=receipt,
                                    receipt_from=receipt_from, lease_ms=lease_ms), node)

    def configure(self, queue: str | None = None, settings: dict | None = None, *,
                  node: int | None = None, max_attempts: int | None = None) -> _Request:
        """Set a queue's max_deliveries and/or dead_letter ("" for none), and
        now and then its dedup_window_ms, max_size or paused (SETTINGS
        names, as the request layer hands them to decide_configure)."""
        rng = self.rng
        if queue is None:
            queue = rng.choice(self.queues + self.dead_letters[:1])
        if settings is None:
            settings = {}
            r = rng.random()
            if r < 0.7:
                settings["max_deliveries"] = rng.choice((0, 1, 2, 3))
            if r > 0.4:
                others = [q for q in self.queues if q != queue]
                settings["dead_letter"] = rng.choice(
                    ("", *self.dead_letters, *self.dead_letters, *others,
                     *sorted(self.net.virtual_queues)))
            # issue 15's settings (windows short enough for resends to
            # straddle their end)
            if rng.random() < 0.5:
                settings["dedup_window_ms"] = rng.choice((0, 400, 1500, 300_000))
            if rng.random() < 0.2:
                settings["max_size"] = rng.choice((0, 0, 3, 12))
            if rng.random() < 0.2:
                settings["paused"] = rng.choice(("none", "none", "in", "out", "all"))
        return self._start(_Request("configure", queue, settings=settings), node, max_attempts)

    # -- attempts ----------------------------------------------------------------

    def _start(self, req: _Request, node: int | None, max_attempts: int | None = None) -> _Request:
        req.max_attempts = max_attempts or self.max_attempts
        self.requests.append(req)
        self.open_requests += 1
        if node is None:
            node = self.net.master() if self.at_master else None
            if node is None:
                node = self.rng.choice(self.net.ids)
        self._attempt(req, node)
        return req

    def _route(self, node: int) -> int | None:
        """Where a request sent to `node` goes: nowhere if the node is down,
        itself if it believes it is master, else the master it knows, if
        its link to it is up (ClusterEngine.forward)."""
        net = self.net
        core = net.core(node)
        if core is None:
            return None
        if core.role is Role.MASTER:
            return node
        leader = core.leader_id
        if not leader or leader == node or (node, leader) in net.cut or not net.alive(leader):
            return None
        return leader

    def _attempt(self, req: _Request, node: int) -> None:
        """The client sends attempt number req.attempts + 1 to `node` and
        starts its timer; a paused node reads it when it resumes."""
        if req.finished:  # stopped
            return
        net = self.net
        req.attempts += 1
        req.node = node
        req.live = number = req.attempts
        timeout = net.schedule(self.timeout_ms, partial(self._timeout, req, number))
        if not net.alive(node):
            self._client_error(req, number, timeout, "connection refused", elsewhere=True)
            return
        net.run_on(node, partial(self._receive, req, number, node, timeout))

    def _receive(self, req: _Request, number: int, node: int, timeout: list) -> None:
        target = self._route(node)
        if target is None:
            self._client_error(req, number, timeout, "no leader", elsewhere=True)
            return
        self.net.run_on(target, partial(self._execute, req, number, node, target, timeout))

    def _decide(self, req: _Request, core: NativeCore) -> tuple:
        """The master's decision, as service.py makes it: an entry, None (an
        answer that appends no entry) or a reason; and, for a produce with
        `batch`, decide_produce_batch's plan (else None)."""
        store, now = core.store, self.net.now
        kind = req.kind
        if kind == "produce":
            if req.batch is None:
                return store.decide_produce(req.produce, now), None
            outcome = store.decide_produce_batch(req.batch, now)
            return outcome if type(outcome) is tuple else (outcome, None)
        return self._decide_other(req, core), None

    def _decide_other(self, req: _Request, core: NativeCore):
        store, now = core.store, self.net.now
        kind = req.kind
        if kind == "consume":
            # Service._decide_consume: a message over max_deliveries moves out first.
            while True:
                outcome = store.decide_consume(req.consume, now, core.vote_id)
                if type(outcome) is not DeadLetter:
                    return outcome
                refused = self._propose_unanswered(core, outcome, "move")
                if refused is not None:
                    return refused  # deciding again would give the same move
        if kind == "confirm":
            if (req.receipt is not None and req.queue not in store.virtual_queues
                    and not store.check_receipt(req.queue, req.msg_id, req.receipt)):
                return "stale receipt"
            return store.decide_confirm(ConfirmRequest(req.queue, req.msg_id, req.receipt))
        if kind == "nack":
            return store.decide_nack(req.queue, req.msg_id, req.receipt, now + req.delay_ms, now)
        if kind == "touch":
            return store.decide_touch(req.queue, req.msg_id, req.receipt, req.lease_ms, now)
        if kind == "clear":
            return store.decide_clear(req.queue)
        return store.decide_configure(req.queue, req.settings)

    def _propose_unanswered(self, core: NativeCore, entry, kind: str) -> str | None:
        """Append an entry no client waits for (a dead-letter move); the
        reason if the core refused it at once (a master handing its role
        over), as Service._move sees it: then nothing changed."""
        refused: list[str] = []
        core.propose(entry, lambda _result, error: None if error is None else refused.append(error))
        if refused:
            return refused[0]
        self._note_decision(core, entry, kind)
        return None

    def _note_decision(self, core: NativeCore, entry, kind: str,
                       req: _Request | None = None) -> None:
        """Remember what the entry just appended was decided from."""
        now = self.net.now
        decision = _Decision(kind, now)
        if req is not None:
            if req.receipt is not None:
                decision.receipt, decision.receipt_from = req.receipt, req.receipt_from
            decision.lease_ms = (req.consume.lease_ms if req.consume is not None
                                 else req.delay_ms if kind == "nack" else req.lease_ms)
        self.decisions_at[(core.log.last_trans_id, core.vote_id)] = decision
        if type(entry) is Produce:
            for target in entry.targets:
                self.key_data.setdefault(target, set()).add(entry.data)
                self.key_ready[target] = min(self.key_ready.get(target, entry.ready_ms),
                                             entry.ready_ms)
        elif type(entry) is ProduceBatch:
            for k, item in enumerate(entry.items):
                for name, first in entry.targets:
                    target = (name, first + k)
                    self.key_data.setdefault(target, set()).add(item[0])
                    self.key_ready[target] = min(self.key_ready.get(target, item[1]), item[1])
        elif type(entry) is DeadLetter:
            data = self.key_data.get((entry.queue, entry.msg_id), set())
            for target in entry.targets:
                self.key_data.setdefault(target, set()).update(data)
                self.key_ready[target] = min(self.key_ready.get(target, entry.ready_ms),
                                             entry.ready_ms)

    def _execute(self, req: _Request, number: int, node: int, target: int, timeout: list) -> None:
        """The master (as far as it knows) decides the request, as service.py does."""
        net = self.net
        core = net.core(target)
        if core is None or core.role is not Role.MASTER:
            self._client_error(req, number, timeout, "not master", elsewhere=True)
            return
        outcome, plan = self._decide(req, core)
        if outcome == native.TRANSFERRING or (type(outcome) is not str and outcome is not None
                                             and core.transferring):
            # A master handing its role over refuses every write at once,
            # appending nothing (NativeCore.propose): "no leader", which
            # clients retry elsewhere.
            self.answers["transferring"] += 1
            self._client_error(req, number, timeout, native.TRANSFERRING, elsewhere=True)
            net._flush(target)
            net.observe((target,))
            return
        refusal = None
        if type(outcome) is str:
            if outcome not in READ_REFUSALS:  # refused: a definite answer
                if req.live == number and not req.finished:
                    net.cancel(timeout)
                    req.outcomes.append(outcome)
                    self._finish(req)
                    self.answers["refused"] += 1
                    if req.kind in ("produce", "clear"):
                        # "queue full: a" -> "queue full"; "messages[2]: time error" -> "time error"
                        reason = outcome.split(": ", 1)[outcome.startswith("messages[")]
                        self.answers[f"{req.kind}_refused_{reason}"] += 1
                net._flush(target)
                net.observe((target,))
                return
            refusal, outcome = outcome, None  # rests on the state: after the read index
        att = _Attempt(req, number, node, target, outcome, refusal=refusal,
                       plan=plan, decided_at=self._tick(), now_ms=net.now,
                       need=self.acked_upto, timeout=timeout)
        req.executed.append((target, "read" if outcome is None else "write"))
        done = partial(self._answered, att)
        fast = False
        if outcome is None:
            att.trans_id = core.log.last_trans_id
            att.vote_id = core.log.vote_id_at(att.trans_id) or 0
            core.read_index(done)
        else:
            if type(outcome) is Produce:
                self.produced[req.data].decisions.append(outcome.targets)
            elif type(outcome) is ProduceBatch:
                for k, item in enumerate(outcome.items):
                    self.produced[item[0]].decisions.append(
                        tuple((name, first + k) for name, first in outcome.targets))
            fast = self._answers_now(req) and net.commits_at_once(target)
            answer = None
            if fast:
                answer = net.append_now(target, outcome, done)[1]
            else:
                core.propose(outcome, done)
            att.trans_id, att.vote_id = core.log.last_trans_id, core.vote_id
            self._note_decision(core, outcome, req.kind, req)
            if answer is not None:
                answer()
        if fast and net.batch_rate and net.rng.random() < net.batch_rate:
            # The fast path's flush (the push) comes once per event-loop
            # turn: more requests (and peer messages) may come first.
            net.dirty.add(target)
        else:
            net._flush(target)
        net.observe((target,))

    @staticmethod
    def _answers_now(req: _Request) -> bool:
        """Whether service.py hands this request's entry to commit_now when
        the engine commits at once: a produce without dedup ids, priority
        or messages (answer_now, or _produce), a consume of one queue
        without count or lease (answer_now; long poll is not simulated),
        a confirm (answer_now). The others are proposed, as are dead-letter
        moves, which turn the fast path off until the flush."""
        if req.kind == "produce":
            return req.batch is None
        if req.kind == "consume":
            creq = req.consume
            return creq is not None and creq.batch is None and not creq.lease_ms and not creq.many
        return req.kind == "confirm"

    # -- the masters' expiry tick (Service.tick) ------------------------------------

    def _on_observe(self, ids) -> None:
        """Network observer: a master holding final leases has its expiry
        tick armed for the earliest (Service.role_changed and
        _delivered_later arm it; so does every tick for the next one)."""
        nodes = self.net.nodes
        for i in ids:
            node = nodes[i]
            core = node.core
            if core is None or core.role is not Role.MASTER or not core.store.final_queues:
                continue
            at = core.store.next_final_ms()
            armed = self.expiry_armed.get(i)
            if at is None or (armed is not None and armed[1] == node.incarnation
                              and armed[0] <= at):
                continue
            if self.expiry_ran.get(i, (-1,))[0] >= at and self.expiry_ran[i][1:] == (
                    node.incarnation, core.vote_id):
                continue  # not moved by the last tick: a new tick would spin
            self.expiry_armed[i] = (at, node.incarnation)
            self.net.schedule(max(0, at - self.net.now), partial(self._expire, i), i)

    def _expire(self, i: int) -> None:
        """Service.tick on node i: move out final deliveries whose lease ran out."""
        self.expiry_armed.pop(i, None)
        net = self.net
        core = net.core(i)
        if core is None or core.role is not Role.MASTER:
            return
        store = core.store
        for _ in range(EXPIRE_BATCH):
            moves = store.decide_expired(net.now, 1)
            if not moves:
                break
            if self._propose_unanswered(core, moves[0], "expire") is not None:
                # refused (a leader transfer): Service.tick tries again later
                self.expiry_armed[i] = (net.now + EXPIRE_RETRY_MS, net.nodes[i].incarnation)
                net.schedule(EXPIRE_RETRY_MS, partial(self._expire, i), i)
                break
            self.answers["expired"] += 1
        self.expiry_ran[i] = (net.now, net.nodes[i].incarnation, core.vote_id)
        net._flush(i)
        net.observe((i,))

    def overdue_final(self, i: int) -> int | None:
        """When the earliest final lease on node i ran out, if it has."""
        at = self.net.core(i).store.next_final_ms()
        return at if at is not None and at < self.net.now else None

    # -- answers ------------------------------------------------------------------

    def _client_error(self, req: _Request, number: int, timeout: list, reason: str,
                      elsewhere: bool = False) -> None:
        """An error answer to attempt `number`, if the client still waits for it."""
        if req.live != number or req.finished:
            return
        self.net.cancel(timeout)
        req.outcomes.append(reason)
        self._retry_later(req, elsewhere)

    def _finish(self, req: _Request) -> None:
        if not req.finished:
            req.finished = True
            req.live = 0
            self.open_requests -= 1

    def _timeout(self, req: _Request, number: int) -> None:
        if req.live == number and not req.finished:
            req.outcomes.append("timeout")
            self._retry_later(req)

    def _retry_later(self, req: _Request, elsewhere: bool = False) -> None:
        """Retry after a backoff: on the same node (unless it refused:
        `elsewhere`) or, now and then, another."""
        req.live = 0
        if req.attempts >= req.max_attempts:
            self._finish(req)
            self.answers["given_up"] += 1
            return
        self.answers["retries"] += 1
        rng = self.rng
        node = (req.node if not elsewhere and rng.random() < self.same_node_rate
                else rng.choice(self.net.ids))
        # The client's backoff doubles with each attempt, up to 1 s (qserver.client.core).
        delay = min(rng.randint(*self.backoff_ms) << (req.attempts - 1), 1000)
        self.net.schedule(delay, partial(self._attempt, req, node))

    def _answered(self, att: _Attempt, result, error) -> None:
        """The node's answer to an attempt (from a Ready's answers)."""
        if att.answered:
            self.fail(f"{att.request.kind} attempt answered twice", 7)
        att.answered = True
        if att.timeout is not None:
            self.net.cancel(att.timeout)
        req = att.request
        if req.live != att.number or req.finished:
            self.answers["late"] += 1  # the client gave up on this attempt
            return
        net = self.net
        if error is None and att.target != att.node and (
                not net.alive(att.node) or (att.target, att.node) in net.cut):
            error = "master unreachable; outcome unknown"  # the forwarded answer is lost
        if error is not None:
            self.answers["error"] += 1
            req.outcomes.append(error)
            self._retry_later(req)
            return
        req.outcomes.append("ok" if att.refusal is None else att.refusal)
        self._finish(req)
        req.acked = att
        if att.entry is None:
            self.answers["ok" if att.refusal is None else "refused_read"] += 1
            if req.kind == "produce":
                self._batch_acked(att, ())
            else:
                self._read_acked(att)
            return
        self.answers["ok"] += 1
        kind = req.kind
        if kind == "produce":
            entry = att.entry
            if tuple(result) != entry.targets:
                self.fail(f"produce of {req.data} answered {result}, decided {entry.targets}")
            if req.batch is None:
                self._produce_acked(req.data, entry.targets)
                self._write_acked(att, f"produce of {req.data}")
            else:
                self._batch_acked(att, entry.targets)
        elif kind == "clear":
            self.answers["clear_ok"] += 1
            self._write_acked(att, f"clear of {req.queue} (cleared {result})",
                              partial(self._check_cleared, att, result))
        elif kind == "consume":
            self._consume_acked(att, result)
        elif kind == "confirm":
            key = req.key
            self.confirmed.setdefault(key, self._tick())
            self._write_acked(att, f"confirm of {key}"
                              + (f" with receipt {req.receipt}" if req.receipt else ""))
            if self.strict:
                self._confirm_acked(key, att.trans_id)
        else:
            self.answers[f"{kind}_ok"] += 1
            self._write_acked(att, f"{kind} of {req.key}" if kind != "configure"
                              else f"configure of {req.queue} {req.settings}")

    def _produce_acked(self, data: str, targets: tuple) -> None:
        info = self.produced[data]
        if targets not in info.acked_targets:
            info.acked_targets.append(targets)
        if info.acked_at is None:
            info.acked_at = self._tick()

    def _batch_answer(self, att: _Attempt, targets: tuple) -> list:
        """What service.py's answer to a produce with `batch` names, item
        by item: (the messages, duplicate?, the item's index in the entry
        or None), from the plan and the entry's targets (() for an answer
        of duplicates only)."""
        owner = att.request.queue
        out = []
        for step in att.plan:
            if type(step) is int:
                out.append((tuple((name, first + step) for name, first in targets), False, step))
            elif step[0] == "same":  # a dedup id listed earlier in the same batch
                out.append((tuple((name, first + step[1]) for name, first in targets), True,
                            None))
            else:
                ref = step[1]
                out.append((((owner, ref),) if type(ref) is int else tuple(ref), True, None))
        return out

    def _batch_acked(self, att: _Attempt, targets: tuple) -> None:
        """An answer to a produce with `batch` (a write, or duplicates
        only: a read) was acknowledged: in quorum mode, once the position
        it rests on commits, each of its dedup ids must name the message
        the committed history accepted it as (`_check_dedup_answer`)."""
        req = att.request
        answer = req.answer = self._batch_answer(att, targets)
        for item, (named, duplicate, _k) in zip(req.batch.items, answer, strict=True):
            self._produce_acked(item.data, named)
            if duplicate:
                self.answers["duplicate"] += 1
        what = (f"produce of {[item.data for item in req.batch.items]} to {req.queue}, "
                f"answered {[(named, dup) for named, dup, _k in answer]}")
        check = partial(self._check_dedup_answer, att, answer, what)
        if att.entry is not None:
            self._write_acked(att, what, check)
        elif self.strict:
            if att.trans_id < att.need:
                self.fail(f"{what} from the state at trans_id {att.trans_id}, but an answer "
                          f"acknowledged before it was asked rests on trans_id {att.need} "
                          f"(a stale read)", 7)
            self.acked_upto = max(self.acked_upto, att.trans_id)
            self._when_committed(att.trans_id, att.vote_id, None, what, check)

    def _consume_acked(self, att: _Attempt, result) -> None:
        entry = att.entry
        if type(entry) is Consume:
            items = [(entry.queue, entry.msg_id, entry.retry_at_ms, entry.epoch, entry.final)]
            answered = [(entry.queue, *result)]
        else:
            items = [(q, i, r, entry.epoch if r else 0, f) for q, i, r, f in entry.items]
            answered = list(result)
        if [(q, i) for q, i, *_ in items] != [(q, i) for q, i, *_ in answered]:
            self.fail(f"consume decided {entry}, answered {result}")
        delivered = []
        for (queue, msg_id, retry_at_ms, epoch, final), (_q, _i, data, deliveries) in zip(
                items, answered):
            d = _Delivery(att.decided_at, att.now_ms, retry_at_ms, queue, msg_id, data,
                          deliveries, epoch, final, (att.trans_id, att.vote_id))
            self._delivered(d)
            delivered.append(d)

        def counts_match() -> None:
            for d in delivered:
                state = self._state_at((d.queue, d.msg_id), att.trans_id, after=True)
                committed = state.deliveries if state is not None else None
                if state is None:  # deleted by this delivery: the count before it, plus one
                    before = self._state_at((d.queue, d.msg_id), att.trans_id, after=False)
                    committed = before.deliveries + 1 if before is not None else None
                if committed != d.deliveries:
                    self.fail(f"delivery of {d.queue}/{d.msg_id} answered deliveries="
                              f"{d.deliveries}; the committed history counts {committed}", 7)

        what = ", ".join(f"{d.queue}/{d.msg_id}" for d in delivered)
        self._write_acked(att, f"delivery of {what}", counts_match)

    # -- acknowledged answers against the committed history ---------------------

    def _write_acked(self, att: _Attempt, what: str, then=None) -> None:
        if self.strict:
            self._when_committed(att.trans_id, att.vote_id, att.entry, what, then)
            self.acked_upto = max(self.acked_upto, att.trans_id)

    def _read_acked(self, att: _Attempt) -> None:
        req = att.request
        if att.refusal is None and req.kind == "confirm":
            self.confirmed.setdefault(req.key, self._tick())
            self.answers["read_confirm"] += 1
        elif att.refusal is None:
            self.answers["read_empty"] += 1
        else:
            self.answers[f"{req.kind}_{att.refusal.replace(' ', '_')}"] += 1
        if not self.strict:
            return
        t = att.trans_id
        if att.refusal is not None:
            what = (f"{req.kind} of {req.queue}/{req.msg_id} with receipt {req.receipt} "
                    f"answered {att.refusal!r}")
        elif req.kind == "confirm":
            what = f"confirm of {req.queue}/{req.msg_id} answered 'unknown id'"
        elif req.kind == "clear":
            what = f"clear of {req.queue} answered 'cleared: 0'"
        else:
            what = f"empty consume of {req.consume.queues}"
        if t < att.need:
            self.fail(f"{what} from the state at trans_id {t}, but an answer acknowledged "
                      f"before it was asked rests on trans_id {att.need} (a stale read)", 7)
        self.acked_upto = max(self.acked_upto, t)
        if att.refusal is not None:
            self._when_committed(t, att.vote_id, None, what,
                                 partial(self._check_refusal, att, what))
        elif req.kind == "confirm":
            key = req.key

            def deleted_by_then(key=key, t=t, what=what) -> None:
                at = self.deleted_at.get(key)
                if at is None or at > t:
                    self.fail(f"{what} from the state at trans_id {t}; the committed history "
                              f"deletes it {'never' if at is None else f'at {at}'}")

            self._when_committed(t, att.vote_id, None, what, deleted_by_then)
            self._confirm_acked(key, t)
        elif req.kind == "clear":
            self._when_committed(t, att.vote_id, None, what,
                                 partial(self._check_cleared, att, 0))
        else:
            self._when_committed(t, att.vote_id, None, what)
            self.empty_reads.append((t, req.consume, att.now_ms))

    def _check_cleared(self, att: _Attempt, count: int) -> None:
        """A clear's `cleared` is what the committed state held (before the
        clear entry, or where a read of 0 was answered)."""
        queue, t = att.request.queue, att.trans_id
        held = sum(1 for key in self.history
                   if key[0] == queue and self._state_at(key, t, after=att.entry is None))
        if held != count:
            self.fail(f"clear of {queue} answered cleared={count} at trans_id {t}; the committed "
                      f"state held {held} messages there", 7)

    def _check_dedup_answer(self, att: _Attempt, answer: list, what: str) -> None:
        """An acknowledged answer to a produce with dedup ids, once the
        position p it rests on is committed (its entry, or for an answer of
        duplicates only the master's last entry when it read): each dedup
        id names the message of the newest committed acceptance of that id
        at or before p (invariant 7: a `duplicate: true` names a committed
        message, with this data, accepted within the window); and once an
        answer named an acceptance, every later answer decided within its
        window names it too (issue 15: a resend is recognised after any
        number of failovers)."""
        req = att.request
        owner, p, entry = req.queue, att.trans_id, att.entry
        for item, (named, duplicate, k) in zip(req.batch.items, answer, strict=True):
            dedup_id = item.dedup_id
            if not dedup_id or (k is not None and not entry.items[k][5]):
                continue  # none, or the window was 0: the entry does not record it
            key = (owner, dedup_id)
            acc = self._accepted_at(key, p)
            if acc is None or acc.targets != named:
                self.fail(f"{what}: dedup id {dedup_id} answered {named} (duplicate: "
                          f"{duplicate}); the committed history's acceptance of it at or "
                          f"before trans_id {p} is {acc}", 7)
            if duplicate:
                if acc.data != item.data:
                    self.fail(f"{what}: duplicate of {named}, whose committed data is "
                              f"{acc.data}", 7)
                window = self._window_at(owner, p)
                if att.now_ms >= acc.accepted_ms + window:
                    self.fail(f"{what}: dedup id {dedup_id} recognised at {att.now_ms}, past "
                              f"its window ({window} ms from {acc.accepted_ms})", 7)
            acked = self.dedup_acked.setdefault(key, [])
            for t0, accepted_ms, targets in acked:
                if (t0 <= p and targets != named
                        and att.now_ms < accepted_ms + self._window_min(owner, t0, p)):
                    self.fail(f"{what}: dedup id {dedup_id} was acknowledged as {targets} "
                              f"(accepted at trans_id {t0}, {accepted_ms}); decided "
                              f"{att.now_ms - accepted_ms} ms later, within the window, the "
                              f"answer names {named}", 7)
            if (acc.trans_id, acc.accepted_ms, named) not in acked:
                acked.append((acc.trans_id, acc.accepted_ms, named))

    def _check_refusal(self, att: _Attempt, what: str) -> None:
        """A "stale receipt" or "not in flight" refusal agrees with the
        committed state it was read from."""
        req = att.request
        state = self._state_at(req.key, att.trans_id, after=True)
        current = state.receipt(req.msg_id) if state is not None else None
        if att.refusal == "stale receipt":
            if req.receipt is not None and current == req.receipt:
                self.fail(f"{what} at trans_id {att.trans_id}, where it names the current "
                          f"delivery", 7)
        elif req.receipt is not None and current != req.receipt:
            self.fail(f"{what} at trans_id {att.trans_id}, where the receipt is stale "
                      f"(current: {current})", 7)
        elif state is not None and state.in_flight(att.now_ms):
            self.fail(f"{what} at trans_id {att.trans_id}, where it is in flight at "
                      f"{att.now_ms}: {state}", 7)

    def _when_committed(self, t: int, vote_id: int, entry, what: str, then=None) -> None:
        """Check, once the committed sequence reaches t, that it holds the
        entry (a write) or an entry of vote_id (a read's state) there."""
        if t <= len(self.net.checker.committed):
            self._check_committed(t, vote_id, entry, what, then)
        else:
            self.waiting_commit.setdefault(t, []).append((vote_id, entry, what, then))

    def _check_committed(self, t: int, vote_id: int, entry, what: str, then) -> None:
        if t:
            record = self.net.checker.committed[t - 1]
            if record.vote_id != vote_id or (entry is not None and not same(record.entry, entry)):
                self.fail(f"{what} was acknowledged, resting on trans_id {t} of vote {vote_id}; "
                          f"the committed entry there is {record}", 7)
        if then is not None:
            then()

    def _confirm_acked(self, key: tuple[str, int], t: int) -> None:
        if t < self.confirm_pos.get(key, t + 1):
            self.confirm_pos[key] = t
        for p in self.consumed_at.get(key, ()):
            if p > t:
                self.fail(f"{key} delivered at trans_id {p}, after its confirm was acknowledged "
                          f"at trans_id {t}")

    # -- the committed history (the model) ------------------------------------------

    def _state(self, key: tuple[str, int]) -> _Msg | None:
        """The message as the committed history has made it so far."""
        states = self.history.get(key)
        return states[-1][1] if states else None

    def _state_at(self, key: tuple[str, int], t: int, *, after: bool) -> _Msg | None:
        """The message in the committed state at trans_id t (`after`: with
        the entry at t applied; else just before it)."""
        for pos, state in reversed(self.history.get(key, ())):
            if pos < t or (after and pos == t):
                return state
        return None

    def _set(self, key: tuple[str, int], t: int, state: _Msg | None) -> None:
        self.history.setdefault(key, []).append((t, state))
        if state is None:
            self.deleted_at.setdefault(key, t)
            self.live.get(key[0], set()).discard(key[1])
        else:
            self.live.setdefault(key[0], set()).add(key[1])

    def _window_at(self, owner: str, t: int) -> int:
        """The dedup window (ms) of queue `owner` in the committed state at
        trans_id t (a virtual queue's: its first real queue's)."""
        queue = self.net.virtual_queues.get(owner, (owner,))[0]
        window = SETTINGS["dedup_window_ms"][1]
        for pos, value in self.window_changes.get(queue, ()):
            if pos > t:
                break
            window = value
        return window

    def _window_min(self, owner: str, t0: int, t1: int) -> int:
        """The shortest dedup window `owner` had in the committed states
        from trans_id t0 to t1: an id accepted at t0 is still in the table
        at t1 if its age is below this (a shorter window in between may
        have pruned it)."""
        queue = self.net.virtual_queues.get(owner, (owner,))[0]
        window = self._window_at(owner, t0)
        for pos, value in self.window_changes.get(queue, ()):
            if t0 < pos <= t1:
                window = min(window, value)
        return window

    def _accepted_at(self, key: tuple[str, str], t: int) -> _Accepted | None:
        """The newest committed acceptance of dedup id key[1] by queue key[0]
        at or before trans_id t."""
        for acc in reversed(self.accepted.get(key, ())):
            if acc.trans_id <= t:
                return acc
        return None

    def _check_intake(self, t: int, targets: tuple, count: int, what: str) -> None:
        """A committed produce of `count` messages into each real queue of
        `targets`: none was paused in, none goes past its max_size."""
        for name, _first in targets:
            paused = self._setting(name, "paused")
            if paused in ("in", "all"):
                self.fail(f"{what} committed at trans_id {t} into {name}, paused {paused!r}")
            limit = self._setting(name, "max_size") or self.net.queue_size
            held = len(self.live.get(name, ()))
            if held + count > limit:
                self.fail(f"{what} committed at trans_id {t}: {name} held {held} messages, "
                          f"max_size {limit}")

    def _commit_produce_batch(self, t: int, e: ProduceBatch, decision: _Decision | None) -> None:
        """A batch (or a produce with a priority or a dedup id) joined the
        committed history: all its messages at once; each dedup id it
        records is new, or its last acceptance is older than the window
        (the shortest the queue had since: issue 15, a resend within the
        window is never stored twice, whichever master it reaches)."""
        owner = e.queue
        what = f"produce of {[item[0] for item in e.items]} to {owner}"
        self._check_intake(t, e.targets, len(e.items), what)
        window = self._window_at(owner, t - 1)
        if e.cutoff_ms != max(0, e.accepted_ms - window):
            self.fail(f"{what} at trans_id {t}, accepted at {e.accepted_ms}, prunes its dedup "
                      f"table up to {e.cutoff_ms}; its window is {window} ms")
        if decision is not None and decision.now_ms != e.accepted_ms:
            self.fail(f"{what} decided at {decision.now_ms}, recorded as accepted at "
                      f"{e.accepted_ms}")
        recorded = set()
        for k, item in enumerate(e.items):
            targets = tuple((name, first + k) for name, first in e.targets)
            state = _Msg(0, 0, 0, FINAL_NONE, item[1], item[2], item[3])
            for target in targets:
                self.retry_of[target] = item[3]
                self._set(target, t, state)
            dedup_id = item[5]
            if not dedup_id:
                continue
            if not window or dedup_id in recorded:
                self.fail(f"{what} at trans_id {t} records dedup id {dedup_id} "
                          f"{'with the window off' if not window else 'twice'}")
            recorded.add(dedup_id)
            accepted = self.accepted.setdefault((owner, dedup_id), [])
            if accepted:
                prev = accepted[-1]
                shortest = self._window_min(owner, prev.trans_id, t - 1)
                if e.accepted_ms < prev.accepted_ms + shortest:
                    self.fail(f"dedup id {dedup_id} of {owner} stored again as {targets} "
                              f"({item[0]}) at trans_id {t}, {e.accepted_ms - prev.accepted_ms} "
                              f"ms after it was accepted as {prev.targets} ({prev.data}) at "
                              f"trans_id {prev.trans_id}: within its window ({shortest} ms), "
                              f"the resend was not recognised", 7)
                self.answers["dedup_stored_again"] += 1  # past the window
            accepted.append(_Accepted(t, e.accepted_ms, targets, item[0]))

    def _setting(self, queue: str, name: str):
        settings = self.settings.get(queue)
        if settings is None or name not in settings:
            return SETTINGS[name][1]
        return settings[name]

    def on_commit(self, record: Record) -> None:
        """Checker listener: `record` joined the committed sequence."""
        t, e = record.trans_id, record.entry
        kind = type(e)
        decision = self.decisions_at.pop((t, record.vote_id), None)
        if kind is Produce:
            self._check_intake(t, e.targets, 1, f"produce of {e.data}")
            state = _Msg(0, 0, 0, FINAL_NONE, e.ready_ms, e.ttl_ms, e.retry_ms)
            for target in e.targets:
                self.retry_of[target] = e.retry_ms
                self._set(target, t, state)
        elif kind is Consume:
            self._commit_delivery(t, record.vote_id, e.queue, e.msg_id, e.retry_at_ms, e.epoch,
                                  e.final, decision)
        elif kind is ConsumeMany:
            for queue, msg_id, retry_at_ms, final in e.items:
                self._commit_delivery(t, record.vote_id, queue, msg_id, retry_at_ms,
                                      e.epoch if retry_at_ms else 0, final, decision)
        elif kind is Confirm:
            key = (e.queue, e.msg_id)
            state = self._state(key)
            if state is None:
                self.fail(f"confirm of {key} committed at trans_id {t}; the committed history "
                          f"does not hold it (deleted at {self.deleted_at.get(key)})", 7)
            if decision is not None and decision.receipt is not None:
                self._receipt_current(key, state, decision, t, "confirm")
            self._set(key, t, None)
        elif kind is Nack or kind is Touch:
            key = (e.queue, e.msg_id)
            state = self._in_flight_for(key, decision, t, "nack" if kind is Nack else "touch")
            if decision is not None and decision.kind == kind.__name__.lower():
                due = decision.now_ms + (decision.lease_ms or (0 if kind is Nack
                                                               else state.retry_ms))
                if (e.ready_ms if kind is Nack else e.retry_at_ms) != due:
                    self.fail(f"{e} decided at {decision.now_ms} (trans_id {t}), with a "
                              f"{'delay' if kind is Nack else 'lease'} of {decision.lease_ms} "
                              f"ms: the message is due again at {due}")
            if kind is Nack:
                if e.ready_ms >= state.ttl_ms:
                    self.fail(f"nack of {key} at trans_id {t} makes it ready at {e.ready_ms}, "
                              f"at or past its ttl {state.ttl_ms} (it should leave the queue)")
                state = state._replace(retry_at_ms=0, final=FINAL_NONE, ready_ms=e.ready_ms)
            else:
                state = state._replace(retry_at_ms=e.retry_at_ms, final=e.final)
                self._check_lease(key, state, t)
            self._set(key, t, state)
        elif kind is DeadLetter:
            self._commit_dead_letter(t, e, decision)
        elif kind is Configure:
            self.settings.setdefault(e.queue, {}).update(e.settings)
            for name, value in e.settings:
                if name == "dedup_window_ms":
                    self.window_changes.setdefault(e.queue, []).append((t, value))
        elif kind is ProduceBatch:
            self._commit_produce_batch(t, e, decision)
        elif kind is Clear:
            for msg_id in sorted(self.live.get(e.queue, ())):
                self._set((e.queue, msg_id), t, None)
        waiting = self.waiting_commit.pop(t, None)
        if waiting:
            for vote_id, entry, what, then in waiting:
                self._check_committed(t, vote_id, entry, what, then)

    def _receipt_current(self, key, state: _Msg, decision: _Decision, t: int,
                         what: str) -> None:
        """Invariant 7: a receipt a master accepted named the current
        delivery: the very one the client got it with (a receipt of a
        delivery that a failover undid must not pass for another's)."""
        receipt, came_with = decision.receipt, decision.receipt_from
        current = state.receipt(key[1])
        if current != receipt:
            self.fail(f"{what} of {key} with receipt {receipt} committed at trans_id {t}; the "
                      f"current delivery there is {current} ({state})", 7)
        if came_with is not None and came_with != state.delivered_at:
            self.fail(f"{what} of {key} with receipt {receipt} committed at trans_id {t}: the "
                      f"client got it with the delivery at (trans_id, vote) {came_with}; the "
                      f"current delivery, with the same receipt, is the one at "
                      f"{state.delivered_at}", 7)

    def _in_flight_for(self, key, decision: _Decision | None, t: int, what: str) -> _Msg:
        """The message a committed nack, touch or dead-letter move of a
        nack acts on: held, in flight at the decision, its receipt current."""
        state = self._state(key)
        if state is None:
            self.fail(f"{what} of {key} committed at trans_id {t}; the committed history does "
                      f"not hold it (deleted at {self.deleted_at.get(key)})", 7)
        if decision is not None:
            if not state.in_flight(decision.now_ms):
                self.fail(f"{what} of {key} decided at {decision.now_ms}, committed at trans_id "
                          f"{t}; it was not in flight there: {state}", 7)
            if decision.receipt is not None:
                self._receipt_current(key, state, decision, t, what)
        return state

    def _commit_delivery(self, t: int, vote_id: int, queue: str, msg_id: int, retry_at_ms: int,
                         epoch: int, final: int, decision: _Decision | None) -> None:
        key = (queue, msg_id)
        confirmed = self.confirm_pos.get(key)
        if confirmed is not None and t > confirmed:
            self.fail(f"{key} delivered at trans_id {t}, after its confirm was acknowledged "
                      f"at trans_id {confirmed}")
        before = self.consumed_at.setdefault(key, [])
        if before and not self.retry_of.get(key):
            self.fail(f"retry=0 message {key} delivered at trans_id {before[0]} and {t}")
        before.append(t)
        state = self._state(key)
        if state is None:
            self.fail(f"{key} delivered at trans_id {t}; the committed history does not hold it "
                      f"(deleted at {self.deleted_at.get(key)})")
        paused = self._setting(queue, "paused")
        if paused in ("out", "all"):
            self.fail(f"{key} delivered at trans_id {t} from {queue}, paused {paused!r}")
        if decision is not None:
            now = decision.now_ms
            lease_ms = decision.lease_ms or state.retry_ms
            if retry_at_ms and retry_at_ms != now + lease_ms:
                self.fail(f"{key} delivered at {now} (trans_id {t}) with a lease of {lease_ms} "
                          f"ms, due again at {retry_at_ms}")
            if state.retry_at_ms:
                if state.final:
                    self.fail(f"{key} delivered again at trans_id {t} while its last delivery "
                              f"was in flight: {state}")
                if now < state.retry_at_ms:
                    self.fail(f"{key} redelivered at {now} (trans_id {t}), before its lease ran "
                              f"out at {state.retry_at_ms}")
            elif now < state.ready_ms:
                self.fail(f"{key} delivered at {now} (trans_id {t}), before its ready time "
                          f"{state.ready_ms}")
        deliveries = state.deliveries + 1
        max_deliveries = self._setting(queue, "max_deliveries")
        if max_deliveries and deliveries > max_deliveries:
            self.fail(f"{key} delivered for the {deliveries}th time at trans_id {t}; its queue's "
                      f"max_deliveries is {max_deliveries}")
        if not retry_at_ms:
            self._set(key, t, None)  # at-most-once, or its last delivery before the ttl
            return
        if not state.retry_ms:
            self.fail(f"retry=0 message {key} in flight after its delivery at trans_id {t}")
        if epoch != vote_id:
            self.fail(f"delivery of {key} at trans_id {t}, written in vote {vote_id}, has a "
                      f"receipt of epoch {epoch}", 7)
        if max_deliveries and deliveries == max_deliveries and final != FINAL_MAX_DELIVERIES:
            self.fail(f"delivery {deliveries} of {key} (max_deliveries {max_deliveries}) at "
                      f"trans_id {t} is not its last (final={final})")
        state = _Msg(deliveries, epoch, retry_at_ms, final, state.ready_ms, state.ttl_ms,
                     state.retry_ms, (t, vote_id))
        self._check_lease(key, state, t)
        self._set(key, t, state)

    def _check_lease(self, key, state: _Msg, t: int) -> None:
        """A lease that reaches the ttl makes its delivery the last: it is
        final (or the delivery deleted the message), never redelivered."""
        if not state.final and state.retry_at_ms >= state.ttl_ms:
            self.fail(f"{key}'s lease at trans_id {t} runs to {state.retry_at_ms}, at or past "
                      f"its ttl {state.ttl_ms}, yet it is not its last delivery")

    def _commit_dead_letter(self, t: int, e: DeadLetter, decision: _Decision | None) -> None:
        key = (e.queue, e.msg_id)
        if decision is not None and decision.kind == "nack":
            state = self._in_flight_for(key, decision, t, "dead-letter move by a nack")
        else:
            state = self._state(key)
            if state is None:
                self.fail(f"dead-letter move of {key} at trans_id {t}; the committed history "
                          f"does not hold it (deleted at {self.deleted_at.get(key)})")
        max_deliveries = self._setting(e.queue, "max_deliveries")
        if decision is not None:
            now = decision.now_ms
            if e.ready_ms != now:
                self.fail(f"{key} dead-lettered at {now} (trans_id {t}); its copies are ready "
                          f"at {e.ready_ms}")
            if decision.kind == "expire" and (
                    state.final != e.reason or not state.retry_at_ms or state.retry_at_ms > now):
                self.fail(f"{key} moved out at {now} (trans_id {t}, reason {e.reason}); it was "
                          f"not a final delivery whose lease had run out: {state}")
            if decision.kind == "move" and (e.reason != FINAL_MAX_DELIVERIES or not max_deliveries
                                            or state.deliveries < max_deliveries):
                self.fail(f"{key} moved out by a consume at trans_id {t} (reason {e.reason}) "
                          f"after {state.deliveries} deliveries, max_deliveries "
                          f"{max_deliveries}")
        if e.reason == FINAL_EXPIRED and not state.deliveries:
            self.fail(f"{key} dead-lettered as expired at trans_id {t}, never delivered")
        dead_letter = self._setting(e.queue, "dead_letter")
        expected = self.net.virtual_queues.get(dead_letter, (dead_letter,)) if dead_letter else ()
        if tuple(name for name, _ in e.targets) != tuple(expected):
            self.fail(f"{key} dead-lettered to {e.targets} at trans_id {t}; its queue's "
                      f"dead_letter is {dead_letter!r}")
        self._set(key, t, None)
        self.moved[key] = e.targets
        copy_state = _Msg(0, 0, 0, FINAL_NONE, e.ready_ms, e.ttl_ms, state.retry_ms)
        for target in e.targets:
            self.retry_of[target] = state.retry_ms
            self._set(target, t, copy_state)

    # -- invariant 6 on what the clients were told --------------------------------

    def _delivered(self, d: _Delivery) -> None:
        info = self.produced.get(d.data)
        if info is None:
            self.fail(f"delivered {d.data!r}, which no client produced")
        key = (d.queue, d.msg_id)
        if d.data not in self.key_data.get(key, ()):
            self.fail(f"delivered {d.data} as {key}; it was produced as {info.decisions}")
        if d.now_ms < self.key_ready.get(key, d.now_ms):
            self.fail(f"{d.data} delivered at {d.now_ms}, before its ready time")
        before = self.deliveries.setdefault(key, [])
        if self.strict:
            if not info.retry_ms and before:
                self.fail(f"retry=0 message {key} ({d.data}) delivered twice")
            # Acks of two deliveries may arrive out of order (a deposed
            # master can still learn a commit late): order each pair by
            # the decision. (Whether a redelivery came after the lease ran
            # out, which nacks and touches move, is checked on the
            # committed history, against the decision's clock.)
            for other in before:
                first = other if other.decided_at < d.decided_at else d
                if not first.retry_at_ms:
                    self.fail(f"{key} ({d.data}) delivered again after its last delivery")
            confirmed = self.confirmed.get(key)
            if confirmed is not None and confirmed < d.decided_at:
                self.fail(f"{key} ({d.data}) delivered after its confirm was acknowledged")
        before.append(d)

    def final_check(self, master: int) -> None:
        """After the cluster settled: every acknowledged answer rests on a
        committed position; every acknowledged produce is in the committed
        sequence with the msg_ids its client was told, and still in the
        master's store unless a committed delivery, confirm or dead-letter
        move deleted it (and then its dead-letter copies, likewise); every
        acknowledged delivery is committed, of the data produced there, not
        before its ready time; every empty consume was empty in the
        committed state it was read from. (Quorum mode only: async mode may
        lose acked writes.) In both modes, the model built from the
        committed entries holds as many messages per queue as the master's
        store."""
        store = self.net.core(master).store
        for name, ids in sorted(self.live.items()):
            q = store.get(name)
            if len(ids) != (len(q.messages) if q is not None else 0):
                self.fail(f"the committed history leaves {len(ids)} messages in {name}; the "
                          f"master's store holds {len(q.messages) if q is not None else 0}")
        if not self.strict:
            return
        committed = self.net.checker.committed
        for t, waiting in sorted(self.waiting_commit.items()):
            self.fail(f"{waiting[0][2]} was acknowledged, resting on trans_id {t}, which "
                      f"never committed (the committed sequence ends at {len(committed)})", 7)
        # message -> (data, ready_ms) of the committed produce or dead-letter move that made it
        made: dict[tuple[str, int], tuple[str, int]] = {}
        consumes: set[tuple] = set()
        for record in committed:
            e = record.entry
            kind = type(e)
            if kind is Produce:
                for target in e.targets:
                    if target in made:
                        self.fail(f"msg_id {target} given to {made[target][0]} and to {e.data}")
                    made[target] = (e.data, e.ready_ms)
            elif kind is ProduceBatch:
                for k, item in enumerate(e.items):
                    for name, first in e.targets:
                        target = (name, first + k)
                        if target in made:
                            self.fail(f"msg_id {target} given to {made[target][0]} and to "
                                      f"{item[0]}")
                        made[target] = (item[0], item[1])
            elif kind is Consume:
                consumes.add((e.queue, e.msg_id, e.retry_at_ms, e.epoch, e.final))
            elif kind is ConsumeMany:
                for q, i, r, f in e.items:
                    consumes.add((q, i, r, e.epoch if r else 0, f))
            elif kind is DeadLetter:
                for target in e.targets:
                    if target in made:
                        self.fail(f"msg_id {target} given to {made[target][0]} and to the "
                                  f"dead letter of {e.queue}/{e.msg_id}")
                    made[target] = (made[(e.queue, e.msg_id)][0], e.ready_ms)

        def accounted(key: tuple[str, int], data: str) -> bool:
            if key in self.deleted_at:
                return all(accounted(target, data) for target in self.moved.get(key, ()))
            q = store.get(key[0])
            msg = q.messages.get(key[1]) if q is not None else None
            return msg is not None and message_data(msg) == data

        for data, info in self.produced.items():
            for queue, msg_id in (target for targets in info.acked_targets
                                  for target in targets):
                stored = made.get((queue, msg_id))
                if stored is None or stored[0] != data:
                    self.fail(f"acknowledged produce {data} ({queue}/{msg_id}) was lost")
                if not accounted((queue, msg_id), data):
                    self.fail(f"acknowledged {data} ({queue}/{msg_id}) is neither delivered for "
                              f"good, confirmed, dead-lettered, cleared, nor in the master's "
                              f"store")
        for key, ds in self.deliveries.items():
            for d in ds:
                if d.committed_form() not in consumes:
                    self.fail(f"acknowledged delivery of {d.data} as {key} was lost")
                stored = made.get(key)
                if stored is None or stored[0] != d.data:
                    self.fail(f"acknowledged delivery of {d.data} as {key}, which the committed "
                              f"log gives to {stored and stored[0]}")
                if d.now_ms < stored[1]:
                    self.fail(f"{d.data} delivered at {d.now_ms}, before its ready time "
                              f"{stored[1]}")
        if self.empty_reads:
            state = Store(queue_size=self.net.queue_size, virtual_queues=self.net.virtual_queues)
            at = 0
            for t, creq, now_ms in sorted(self.empty_reads, key=lambda r: (r[0], r[2])):
                while at < t:
                    state.apply(committed[at].entry)
                    at += 1
                if state.decide_consume(creq, now_ms, 1) is not None:
                    self.fail(f"empty consume of {creq.queues} at {now_ms} acknowledged from "
                              f"the state at trans_id {t}, where a message was ready", 7)


# -- leader transfers ---------------------------------------------------------------


class Transfers:
    """Leader transfers asked of the cluster (Engine.transfer_leader on
    the native core), and what each was told. Mostly to a random other
    node, now and then to the master itself or to a node that is not a
    member, sometimes to a second node while one is under way; asked of
    the master, or now and then of a slave. Checks, as each ends: it ends
    once (a crashed node's end with it); an answer that names a new master
    names a node that was master in a later vote_id than the one the
    transfer began in (or the asker itself, at once, for itself); the
    refusals are the ones the asked node's role and the target call for.
    `final_check`: every transfer asked of a node still running has ended
    (each has a deadline of two election timeouts at most)."""

    def __init__(self, net: Network, rng: random.Random) -> None:
        self.net = net
        self.rng = rng
        # (asker, its incarnation, target, vote_id then, was master, results)
        self.asked: list[tuple[int, int, int, int, bool, list]] = []
        self.outcomes = collections.Counter()

    def random_transfer(self) -> None:
        net, rng = self.net, self.rng
        live = [i for i in net.ids if net.alive(i) and i not in net.paused]
        if not live:
            return
        m = net.master()
        asker = m if m in live and rng.random() < 0.85 else rng.choice(live)
        r = rng.random()
        if r < 0.06:
            target = asker
        elif r < 0.1:
            target = max(net.ids) + 1  # not a member
        else:
            target = rng.choice([i for i in net.ids if i != asker])
        core = net.core(asker)
        results: list = []
        self.asked.append((asker, net.nodes[asker].incarnation, target, core.vote_id,
                           core.role is Role.MASTER, results))
        net.transfer(asker, target, results)

    def _fail(self, text: str) -> None:
        raise SimFailure(f"seed {self.net.seed}: t={self.net.now - START_MS}ms: transfer: {text}")

    def final_check(self) -> None:
        net = self.net
        for asker, incarnation, target, vote_id, was_master, results in self.asked:
            if net.nodes[asker].incarnation != incarnation:
                if results:
                    self.outcomes["ended_then_crashed"] += 1
                continue  # crashed since: its answer went with it
            if len(results) != 1:
                self._fail(f"asked of node {asker} for {target} in vote {vote_id}: "
                           f"{len(results)} answers {results}")
            leader, reason = results[0]
            self.outcomes[reason or ("to_target" if leader == target else "to_other")] += 1
            if not was_master:
                if reason != native.NOT_MASTER:
                    self._fail(f"asked of slave {asker}: {results[0]}")
                continue
            if target == asker:
                if results[0] != (asker, None):
                    self._fail(f"to itself, master {asker}: {results[0]}")
                continue
            if target not in net.ids:
                if reason != native.NO_SUCH_NODE:
                    self._fail(f"to non-member {target}: {results[0]}")
                continue
            if reason is None:
                if leader is None or not any(
                        leader in masters for v, masters in net.masters_by_vote.items()
                        if v > vote_id):
                    self._fail(f"node {asker} (vote {vote_id}) told {leader} took over, which "
                               "was never master in a later vote")
            elif reason not in (native.NOT_CAUGHT_UP, native.TRANSFER_TIMED_OUT,
                                native.TRANSFER_IN_PROGRESS):
                self._fail(f"node {asker} to {target}: {results[0]}")


# -- random schedules -------------------------------------------------------------


@dataclass
class ScheduleStats:
    seed: int
    n: int
    async_mode: bool
    production: bool
    delivered: int
    elections: int
    committed: int
    acked: int
    virtual_ms: int
    counters: dict


FAULT_MIXES = ("mixed", "master_partitions")


def run_schedule(seed: int, *, n: int = 3, async_mode: bool = False, production: bool | None = None,
                 faults: str = "mixed", chaos_ms: int | None = None,
                 settle_ms: int = 30_000, transfers: bool | None = None) -> ScheduleStats:
    """One seeded schedule: random faults and client operations for
    `chaos_ms` of virtual time, then heal everything, restart every node,
    and require one master that everyone follows with identical state.
    `production`: the cluster adapter's configuration (external snapshots,
    deferred sync in quorum mode); None draws it from the seed (three
    schedules in four). `faults`: "mixed" (every kind), or
    "master_partitions" (the master cut off again and again while clients
    retry on it). `transfers`: leader transfers (Transfers) amid the
    faults; None draws it from the seed (one schedule in two) without
    touching the schedule's other draws, so a schedule without transfers
    is the one the seed gave before transfers existed. Any failure raises
    AssertionError naming the seed."""
    if faults not in FAULT_MIXES:
        raise ValueError(f"faults must be one of {FAULT_MIXES}")
    try:
        with compaction_slack(2):
            return _run_schedule(seed, n, async_mode, production, faults, chaos_ms, settle_ms,
                                 transfers)
    except SimFailure as exc:
        raise SimFailure(f"{exc} [run_schedule({seed}, n={n}, async_mode={async_mode}, "
                         f"faults={faults!r}, transfers={transfers})]") from exc
    except Exception as exc:  # an InvariantError in the core, or a bug in the sim
        raise SimFailure(f"seed {seed} (n={n}, async={async_mode}, faults={faults}): "
                         f"{type(exc).__name__}: {exc}") from exc


def _run_schedule(seed, n, async_mode, production, faults, chaos_ms, settle_ms,
                  transfers) -> ScheduleStats:
    rng = random.Random(f"schedule-{seed}-{n}-{async_mode}-{faults}")
    # Leader transfers draw from their own stream (see run_schedule).
    trng = random.Random(f"transfers-{seed}-{n}-{async_mode}-{faults}")
    if transfers is None:
        transfers = trng.random() < 0.5
    if production is None:
        production = rng.random() < 0.75
    # Snapshots on demand (a node without a data directory), from a stream
    # of their own: the other draws stay what they were for every seed.
    on_demand = production and random.Random(
        f"on-demand-{seed}-{n}-{async_mode}-{faults}").random() < 0.4
    log_size = rng.choice((100_000, 100_000, 40, 10, 4))
    sync_rate = rng.choice((100_000, 100_000, 500, 60))
    net = Network(n, seed, async_mode=async_mode, log_size=log_size, sync_rate=sync_rate,
                  virtual_queues={"ab": ("a", "b")},
                  external_snapshots=production, deferred_sync=production,
                  fsync_ms=rng.choice(((1, 2), (1, 8), (4, 30), (20, 120))),
                  snapshot_write_ms=rng.choice(((1, 5), (5, 60), (40, 400))),
                  snapshot_chunks=rng.choice(((1, 1), (1, 3), (1, 8))),
                  push_interval_ms=rng.choice((0, ASYNC_PUSH_INTERVAL_MS, 20)) if async_mode else 0,
                  snapshots_on_demand=on_demand)
    net.max_delay_ms = rng.choice((2, 5, 20, 80))
    net.drop_rate = rng.choice((0.0, 0.0, 0.02, 0.1))
    net.batch_rate = rng.choice((0.0, 0.0, 0.5, 0.9))
    net.dup_rate = rng.choice((0.0, 0.0, 0.0, 0.05))
    partitions = faults == "master_partitions"
    work = Workload(net, random.Random(rng.random()), strict=not async_mode,
                    max_attempts=rng.choice((1, 3, 6)) if not partitions else 8,
                    timeout_ms=rng.choice((250, 600, 1500)),
                    same_node_rate=rng.choice((0.3, 0.7, 0.95)) if not partitions else 0.9)
    if rng.random() < 0.35:
        # A short dedup window from the start, for resends to straddle its end.
        work.configure(rng.choice(work.queues), {"dedup_window_ms": rng.choice((300, 800, 2000))},
                       max_attempts=10)
    crash_ok = rng.random() < 0.7 and not partitions
    fault_rate = rng.choice((0.2, 0.4, 0.6))
    chaos_ms = chaos_ms if chaos_ms is not None else rng.randrange(2000, 5000)
    end = net.now + chaos_ms
    crashed: set[int] = set()
    ids = net.ids
    minority = n // 2

    def crash(victim: int | None) -> None:
        # Keep a majority up most of the time, so that the run does more
        # than hold elections.
        limit = minority if rng.random() < 0.9 else n
        if victim is not None and crash_ok and victim not in crashed and len(crashed) < limit:
            net.crash(victim)
            crashed.add(victim)

    def power_loss() -> None:
        # Every node at once: only what was fsynced survives (invariant 5).
        if crash_ok:
            for i in ids:
                if i not in crashed:
                    net.crash(i, drop_outgoing=True)
                    crashed.add(i)

    def restart() -> None:
        if crashed:
            i = rng.choice(sorted(crashed))
            crashed.discard(i)
            net.start(i)

    def partition_master() -> None:
        m = net.master()
        others = [i for i in ids if i != m]
        group = set(rng.sample(others, rng.randrange(0, minority)))
        if m is not None:
            group.add(m)  # the master on the minority side
        net.partition(group or {rng.choice(ids)})

    def cut_master_link() -> None:
        m = net.master()
        if m is not None:
            net.cut.add((m, rng.choice([i for i in ids if i != m])))  # one way only

    def pause() -> None:
        # SIGSTOP, mostly of the master, for up to a few election timeouts.
        victim = net.master() if rng.random() < 0.7 else rng.choice(ids)
        if victim is not None and net.alive(victim):
            net.pause(victim)
            net.schedule(rng.randrange(50, 1500), partial(net.resume, victim))

    def set_drop() -> None:
        net.drop_rate = rng.choice((0.0, 0.05, 0.2, 0.5))

    def set_delay() -> None:
        net.max_delay_ms = rng.choice((1, 5, 30, 150, 400))

    if partitions:
        faults_table = [
            (30, lambda: net.master() is not None and net.isolate(net.master())),
            (15, partition_master),
            (5, cut_master_link),
            (30, net.heal),
            (10, pause),
        ]
    else:
        faults_table = [  # (weight, action)
            (10, lambda: net.isolate(rng.choice(ids))),
            (16, lambda: net.master() is not None and net.isolate(net.master())),
            (8, lambda: net.partition(set(rng.sample(ids, rng.randrange(1, minority + 1))))),
            (8, partition_master),
            (8, lambda: net.cut.add(tuple(rng.sample(ids, 2)))),
            (5, cut_master_link),
            (18, net.heal),
            (6, lambda: crash(rng.choice(ids))),
            (8, lambda: crash(net.master())),
            (1, power_loss),
            (4, pause),
            (12, restart),
            (4, set_drop),
            (3, set_delay),
        ]
    weights = [w for w, _ in faults_table]
    actions = [a for _, a in faults_table]
    mover = Transfers(net, trng) if transfers else None
    transfer_rate = trng.choice((0.05, 0.15, 0.3))
    while net.now < end:
        net.run_to(net.now + rng.randrange(5, 120))
        if mover is not None and trng.random() < transfer_rate:
            mover.random_transfer()
        if rng.random() >= fault_rate:
            for _ in range(rng.randrange(1, 6)):
                work.random_op()
        else:
            rng.choices(actions, weights)[0]()
    # Settle: heal, restart everyone, a clean network (the clients retry on).
    net.heal()
    net.drop_rate = 0.0
    net.max_delay_ms = 5
    for i in sorted(net.paused):
        net.resume(i)
    for i in sorted(crashed):
        net.start(i)
    if not net.run_until(net.converged, settle_ms):
        raise SimFailure(f"seed {seed}: no convergence {settle_ms} ms after healing: "
                         + "; ".join(f"{i}: {net.core(i).status()} leader={net.core(i).leader_id}"
                                     for i in ids))
    # The cluster still takes writes. (A node resumed by the healing may
    # still step down and cause one more election: the client retries.)
    # To a queue the clients never paused or bounded.
    data = work.produce("settled", retry_s=0, delay_s=None, ttl_s=None, node=net.master(),
                        max_attempts=10)
    if not net.run_until(lambda: work.produced[data].acked_at is not None, 10_000):
        raise SimFailure(f"seed {seed}: the settled cluster does not acknowledge a produce")
    work.stop()
    # The master moves out every final delivery whose lease ran out (its
    # expiry tick, armed anew on every master): none stays in flight.
    if not net.run_until(lambda: net.converged() and work.overdue_final(net.master()) is None,
                         settle_ms):
        m = net.master()
        raise SimFailure(f"seed {seed}: a final delivery whose lease ran out at "
                         f"{m and work.overdue_final(m)} is still in flight on master {m}")
    net.checker.final_check()
    m = net.master()
    work.final_check(m)
    if mover is not None:
        mover.final_check()
    return ScheduleStats(seed=seed, n=n, async_mode=async_mode, production=production,
                         delivered=net.delivered, elections=len(net.masters_by_vote),
                         committed=len(net.checker.committed),
                         acked=sum(1 for p in work.produced.values() if p.acked_at is not None),
                         virtual_ms=net.now - START_MS,
                         counters=dict(net.stats, **{f"answers_{k}": v
                                                     for k, v in work.answers.items()},
                                       **({f"transfers_{k}": v for k, v in mover.outcomes.items()}
                                          if mover is not None else {})))
