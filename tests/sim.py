"""A deterministic simulated network of NativeCore nodes (etcd raft's test
`network`, in spirit): one process, one seeded random.Random, virtual time.

Theory of operation
-------------------
`Network` holds n `SimNode`s, each a `NativeCore` plus what the node keeps
on disk (its log records since its last snapshot, that snapshot, and its
vote). `step()` delivers the next message or fires the next timer, then
flushes the stepped node's `Ready` in the order the core asks for (persist
the vote, the snapshot, the log change, then send, then answer clients).
Messages go through the wire encoding (message_to_wire/message_from_wire),
so the codec is exercised too. The network drops (`drop_rate`), delays and
reorders (each message takes 1..`max_delay_ms`), duplicates (`dup_rate`),
cuts directed links (`cut`, `isolate`, `partition`, `heal`), and crashes
and restarts nodes. Like the cluster adapter, a node may collect the Ready
of several deliveries before flushing it at the end of the instant
(`batch_rate`); a crash in between loses what was not flushed. Scenarios
drop (`drop_if`) or park (`hold_if`, `release`) chosen messages, inject a
stale one (`deliver`), and record what was sent (`sent`).

A crash loses the node's memory, never its disk (fsync=always). A restart
builds the store from the disk snapshot only and the log from the records
after it; the core starts with commit_id = applied_id = the snapshot's
trans_id, so the store must be the snapshot state at that position (it is:
the snapshot is the state at the log's base). The records after the base
are applied again when the node learns the commit position from a master,
or speculatively if it becomes master itself.

`Checker` checks design.md's invariants 1 to 4 after every delivery and
every timer (`Network.observe`):
1. at most one master per vote_id;
2. a node that becomes master holds every entry committed so far;
3. log matching: every (trans_id, vote_id) ever written names one entry,
   whose predecessor always has the same vote_id (so, by induction, two
   logs holding the same (trans_id, vote_id) are identical up to it);
4. every node's applied entries up to its commit position are the global
   committed sequence (learned from every node's commit_id advances), and
   its store equals a reference store built from that sequence.
`Workload` drives client operations on the current master the way
service.py does (Store.decide_* then NativeCore.propose) and checks
invariant 6 on what the clients were told.

`run_schedule(seed, ...)` runs one random schedule of faults and client
operations, lets the cluster settle, and checks everything; any failure
is an AssertionError that names the seed.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import random
from dataclasses import dataclass, field

from qserver.entries import Confirm, Consume, Produce, Record
from qserver.log import Log
from qserver.replication.base import LeaderInfo
from qserver.replication import native
from qserver.replication.messages import VoteReply, message_from_wire, message_to_wire
from qserver.replication.native import NativeCore, Role, Timing
from qserver.requests import ConfirmRequest, ConsumeRequest, ProduceRequest
from qserver.store import Store

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


@dataclass
class SimNode:
    node_id: int
    core: NativeCore | None
    # What this node has "on disk" (survives a crash): log records and vote.
    disk_records: list[Record] = field(default_factory=list)
    disk_base: tuple[int, int] = (0, 0)  # (trans_id, vote_id) of the snapshot
    disk_state: list | None = None  # snapshot state at disk_base
    disk_vote: tuple[int, int] = (0, 0)
    # Checker's view of the store: entries applied (and not reverted), in
    # order, the first at trans_id applied_base + 1.
    applied: list = field(default_factory=list)
    applied_base: int | None = 0  # None: a snapshot was just loaded
    loaded_state: list | None = None  # the state passed to the last load_wire
    verified_upto: int = 0  # applied entries up to here match the committed sequence
    seen_commit: int = 0  # the commit_id last observed
    was_master_of: int = -1  # vote_id in which it was last seen master (-1: not master)

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


class Network:
    def __init__(self, n: int, seed: int, *, timing: Timing | None = None, async_mode: bool = False,
                 log_size: int = 100_000, sync_rate: int = 100_000, queue_size: int = 1_000_000,
                 virtual_queues: dict | None = None, check: bool = True) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = START_MS
        self.timing = timing or Timing(heartbeat_ms=50, election_ms=300, pull_retry_ms=100)
        self.async_mode = async_mode
        self.log_size = log_size
        self.sync_rate = sync_rate
        self.queue_size = queue_size
        self.virtual_queues = virtual_queues or {}
        self.ids = list(range(1, n + 1))
        self.nodes: dict[int, SimNode] = {}
        self.queue: list = []  # heap of (deliver_at, seq, src, dst, wire)
        self.seq = 0
        self.cut: set[tuple[int, int]] = set()  # directed links that drop everything
        self.drop_rate = 0.0
        self.max_delay_ms = 5
        # Scenario hooks, called with (src, dst, message) at delivery time:
        # `drop_if` drops a message, `hold_if` parks it until release().
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
        self.sent: list[tuple[int, int, int, object]] | None = None  # (time, src, dst, msg) when recording
        self.masters_by_vote: dict[int, set[int]] = {}
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
                          me=LeaderInfo(node_id=node.node_id, host="127.0.0.1", port=10000 + node.node_id),
                          rng=random.Random(self.rng.random()), now_ms=self.now, timing=self.timing,
                          async_mode=self.async_mode, sync_rate=self.sync_rate,
                          log_size=self.log_size, vote_id=vote_id, voted_for=voted_for)
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
            node.loaded_state = state

        store.apply, store.revert, store.load_wire = apply_, revert_, load_wire_

    def start(self, i: int) -> None:
        node = self.nodes[i]
        node.core = self._make_core(node)
        for p in self.ids:
            if p != i:
                node.core.link_up(p)
        self._flush(i)
        self.observe((i,))

    def crash(self, i: int, *, drop_outgoing: bool = False) -> None:
        """Stop node i (its disk survives). Messages to it are lost; with
        `drop_outgoing`, so are the ones it sent that are still in flight
        (it died before its socket buffers drained)."""
        self.nodes[i].core = None
        self.dirty.discard(i)
        self.queue = [m for m in self.queue
                      if m[3] != i and not (drop_outgoing and m[2] == i)]
        heapq.heapify(self.queue)
        self.held = [h for h in self.held if h[1] != i and not (drop_outgoing and h[0] == i)]

    def alive(self, i: int) -> bool:
        return self.nodes[i].core is not None

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

    # -- running -----------------------------------------------------------

    def _flush(self, i: int) -> None:
        self.dirty.discard(i)
        node = self.nodes[i]
        core = node.core
        ready = core.take_ready()
        if ready.vote is not None:
            node.disk_vote = ready.vote
        if ready.snapshot is not None:
            # (trans_id, vote_id, state): what storage keeps of a snapshot
            # installed from the master; the Checker compares the state the
            # core loaded with the committed sequence.
            node.disk_base = tuple(ready.snapshot[:2])
            node.disk_state = ready.snapshot[2] if len(ready.snapshot) > 2 else node.loaded_state
            node.disk_records = []
        if ready.truncate_after is not None:
            node.disk_records = [r for r in node.disk_records if r.trans_id <= ready.truncate_after]
        node.disk_records.extend(ready.records)
        stats = self.stats
        if ready.snapshot is not None:
            stats["snapshots"] += 1
        if ready.truncate_after is not None:
            stats["truncations"] += 1
        if self.checker is not None:
            self.checker.on_persist(node, ready)
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

    def step(self) -> bool:
        """Deliver the next message or fire the next timer; False if idle."""
        next_msg = self.queue[0][0] if self.queue else None
        next_timer = min((n.core.next_deadline() for n in self.nodes.values() if n.core), default=None)
        if next_msg is None and next_timer is None:
            return False
        if self.dirty and min(t for t in (next_msg, next_timer) if t is not None) > self.now:
            for i in sorted(self.dirty):  # the end of this instant's event-loop turn
                self._flush(i)
            self.observe()
            return True
        before = self.now
        if next_msg is not None and (next_timer is None or next_msg <= next_timer):
            at, _, src, dst, wire = heapq.heappop(self.queue)
            self.now = max(self.now, at)
            node = self.nodes[dst]
            if node.core is None or (src, dst) in self.cut or self.rng.random() < self.drop_rate:
                return True
            msg = message_from_wire(wire)
            if self.drop_if is not None and self.drop_if(src, dst, msg):
                return True
            if self.hold_if is not None and self.hold_if(src, dst, msg):
                self.held.append((src, dst, wire))
                return True
            node.core.step(msg, self.now)
            self.delivered += 1
            if self.batch_rate and self.rng.random() < self.batch_rate:
                self.dirty.add(dst)
            else:
                self._flush(dst)
            self.observe((dst,))
        else:
            self.now = max(self.now, next_timer)
            ticked = []
            for n in self.nodes.values():
                if n.core and n.core.next_deadline() <= self.now:
                    n.core.tick(self.now)
                    self._flush(n.node_id)
                    ticked.append(n.node_id)
            self.observe(ticked)
        if self.now == before:
            self._same_instant += 1
            if self._same_instant > MAX_STEPS_AT_ONE_INSTANT:
                raise SimFailure(f"seed {self.seed}: livelock: {self._same_instant} steps at t={self.now}")
        else:
            self._same_instant = 0
        return True

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
            next_msg = self.queue[0][0] if self.queue else None
            next_timer = min((n.core.next_deadline() for n in self.nodes.values() if n.core),
                             default=None)
            nxt = min(t for t in (next_msg, next_timer, at_ms) if t is not None)
            if nxt >= at_ms:
                break
            self.step()
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
        for i in (self.ids if ids is None else ids):
            core = self.nodes[i].core
            if core is not None and core.role is Role.MASTER:
                masters = self.masters_by_vote.setdefault(core.vote_id, set())
                masters.add(i)
                if len(masters) > 1:
                    raise SimFailure(f"seed {self.seed}: invariant 1: two masters in vote_id "
                                     f"{core.vote_id}: {sorted(masters)}")
        if self.checker is not None:
            self.checker.observe(self.ids if ids is None else ids)

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
        self.written: dict[tuple[int, int], tuple[object, int | None]] = {}  # (t, v) -> (entry, vote at t-1)
        self.ref = Store(queue_size=net.queue_size, virtual_queues=net.virtual_queues)
        self.ref_pos = 0
        self.ref_cache: dict[int, list] = {0: []}
        self.observations = 0
        self.granted: dict[tuple[int, int], int] = {}  # (voter, vote_id) -> candidate

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
                    self.fail(f"node {node.node_id} granted vote {msg.vote_id} to {first} and to {dst}")
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
            disk = node.disk_records[len(node.disk_records) - len(log.records):] if log.records else []
            if list(log.records) != disk:
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
                self.fail(f"node {node.node_id}: commit_id went back from {node.seen_commit} to {c}")
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
        if ready.snapshot is not None or (ready.truncate_after is not None and t > ready.truncate_after):
            return None
        return node.disk_record(t)

    def _check_new_master(self, node: SimNode) -> None:
        log = node.core.log
        committed = self.committed
        base = log.base_trans_id
        if base > len(committed) or (base and committed[base - 1].vote_id != log.base_vote_id):
            self.fail(f"invariant 2: new master {node.node_id} has a log base {base} that is "
                      f"not a committed position (committed end {len(committed)})")
        for t in range(base + 1, len(committed) + 1):
            record = log.get(t)
            known = committed[t - 1]
            if record is None or record.vote_id != known.vote_id or not same(record.entry, known.entry):
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
            self.fail(f"node {node.node_id}: commit_id {core.commit_id} > applied_id {core.applied_id}")
        upto = core.commit_id
        if upto > len(self.committed):
            self.fail(f"node {node.node_id}: commit {upto} beyond the known end {len(self.committed)}")
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
                    self.fail(f"node {node.node_id}: applied {core.applied_id} != commit {core.commit_id}")
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


# -- client workload and invariant 6 -------------------------------------------


@dataclass
class _Produced:
    targets: tuple
    ready_ms: int
    retry_ms: int
    acked_at: int | None = None  # event number of the ack


@dataclass
class _Delivery:
    decided_at: int  # event number of the decision
    now_ms: int
    retry_at_ms: int
    queue: str
    msg_id: int


RANDOM = object()  # Workload.produce: draw this argument at random


class Workload:
    """Client operations on the current master, as service.py issues them,
    and what the clients were told. `strict` (quorum mode) checks the
    delivery guarantees of invariant 6 that async mode does not give."""

    def __init__(self, net: Network, rng: random.Random, *, queues=("a", "b"),
                 strict: bool = True) -> None:
        self.net = net
        self.rng = rng
        self.queues = queues
        self.strict = strict
        self.events = 0
        self.counter = 0
        self.produced: dict[str, _Produced] = {}  # data -> what the master decided
        # A message is (data, queue): a produce to a virtual queue makes one
        # per real queue, with the same data.
        self.deliveries: dict[tuple[str, str], list[_Delivery]] = {}  # message -> acknowledged deliveries
        self.confirmed: dict[tuple[str, str], int] = {}  # message -> event number of the confirm's ack
        self.answers = {"ok": 0, "error": 0}

    def fail(self, text: str) -> None:
        raise SimFailure(f"seed {self.net.seed}: t={self.net.now - START_MS}ms: invariant 6: {text}")

    def _tick(self) -> int:
        self.events += 1
        return self.events

    # -- operations ------------------------------------------------------------

    def random_op(self) -> None:
        r = self.rng.random()
        if r < 0.45:
            self.produce()
        elif r < 0.85:
            self.consume()
        else:
            self.confirm()

    def produce(self, queue: str | None = None, *, retry_s: float | None = None,
                delay_s: object = RANDOM, ttl_s: object = RANDOM) -> str | None:
        """Produce a new message (data "m<n>") on the master; returns its
        data, or None when there is no master or the store refused it.
        Unset arguments are drawn at random; delay_s/ttl_s None mean none."""
        m = self.net.master()
        if m is None:
            return None
        core = self.net.core(m)
        rng = self.rng
        if queue is None:
            virtual = sorted(self.net.virtual_queues)
            queue = rng.choice(virtual) if virtual and rng.random() < 0.15 else rng.choice(self.queues)
        if retry_s is None:
            retry_s = rng.choice((0, 0, 0.2, 1))
        if delay_s is RANDOM:
            delay_s = rng.choice((0.1, 0.5)) if rng.random() < 0.3 else None
        if ttl_s is RANDOM:
            ttl_s = rng.choice((0.3, 1.5)) if retry_s and rng.random() < 0.3 else None
        self.counter += 1
        data = f"m{self.counter}"
        req = ProduceRequest(queue=queue, data=data, delay_s=delay_s, ttl_s=ttl_s, retry_s=retry_s)
        entry = core.store.decide_produce(req, self.net.now)
        if type(entry) is str:
            return None
        info = self.produced[data] = _Produced(entry.targets, entry.ready_ms, entry.retry_ms)

        def done(result, error):
            if error is not None:
                self.answers["error"] += 1
                return
            self.answers["ok"] += 1
            if tuple(result) != entry.targets:
                self.fail(f"produce of {data} answered {result}, decided {entry.targets}")
            info.acked_at = self._tick()

        self._tick()
        self.net.propose(m, entry, _Callback(done))
        return data

    def consume(self, queue: str | None = None) -> None:
        m = self.net.master()
        if m is None:
            return
        core = self.net.core(m)
        queue = queue or self.rng.choice(self.queues)
        entry = core.store.decide_consume(ConsumeRequest(queue=queue), self.net.now)
        if entry is None or type(entry) is str:
            return
        now = self.net.now
        decided_at = self._tick()

        def done(result, error):
            if error is not None:
                self.answers["error"] += 1
                return
            self.answers["ok"] += 1
            msg_id, data = result
            if msg_id != entry.msg_id:
                self.fail(f"consume decided {entry}, answered {result}")
            self._delivered(data, _Delivery(decided_at, now, entry.retry_at_ms, queue, msg_id))

        self.net.propose(m, entry, _Callback(done))

    def confirm(self) -> None:
        m = self.net.master()
        if m is None:
            return
        candidates = [key for key, ds in self.deliveries.items()
                      if ds[-1].retry_at_ms and key not in self.confirmed]
        if not candidates:
            return
        key = self.rng.choice(sorted(candidates))
        last = self.deliveries[key][-1]
        entry = self.net.core(m).store.decide_confirm(ConfirmRequest(queue=last.queue, msg_id=last.msg_id))
        if entry is None or type(entry) is str:
            return
        self._tick()

        def done(result, error):
            if error is not None:
                self.answers["error"] += 1
                return
            self.answers["ok"] += 1
            self.confirmed.setdefault(key, self._tick())

        self.net.propose(m, entry, _Callback(done))

    # -- invariant 6 -----------------------------------------------------------

    def _delivered(self, data: str, d: _Delivery) -> None:
        info = self.produced.get(data)
        if info is None:
            self.fail(f"delivered {data!r}, which no client produced")
        if (d.queue, d.msg_id) not in info.targets:
            self.fail(f"delivered {data} as {d.queue}/{d.msg_id}; it was produced as {info.targets}")
        if d.now_ms < info.ready_ms:
            self.fail(f"{data} delivered at {d.now_ms}, before its ready time {info.ready_ms}")
        key = (data, d.queue)
        before = self.deliveries.setdefault(key, [])
        if self.strict:
            if not info.retry_ms and before:
                self.fail(f"retry=0 message {data} delivered twice")
            # Acks of two deliveries may arrive out of order (a deposed
            # master can still learn a commit late): order each pair by
            # the decision.
            for other in before:
                first, second = (other, d) if other.decided_at < d.decided_at else (d, other)
                if not first.retry_at_ms:
                    self.fail(f"{data} delivered again after its last delivery")
                if second.now_ms < first.retry_at_ms:
                    self.fail(f"{data} redelivered at {second.now_ms}, before its retry time "
                              f"{first.retry_at_ms}")
            confirmed = self.confirmed.get(key)
            if confirmed is not None and confirmed < d.decided_at:
                self.fail(f"{data} delivered after its confirm was acknowledged")
        before.append(d)

    def final_check(self, master: int) -> None:
        """After the cluster settled: every acknowledged produce is in the
        committed sequence with the msg_id its client was told, and is
        still in the master's store unless a committed delivery or confirm
        deleted it. (Quorum mode only: async mode may lose acked writes.)"""
        if not self.strict:
            return
        committed = self.net.checker.committed
        produced_at: dict[str, tuple[int, tuple]] = {}
        deleted: dict[tuple[str, int], int] = {}
        owner: dict[tuple[str, int], str] = {}
        consumes: set[tuple[str, int, int]] = set()
        for record in committed:
            e = record.entry
            if type(e) is Consume:
                consumes.add((e.queue, e.msg_id, e.retry_at_ms))
            if type(e) is Produce:
                produced_at[e.data] = (record.trans_id, e.targets)
                for target in e.targets:
                    if target in owner:
                        self.fail(f"msg_id {target} given to {owner[target]} and to {e.data}")
                    owner[target] = e.data
            elif type(e) is Consume and not e.retry_at_ms:
                deleted.setdefault((e.queue, e.msg_id), record.trans_id)
            elif type(e) is Confirm:
                deleted.setdefault((e.queue, e.msg_id), record.trans_id)
        store = self.net.core(master).store
        for data, info in self.produced.items():
            if info.acked_at is None:
                continue
            if data not in produced_at:
                self.fail(f"acknowledged produce {data} ({info.targets}) was lost")
            _t, targets = produced_at[data]
            if targets != info.targets:
                self.fail(f"acknowledged produce {data} was told {info.targets}, committed as {targets}")
            for queue, msg_id in targets:
                if (queue, msg_id) in deleted:
                    continue
                q = store.get(queue)
                msg = q.messages.get(msg_id) if q is not None else None
                if msg is None or message_data(msg) != data:
                    self.fail(f"acknowledged {data} ({queue}/{msg_id}) is neither delivered for "
                              f"good, confirmed, nor in the master's store")
        for (data, _queue), ds in self.deliveries.items():
            for d in ds:
                if (d.queue, d.msg_id, d.retry_at_ms) not in consumes:
                    self.fail(f"acknowledged delivery of {data} as {d.queue}/{d.msg_id} was lost")
                if owner.get((d.queue, d.msg_id)) != data:
                    self.fail(f"acknowledged delivery of {data} as {d.queue}/{d.msg_id}, "
                              f"which the committed log gives to {owner.get((d.queue, d.msg_id))}")


class _Callback(list):
    """A results list for Network.propose that calls `done` instead."""

    def __init__(self, done) -> None:
        super().__init__()
        self.done = done

    def append(self, item) -> None:
        self.done(*item)


# -- random schedules -------------------------------------------------------------


@dataclass
class ScheduleStats:
    seed: int
    n: int
    async_mode: bool
    delivered: int
    elections: int
    committed: int
    acked: int
    virtual_ms: int
    counters: dict


def run_schedule(seed: int, *, n: int = 3, async_mode: bool = False, chaos_ms: int | None = None,
                 settle_ms: int = 30_000) -> ScheduleStats:
    """One seeded schedule: random faults and client operations for
    `chaos_ms` of virtual time, then heal everything, restart every node,
    and require one master that everyone follows with identical state.
    Any failure raises AssertionError naming the seed."""
    try:
        with compaction_slack(2):
            return _run_schedule(seed, n, async_mode, chaos_ms, settle_ms)
    except SimFailure:
        raise
    except Exception as exc:  # an InvariantError in the core, or a bug in the sim
        raise SimFailure(f"seed {seed} (n={n}, async={async_mode}): {type(exc).__name__}: {exc}") from exc


def _run_schedule(seed, n, async_mode, chaos_ms, settle_ms) -> ScheduleStats:
    rng = random.Random(f"schedule-{seed}-{n}-{async_mode}")
    log_size = rng.choice((100_000, 100_000, 40, 10, 4))
    sync_rate = rng.choice((100_000, 100_000, 500, 60))
    net = Network(n, seed, async_mode=async_mode, log_size=log_size, sync_rate=sync_rate,
                  virtual_queues={"ab": ("a", "b")})
    net.max_delay_ms = rng.choice((2, 5, 20, 80))
    net.drop_rate = rng.choice((0.0, 0.0, 0.02, 0.1))
    net.batch_rate = rng.choice((0.0, 0.0, 0.5, 0.9))
    net.dup_rate = rng.choice((0.0, 0.0, 0.0, 0.05))
    work = Workload(net, random.Random(rng.random()), strict=not async_mode)
    crash_ok = rng.random() < 0.7
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

    def set_drop() -> None:
        net.drop_rate = rng.choice((0.0, 0.05, 0.2, 0.5))

    def set_delay() -> None:
        net.max_delay_ms = rng.choice((1, 5, 30, 150, 400))

    faults = [  # (weight, action)
        (10, lambda: net.isolate(rng.choice(ids))),
        (16, lambda: net.master() is not None and net.isolate(net.master())),
        (8, lambda: net.partition(set(rng.sample(ids, rng.randrange(1, minority + 1))))),
        (8, partition_master),
        (8, lambda: net.cut.add(tuple(rng.sample(ids, 2)))),
        (5, cut_master_link),
        (18, net.heal),
        (6, lambda: crash(rng.choice(ids))),
        (8, lambda: crash(net.master())),
        (12, restart),
        (4, set_drop),
        (3, set_delay),
    ]
    weights = [w for w, _ in faults]
    actions = [a for _, a in faults]
    while net.now < end:
        net.run_to(net.now + rng.randrange(5, 120))
        if rng.random() >= fault_rate:
            for _ in range(rng.randrange(1, 9)):
                work.random_op()
        else:
            rng.choices(actions, weights)[0]()
    # Settle: heal, restart everyone, a clean network.
    net.heal()
    net.drop_rate = 0.0
    net.max_delay_ms = 5
    for i in sorted(crashed):
        net.start(i)
    if not net.run_until(net.converged, settle_ms):
        raise SimFailure(f"seed {seed}: no convergence {settle_ms} ms after healing: "
                         + "; ".join(f"{i}: {net.core(i).status()} leader={net.core(i).leader_id}"
                                     for i in ids))
    # The cluster still takes writes, without client retries.
    data = work.produce("a", retry_s=0, delay_s=None, ttl_s=None)
    if data is None or not net.run_until(lambda: work.produced[data].acked_at is not None, 5_000):
        raise SimFailure(f"seed {seed}: the settled cluster does not acknowledge a produce")
    net.run_until(net.converged, settle_ms)
    net.checker.final_check()
    m = net.master()
    work.final_check(m)
    return ScheduleStats(seed=seed, n=n, async_mode=async_mode, delivered=net.delivered,
                         elections=len(net.masters_by_vote), committed=len(net.checker.committed),
                         acked=sum(1 for p in work.produced.values() if p.acked_at is not None),
                         virtual_ms=net.now - START_MS,
                         counters=dict(net.stats, answered_ok=work.answers["ok"],
                                       answered_error=work.answers["error"]))
