"""A deterministic simulated network of NativeCore nodes (etcd raft's test
`network`, in spirit): one process, one seeded random.Random, virtual time.

Messages go through the wire encoding (message_to_wire/message_from_wire)
so the codec is exercised too. The network can drop, delay, reorder, cut
links, isolate nodes, crash and restart them (a restarted node keeps what a
node keeps on disk: its log and its vote; with storage_kept=False it loses
nothing but its in-memory state is rebuilt from its log by replay).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from qserver.entries import Record
from qserver.log import Log
from qserver.replication.base import LeaderInfo
from qserver.replication.messages import message_from_wire, message_to_wire
from qserver.replication.native import NativeCore, Role, Timing
from qserver.store import Store

START_MS = 1_700_000_000_000


@dataclass
class SimNode:
    node_id: int
    core: NativeCore | None
    # What this node has "on disk" (survives a crash): log records and vote.
    disk_records: list[Record] = field(default_factory=list)
    disk_base: tuple[int, int] = (0, 0)
    disk_state: list | None = None  # snapshot state at disk_base
    disk_vote: tuple[int, int] = (0, 0)
    applied: list[tuple[int, int]] = field(default_factory=list)  # (trans_id, vote_id) applied, in order


class Network:
    def __init__(self, n: int, seed: int, *, timing: Timing | None = None, async_mode: bool = False,
                 log_size: int = 100_000, sync_rate: int = 100_000, queue_size: int = 1_000_000,
                 virtual_queues: dict | None = None) -> None:
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
        self.masters_by_vote: dict[int, set[int]] = {}
        for i in self.ids:
            self.nodes[i] = SimNode(i, None)
            self.start(i)

    # -- lifecycle -------------------------------------------------------

    def _make_core(self, node: SimNode) -> NativeCore:
        store = Store(queue_size=self.queue_size, virtual_queues=self.virtual_queues)
        base_t, base_v = node.disk_base
        if node.disk_state is not None:
            store.load_wire(node.disk_state)
        log = Log(base_trans_id=base_t, base_vote_id=base_v)
        for r in node.disk_records:
            log.append(r)
        vote_id, voted_for = node.disk_vote
        core = NativeCore(node_id=node.node_id, peer_ids=self.ids, store=store, log=log,
                          me=LeaderInfo(node_id=node.node_id, host="127.0.0.1", port=10000 + node.node_id),
                          rng=random.Random(self.rng.random()), now_ms=self.now, timing=self.timing,
                          async_mode=self.async_mode, sync_rate=self.sync_rate,
                          log_size=self.log_size, vote_id=vote_id, voted_for=voted_for)
        return core

    def start(self, i: int) -> None:
        node = self.nodes[i]
        node.core = self._make_core(node)
        node.applied = [(t, 0) for t in range(0)]
        for p in self.ids:
            if p != i:
                node.core.link_up(p)
        self._flush(i)

    def crash(self, i: int) -> None:
        self.nodes[i].core = None
        self.queue = [m for m in self.queue if m[3] != i]
        heapq.heapify(self.queue)

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

    # -- running -----------------------------------------------------------

    def _flush(self, i: int) -> None:
        node = self.nodes[i]
        core = node.core
        ready = core.take_ready()
        if ready.vote is not None:
            node.disk_vote = ready.vote
        if ready.snapshot is not None:
            node.disk_base = ready.snapshot
            node.disk_state = core.store.to_wire() if core.applied_id == ready.snapshot[0] else None
            node.disk_records = []
        if ready.truncate_after is not None:
            node.disk_records = [r for r in node.disk_records if r.trans_id <= ready.truncate_after]
        node.disk_records.extend(ready.records)
        for dst, msg in ready.messages:
            self.seq += 1
            delay = self.rng.randrange(1, self.max_delay_ms + 1)
            heapq.heappush(self.queue, (self.now + delay, self.seq, i, dst, message_to_wire(msg)))
        for answer in ready.answers:
            answer()

    def step(self) -> bool:
        """Deliver the next message or fire the next timer; False if idle."""
        next_msg = self.queue[0][0] if self.queue else None
        next_timer = min((n.core.next_deadline() for n in self.nodes.values() if n.core), default=None)
        if next_msg is None and next_timer is None:
            return False
        if next_msg is not None and (next_timer is None or next_msg <= next_timer):
            at, _, src, dst, wire = heapq.heappop(self.queue)
            self.now = max(self.now, at)
            node = self.nodes[dst]
            if node.core is None or (src, dst) in self.cut or self.rng.random() < self.drop_rate:
                return True
            node.core.step(message_from_wire(wire), self.now)
            self._flush(dst)
            self.observe()
            return True
        self.now = max(self.now, next_timer)
        for n in self.nodes.values():
            if n.core and n.core.next_deadline() <= self.now:
                n.core.tick(self.now)
                self._flush(n.node_id)
        self.observe()
        return True

    def run_for(self, ms: int) -> None:
        end = self.now + ms
        while self.step():
            if self.now >= end:
                break
        self.now = max(self.now, end)

    def run_until(self, predicate, max_ms: int = 60_000) -> bool:
        end = self.now + max_ms
        while self.now < end:
            if predicate():
                return True
            if not self.step():
                self.now += 1
        return predicate()

    # -- observation ---------------------------------------------------------

    def observe(self) -> None:
        for n in self.nodes.values():
            if n.core and n.core.role is Role.MASTER:
                self.masters_by_vote.setdefault(n.core.vote_id, set()).add(n.node_id)

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
