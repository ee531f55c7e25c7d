"""The raft engine (`<replication engine="raft">`): qserver's state machine
replicated by pysyncobj, behind the same `Engine` interface as the native
engine.

Theory of operation
-------------------
pysyncobj runs its own thread (election, log replication, its journal and
snapshots) on its own port: the node's internal port + RAFT_PORT_OFFSET.
Commands are qserver's log entries in their wire form (msgpack, wrapped by
`machine`), never pickles of our objects. Everything that touches
the store runs on the asyncio thread: pysyncobj's thread hands over each
committed command, each change of its raft state, each failed proposal and
each snapshot with `loop.call_soon_threadsafe`, so the loop sees them in the
order pysyncobj produced them. `machine.RaftMachine` decides, on
every node alike, which committed commands count, and keeps the master's
speculatively applied entries (see its docstring for why that is safe).

Forwarding and redirects use the native engine's peer links (`peers`,
authenticated msgpack on the internal port): a `Hello` on every link tells
each node the others' client addresses; a slave relays a client request to
the node pysyncobj names as leader (`engines.forwarding`, as the native
engine does).

Authentication: pysyncobj always runs with a password (without one it
unpickles whatever reaches its port). It is HMAC-SHA256 of `<cluster
secret>` with a fixed label; with no secret configured it is derived from
the node list, which every node knows, so it protects nothing: a loud
warning says so.

Leader transfer (`transfer_leader`): pysyncobj 0.3.17's
`transferLeadership` sends Raft's TimeoutNow, but only to a follower whose
match index is the leader's last index at that instant (else it refuses),
it does not stop the leader from appending meanwhile, and its callback says
only that the message was sent. So this engine refuses writes itself while
a transfer is under way ("no leader"; reads in quorum mode too, as their
marker is an entry), and pysyncobj's own thread (`_QueueSync._onTick`,
which owns its state) waits, tick by tick, for the target to be caught up
and everything committed, calls `transferLeadership` then, and watches for
a leader of a later term; the outcome goes to the loop. Bounds as in the
native engine: caught up within RAFT_TRANSFER_S, a new leader within
RAFT_TRANSFER_S of the TimeoutNow; RAFT_TRANSFER_ELECTION_S more once this
node has stepped down (the election may split: no pre-vote). What it cannot
do is in the README.

Durability (pysyncobj 0.3.17 writes its journal through mmap and its term
and vote with write+rename, and fsyncs neither): with `<storage dir>` the
journal and the snapshot live in that directory (`raft.journal`,
`raft.journal.meta`, `raft.dump`), and this module closes the gap:
the term and vote are fsynced (file and directory) before pysyncobj can
send anything that depends on them, and with fsync="always" the journal is
fsynced before any message leaves the node (so a follower's acknowledgement
and a vote are durable before they are sent, and the leader's own copy is
durable before anyone can acknowledge it) and before a committed command is
handed to the store (a single node). fsync="batch" fsyncs the journal every
BATCH_SYNC_MS from pysyncobj's thread; "off" leaves it to the OS. Without
storage everything is in memory (a temporary directory holds snapshots in
transit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable

import msgpack
import pysyncobj.syncobj as _pso
from pysyncobj import FAIL_REASON, SyncObjConf, replicated
from pysyncobj.dns_resolver import globalDnsResolver
from pysyncobj.journal import FileJournal, MemoryJournal
from pysyncobj.monotonic import monotonic as pysyncobj_clock
from pysyncobj.node import TCPNode
from pysyncobj.transport import TCPTransport

from ...config import BATCH_SYNC_MS, Config, Fsync, Mode
from ...errors import InvariantError
from ...state.entries import Entry, Noop
from ...state.store import Store
from ...stats import FSYNC_BUCKETS_S, PAUSE_BUCKETS_S, Histogram
from ...storage import private_tmp_dir, remove_private_tmp_dir
from ...tls import peer_contexts
from ..base import (
    AnswerNow,
    Cancel,
    Done,
    EngineStatus,
    FatalHandler,
    ForwardedHandler,
    LeaderInfo,
    Respond,
    Role,
    RoleHandler,
    TransferDone,
)
from ..forwarding import Forwarder
from ..messages import (
    Features,
    Forward,
    ForwardBatch,
    ForwardCancel,
    ForwardReplies,
    ForwardReply,
    Hello,
    message_from_peer,
    message_to_wire,
)
from ..peers import PeerNetwork
from .appends import RaftAppends
from .machine import OUTCOME_UNKNOWN, RaftMachine

__all__ = ["RaftEngine", "RAFT_PORT_OFFSET", "raft_password", "DurableJournal"]

log = logging.getLogger(__name__)

# pysyncobj listens on the internal port + this (the internal port itself
# carries the peer links used for forwarding). Documented in the README.
RAFT_PORT_OFFSET = 1000

# How long pysyncobj's thread waits for the loop to hand it a snapshot of
# the store before giving up (it retries at its next compaction).
SNAPSHOT_WAIT_S = 30.0

# The label of the password derivation: changing it splits clusters.
_PASSWORD_LABEL = b"qserver raft password v1"

# pysyncobj's raft states (its _RAFT_STATE values).
_FOLLOWER, _CANDIDATE, _LEADER = 0, 1, 2

# pysyncobj timings, chosen like the native engine's: elections after
# 600-1200 ms of silence, heartbeats every 100 ms, and a leader that has
# not heard from a majority for 1.2 s steps down (pysyncobj's default is
# 30 s, which would leave clients of a cut-off leader waiting that long).
_RAFT_TIMING = dict(raftMinTimeout=0.6, raftMaxTimeout=1.2, appendEntriesPeriod=0.1,
                    leaderFallbackTimeout=1.2, connectionTimeout=3.5,
                    connectionRetryTime=0.5)

# A stall (the native core's "A stall"): pysyncobj's thread ticks every
# autoTickPeriod, and each tick judges silence (the election deadline, the
# leader's fallback) before it reads its sockets. Ticks this much further
# apart than that mean the process could not run (a long garbage
# collection, a paused process or VM); the deadlines that judge the others'
# silence move on by the gap first (_QueueSync._onTick), as the native
# engine's do.
RAFT_STALL_S = 0.2

# pysyncobj retries binding its port every bindRetryTime, by default for
# ever: a node whose raft port is taken would serve clients and never take
# part in an election. It gets RAFT_BIND_TRIES tries, RAFT_BIND_RETRY_S
# apart (a port in use by a node stopping just before has the time to come
# free), then the node stops with "cannot listen", as for its other ports.
RAFT_BIND_TRIES = 10
RAFT_BIND_RETRY_S = 0.5

# Leader transfer: the target must be caught up within this long, and a new
# leader seen within this long of the TimeoutNow (pysyncobj's shortest
# election timeout, as the native engine uses its election_ms).
RAFT_TRANSFER_S = 0.6

# ... unless this node has stepped down by then (the TimeoutNow arrived and
# an election is under way): pysyncobj has no pre-vote, so that election may
# split and the next, randomized, one comes up to raftMaxTimeout later. Its
# leader is waited for this much longer (a SIGTERM's hand-over, catch-up
# included, stays within node.HAND_OVER_ON_STOP_S).
RAFT_TRANSFER_ELECTION_S = 1.4


def raft_password(config: Config) -> str:
    """The password pysyncobj encrypts and authenticates its links with."""
    if config.secret is not None:
        key = config.secret.encode()
    else:
        nodes = ",".join(f"{p.node_id}@{p.host}:{p.port}" for p in sorted(
            config.peers, key=lambda p: p.node_id))
        key = f"no secret: {nodes}".encode()
    return hmac.new(key, _PASSWORD_LABEL, hashlib.sha256).hexdigest()


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DurableJournal(FileJournal):
    """pysyncobj's file journal, with what it lacks for invariant 5: the
    term and vote reach the disk (file and directory fsynced) before
    `setCurrentTerm` returns, i.e. before a vote is sent; `sync()` fsyncs
    the entries written since the last one."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path
        self.dir = os.path.dirname(os.path.abspath(path))
        self.dirty = False  # entries written and not yet fsynced
        self.syncs = 0  # fsyncs done (for tests)
        # Each sync()'s time (metrics; observed on pysyncobj's thread, read
        # on the loop's: a scrape may see a count without its sum, no more).
        self.fsync_seconds = Histogram(FSYNC_BUCKETS_S)
        # A failed fsync: the kernel may have dropped the pages, so no later
        # fsync can vouch for them; every sync raises it again (and the
        # node stops: _QueueSync._onTick).
        self.failed: OSError | None = None

    def add(self, command, idx, term):
        super().add(command, idx, term)
        self.dirty = True

    def clear(self):
        super().clear()
        self.dirty = True

    def deleteEntriesFrom(self, entryFrom):
        super().deleteEntriesFrom(entryFrom)
        self.dirty = True

    def deleteEntriesTo(self, entryTo):
        # Compaction: the new dump was renamed into place just before; make
        # the rename durable before the entries it replaces go.
        _fsync_path(self.dir)
        super().deleteEntriesTo(entryTo)
        self.dirty = True

    def setCurrentTerm(self, term, votedForNodeId):
        super().setCurrentTerm(term, votedForNodeId)  # writes .meta.tmp, renames
        _fsync_path(self.path + ".meta")
        _fsync_path(self.dir)

    def sync(self) -> None:
        """fsync the journal if anything was written since the last sync."""
        if self.failed is not None:
            raise self.failed
        if self.dirty:
            started = time.perf_counter_ns()
            try:
                self.flush()  # msync of the mapping
                _fsync_path(self.path)  # and the file's size
            except OSError as exc:
                self.failed = exc
                raise
            self.fsync_seconds.observe_ns(time.perf_counter_ns() - started)
            self.dirty = False
            self.syncs += 1


class _DialedNode(TCPNode):
    """A raft node known by its address (its identity on every node) and
    reached at another (`<node raft_dial>`: a proxy, NAT or tunnel in
    between). pysyncobj's transport connects to `node.ip`, `node.port`."""

    def __init__(self, address: str, dial: tuple[str, int]) -> None:
        super().__init__(address)
        self.dial = dial

    @property
    def ip(self) -> str:
        return globalDnsResolver().resolve(self.dial[0])

    @property
    def port(self) -> int:
        return self.dial[1]


class _PersistingTransport(TCPTransport):
    """pysyncobj's TCP transport, which persists before it sends."""

    def send(self, node, message):
        self._syncObj._before_send()
        return super().send(node, message)


_patch_lock = threading.Lock()


@contextlib.contextmanager
def _journal_factory(factory: Callable[[str | None], object]):
    """Make SyncObj.__init__ build its journal with `factory`. pysyncobj
    offers no hook for the journal class; its constructor calls the module
    global `createJournal`, so that name is swapped for the duration of one
    construction (under a lock) and put back."""
    with _patch_lock:
        original = _pso.createJournal
        _pso.createJournal = factory
        try:
            yield
        finally:
            _pso.createJournal = original


def _raised_in_pysyncobj_thread(exc: BaseException) -> None:
    """On the loop: re-raise what escaped pysyncobj's tick (see _onTick)."""
    raise exc


class _QueueSync(RaftAppends):
    """The SyncObj (with Raft's append rules: appends.py): one replicated
    method, which hands each committed command to the engine. Holds no state
    of its own (snapshots come from the store, through the engine's
    serializer hooks)."""

    def __init__(self, engine: RaftEngine, self_addr: str, other_addrs: list[str],
                 conf: SyncObjConf) -> None:
        self._engine = engine
        self._journal: DurableJournal | None = None
        self._policy = engine.config.fsync
        self._last_sync = 0.0
        # the last tick's time; None until the first (set before the tick
        # thread starts, in __init__; start-up is not a stall)
        self._last_tick: float | None = None

        def make_journal(path):
            if path is None:
                return MemoryJournal()
            self._journal = DurableJournal(path)
            return self._journal

        with _journal_factory(make_journal):
            super().__init__(self_addr, other_addrs, conf, transportClass=_PersistingTransport)
        if self._journal is not None and self._policy is Fsync.BATCH:
            self.addOnTickCallback(self._batch_sync)

    def _onTick(self, timeToWait=0.0):
        # pysyncobj's thread ticks here (timers, network, applying commits,
        # our callbacks). pysyncobj would log an exception and tick again,
        # on state nobody knows any more (a journal whose fsync failed); it
        # is raised on the event loop instead, whose exception handler
        # stops the node (node.Node.fatal).
        try:
            now = pysyncobj_clock()  # pysyncobj's clock (not time.monotonic: CLOCK_MONOTONIC_RAW)
            if self._last_tick is not None:
                gap = now - self._last_tick - timeToWait  # beyond the poll's wait
                if gap >= RAFT_STALL_S:
                    self._stalled(gap, now)
            self._last_tick = now
            super()._onTick(timeToWait)
            if self.transfer_request is not None:
                self._transfer_tick()
        except Exception as exc:
            self._engine._from_thread(_raised_in_pysyncobj_thread, exc)
            raise

    def _stalled(self, gap: float, now: float) -> None:
        """The process could not run for about `gap` s before `now`
        (RAFT_STALL_S): move the election deadline and every peer's last
        answer (the leader's fallback) on by as much, never past what a
        message read since the stall set, before the tick judges them.
        pysyncobj's own attributes, on its thread."""
        log.info("node %d: stalled for about %.0f ms; timeouts moved on by as much",
                 self._engine.config.node_id, gap * 1000)
        state = self.__dict__  # (the attribute pysyncobj sets; mypy cannot type it)
        state["_SyncObj__raftElectionDeadline"] = min(
            state["_SyncObj__raftElectionDeadline"] + gap, now + _RAFT_TIMING["raftMaxTimeout"])
        answered = self._SyncObj__lastResponseTime
        for node in answered:
            answered[node] = min(answered[node] + gap, now)

    # Leader transfer, on pysyncobj's thread. The loop sets
    # `transfer_request` (one assignment) to the target's raft address; from
    # then on only this thread touches the transfer's state.
    transfer_request: str | None = None
    _transfer: list | None = None  # [target Node, start term, deadline, sent, last deadline]

    def _transfer_tick(self) -> None:
        now = time.monotonic()
        t = self._transfer
        if t is None:
            addr = self.transfer_request
            node = next((n for n in self._SyncObj__otherNodes if n.id == addr), None)
            if node is None or self._SyncObj__raftState != _LEADER:
                self._transfer_ended(None, "not master")
                return
            t = self._transfer = [node, self.raftCurrentTerm, now + RAFT_TRANSFER_S, False, 0.0]
        node, term, deadline, sent, last_deadline = t
        leader = self._SyncObj__raftLeader
        if self.raftCurrentTerm > term and leader is not None:
            self._transfer_ended(leader.id, None)  # a leader of a later term
            return
        if not sent and self._SyncObj__raftState == _LEADER:
            last = self._SyncObj__getCurrentLogIndex()
            # Nothing proposed before the transfer began is left in
            # pysyncobj's command queue (a tick appends only what it has
            # time for): appended after the TimeoutNow, it would make our
            # log longer than the target's, and the voters would refuse it.
            queued = self._SyncObj__commandsQueue._FastQueue__queue
            if (not queued and self._SyncObj__raftMatchIndex.get(node, 0) == last
                    and self.raftCommitIndex == last):
                # pysyncobj's own checks pass (it is leader, the target is
                # caught up), on its thread: it sends TimeoutNow
                self.transferLeadership(node)
                t[2:] = [now + RAFT_TRANSFER_S, True,
                         now + RAFT_TRANSFER_S + RAFT_TRANSFER_ELECTION_S]
                return
        if now >= deadline:
            stepped_down = (self._SyncObj__raftState != _LEADER
                            or self.raftCurrentTerm > term)
            if sent and stepped_down and now < last_deadline:
                return  # the election it started is under way: wait for its leader
            caught_up = sent or self._SyncObj__raftState != _LEADER
            self._transfer_ended(None, "transfer timed out" if caught_up
                                 else "node not caught up")

    def _transfer_ended(self, leader_addr: str | None, reason: str | None) -> None:
        self._transfer = None
        self.transfer_request = None
        self._engine._from_thread(self._engine._transfer_ended, leader_addr, reason)

    @replicated
    def _commit(self, payload: bytes) -> None:
        # Runs on pysyncobj's thread, in log order, on every node.
        if self._journal is not None and self._policy is Fsync.ALWAYS:
            self._journal.sync()
        self._engine._from_thread(self._engine._on_committed, self.raftLastApplied + 1, payload)

    def _before_send(self) -> None:
        if self._journal is not None and self._policy is Fsync.ALWAYS:
            self._journal.sync()

    def _batch_sync(self) -> None:
        journal = self._journal  # a tick callback only with a journal (__init__)
        now = time.monotonic()
        if journal is not None and journal.dirty and now - self._last_sync >= BATCH_SYNC_MS / 1000:
            self._last_sync = now
            journal.sync()

    def last_index(self) -> int:
        """The index of the last entry in the raft log (read from the loop
        thread: a single list read; pysyncobj has no public accessor)."""
        try:
            return self._SyncObj__raftLog[-1][1]
        except (IndexError, AttributeError):
            return self.raftCommitIndex


class RaftEngine:
    """The service's `Engine` on pysyncobj."""

    def __init__(self, *, config: Config, store: Store) -> None:
        self.config = config
        self.store = store
        self.me = LeaderInfo(node_id=config.node_id, host=config.client_host, port=config.port)
        self.machine = RaftMachine(store=store, node_id=config.node_id,
                                   async_mode=config.mode is Mode.ASYNC)
        peers = config.peers or ()
        self._raft_addr: dict[int, str] = {p.node_id: f"{p.host}:{p.port + RAFT_PORT_OFFSET}"
                                           for p in peers}
        self._node_by_addr = {a: n for n, a in self._raft_addr.items()}
        self._clients: dict[int, LeaderInfo] = {config.node_id: self.me}
        others = [p for p in peers if p.node_id != config.node_id]
        self.net: PeerNetwork | None = None
        self.forwarder: Forwarder | None = None
        if others:
            me = next(p for p in peers if p.node_id == config.node_id)
            self.net = PeerNetwork(
                node_id=config.node_id, listen=(me.host, me.port),
                peers={p.node_id: p.dial_address for p in others},
                secret=config.secret, on_message=self._on_message, on_link=self._on_link,
                tls=peer_contexts(config))
            self.forwarder = Forwarder(node_id=config.node_id, net=self.net, vote_id=self._term)
        self.sync: _QueueSync | None = None
        # The loop's pause to take the store's state for pysyncobj's snapshot.
        self.snapshot_pause_seconds = Histogram(PAUSE_BUCKETS_S)
        # Set by the node: how a request a slave forwarded is answered.
        self.handle_forwarded: ForwardedHandler | None = None
        self.answer_forwarded_now: AnswerNow | None = None
        # The raft engine cannot fail on its own in a way the node must hear
        # of here: what escapes pysyncobj's thread is raised on the loop.
        self.on_fatal: FatalHandler | None = None
        # Set by the node: told when this node becomes or stops being master.
        self.on_role_change: RoleHandler | None = None
        # Never called: each commit is its own callback here, and the node's
        # end-of-turn flush writes all of a turn's answers to a connection
        # at once.
        self.on_answered: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tmp_dir: str | None = None
        self._raft_state = _FOLLOWER  # pysyncobj's state, as last reported to the loop
        self._leader_term: int | None = None  # term in which pysyncobj made us leader
        self._closing = False
        self._reads: list[Done] = []  # reads of this turn, waiting for their marker
        # Those told how the leader transfer under way ends (its target)
        self._transfer: tuple[int, list[TransferDone]] | None = None
        self._last_role: Role | None = None
        # A plain attribute, not a property: the service reads it per request.
        self.is_master = False

    # -- Engine interface --------------------------------------------------------

    commits_at_once = False

    def leader(self) -> LeaderInfo | None:
        if self.is_master:
            return self.me
        node = self.sync._getLeader() if self.sync is not None else None
        if node is None:
            return None
        node_id = self._node_by_addr.get(node.address)
        if node_id is None or node_id == self.config.node_id:
            return None  # ourselves, not yet ready to decide
        return self._clients.get(node_id)

    def status(self) -> EngineStatus:
        s = self.sync
        if s is None:
            return EngineStatus(role=Role.SLAVE, vote_id=0, trans_id=0, commit_id=0,
                                applied_id=0, log_size=0)
        return EngineStatus(role=self._role(), vote_id=s.raftCurrentTerm, trans_id=s.last_index(),
                            commit_id=s.raftCommitIndex, applied_id=self.machine.applied_index,
                            log_size=s._getRaftLogSize())

    def slaves(self) -> list[dict] | None:
        """Per slave: match position and lag, from pysyncobj's status."""
        if self.sync is None:
            return []
        connected = self.net.connected_ids() if self.net else set()
        last = self.sync.last_index()
        status = self._thread_call(self.sync.getStatus)
        out = []
        for node_id, addr in sorted(self._raft_addr.items()):
            if node_id == self.config.node_id:
                continue
            match = (status or {}).get("match_idx_server_" + addr, 0)
            slave = {"node_id": node_id, "match_id": match, "lag": last - match,
                     "connected": node_id in connected}
            client = self._clients.get(node_id)  # its client address, from its Hello
            if client is not None:
                slave["host"], slave["port"] = client.host, client.port
            out.append(slave)
        return out

    def snapshot_info(self) -> dict | None:
        return None  # pysyncobj's snapshots: nothing measured to show

    def storage_info(self) -> dict | None:
        return None  # pysyncobj's journal: nothing measured to show

    def timings(self) -> dict[str, Histogram]:
        out = {"snapshot_pause": self.snapshot_pause_seconds}
        journal = self.sync._journal if self.sync is not None else None
        if journal is not None:  # with storage
            out["fsync"] = journal.fsync_seconds
        return out

    def propose(self, entry: Entry, done: Done) -> None:
        if self._transfer is not None and self.is_master:
            done(None, "no leader")  # handing over: nothing appended (read markers neither)
            return
        payload = self.machine.propose(entry, done)
        if payload is not None:
            self._submit(payload)

    def read_index(self, done: Done) -> None:
        """Answer a read once it rests on committed state: the reads of one
        loop turn share one marker (a Noop entry of this master's epoch);
        when the marker comes back committed and counting, no other epoch
        decided anything since the reads were asked for, and everything
        before them is committed (RaftMachine's rule). pysyncobj has no read
        index of its own; the marker costs one raft entry per turn of reads.
        In async mode, at once."""
        if self.machine.async_mode:
            done(None, None)
            return
        self._reads.append(done)
        if len(self._reads) == 1:
            asyncio.get_running_loop().call_soon(self._propose_read_marker)

    def _propose_read_marker(self) -> None:
        reads, self._reads = self._reads, []

        def done(_result: object, error: str | None) -> None:
            if error == "not master":  # lost the role since the reads came
                error = OUTCOME_UNKNOWN
            for read in reads:
                read(None, error)

        self.propose(Noop(), done)

    def commit_now(self, entry: Entry) -> object:
        raise InvariantError("commit_now on an engine that does not commit at once")

    def transfer_leader(self, node_id: int, done: TransferDone) -> None:
        """Engine.transfer_leader, by pysyncobj's TimeoutNow (see "Leader
        transfer" in the module docstring). `done` runs on the loop."""
        if not self.is_master or self.sync is None:
            done(None, "not master")
            return
        if node_id == self.config.node_id:
            done(node_id, None)
            return
        addr = self._raft_addr.get(node_id)
        if addr is None:
            done(None, "no such node")
            return
        if self._transfer is not None:
            if self._transfer[0] == node_id:
                self._transfer[1].append(done)
            else:
                done(None, "transfer in progress")
            return
        self._transfer = (node_id, [done])
        self.sync.transfer_request = addr  # pysyncobj's thread takes it at its next tick

    def _transfer_ended(self, leader_addr: str | None, reason: str | None) -> None:
        transfer, self._transfer = self._transfer, None
        if transfer is None:
            return
        leader = None if leader_addr is None else self._node_by_addr.get(leader_addr)
        if reason is None and leader is None:
            reason = "transfer timed out"  # a leader we do not know: cannot happen
        for done in transfer[1]:
            done(leader, reason)

    def transfer_target(self) -> int | None:
        """The connected follower with the highest match index (pysyncobj's
        status), on the master."""
        if not self.is_master or self.sync is None:
            return None
        status = self._thread_call(self.sync.getStatus) or {}
        best: tuple[int, int] | None = None
        for node_id, addr in self._raft_addr.items():
            if (node_id == self.config.node_id
                    or status.get("partner_node_status_server_" + addr) != 2):
                continue
            key = (status.get("match_idx_server_" + addr, 0), -node_id)
            if best is None or key > best:
                best = key
        return None if best is None else -best[1]

    def forward(self, request: dict, respond: Respond,
                timeout_s: float | None = None) -> Cancel | None:
        """Relay a client request to the master; None if none is reachable."""
        leader = self.leader()
        if leader is None or self.forwarder is None:
            return None
        return self.forwarder.forward(leader.node_id, request, respond, timeout_s)

    @property
    def epoch(self) -> int:
        """Receipts' epoch: the machine's (term, k, node_id) in one number
        (term above bit 32, k and the node id in 16 bits each: unique while
        a term opens fewer than 65,536 epochs and node ids differ in their
        low 16 bits)."""
        mine = self.machine.my_epoch
        if mine is None:
            return 0
        term, k, node_id = mine
        return term << 32 | (k & 0xFFFF) << 16 | (node_id & 0xFFFF)

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        cfg = self.config
        if cfg.secret is None:
            log.warning("node %d: raft engine without <cluster secret>: pysyncobj's password "
                        "is derived from the node list, which gives NO security; anyone who "
                        "can reach the raft ports can inject commands. Configure a secret.",
                        cfg.node_id)
        if cfg.storage_dir:
            os.makedirs(cfg.storage_dir, exist_ok=True)
            data_dir, journal = cfg.storage_dir, os.path.join(cfg.storage_dir, "raft.journal")
        else:
            # pysyncobj's dump file (the whole state, at each compaction)
            self._tmp_dir = data_dir = private_tmp_dir("raft")
            journal = None
        conf = SyncObjConf(
            password=raft_password(cfg), journalFile=journal,
            fullDumpFile=os.path.join(data_dir, "raft.dump"),
            serializer=self._serialize, deserializer=self._deserialize,
            dynamicMembershipChange=False, autoTick=True, appendEntriesUseBatch=False,
            commandsWaitLeader=False, onStateChanged=self._on_state_changed,
            logCompactionMinEntries=max(2, cfg.log_size), maxBindRetries=RAFT_BIND_TRIES,
            bindRetryTime=RAFT_BIND_RETRY_S, **_RAFT_TIMING)
        if self.net is not None:
            await self.net.start()
        if cfg.peers:
            self_addr = self._raft_addr[cfg.node_id]
            others = [_DialedNode(self._raft_addr[p.node_id], p.raft_dial) if p.raft_dial
                      else self._raft_addr[p.node_id]
                      for p in cfg.peers if p.node_id != cfg.node_id]
        else:
            # one node: pysyncobj needs an address, binds nothing useful
            self_addr = f"{cfg.host}:0"
            others = []
        self.sync = _QueueSync(self, self_addr, others, conf)
        try:
            await asyncio.to_thread(self.sync.waitBinded)
        except _pso.SyncObjException:
            sync, self.sync = self.sync, None
            await asyncio.to_thread(sync.destroy_synchronous)  # (its thread keeps the process)
            raise OSError(errno.EADDRINUSE, f"raft port {self_addr}: not bound after "
                                            f"{RAFT_BIND_TRIES} tries") from None
        log.info("node %d: raft engine (pysyncobj) on %s, %d other node(s), storage %s, fsync %s",
                 cfg.node_id, self_addr, len(others), cfg.storage_dir or "none (memory)",
                 cfg.fsync.value if cfg.storage_dir else "-")

    def halt(self) -> None:
        """A fatal error elsewhere in the node: hand nothing more from
        pysyncobj's thread to the loop (nothing more is applied or
        answered)."""
        self._closing = True

    async def close(self) -> None:
        self._closing = True
        if self.forwarder is not None:
            self.forwarder.close()
        if self.sync is not None:
            await asyncio.to_thread(self.sync.destroy_synchronous)
        if self.net is not None:
            await self.net.close()
        if self._tmp_dir is not None:
            remove_private_tmp_dir(self._tmp_dir)

    # -- from pysyncobj's thread -------------------------------------------------------

    def _from_thread(self, fn, *args) -> None:
        """Run fn(*args) on the loop, after everything handed over before it."""
        loop = self._loop
        if loop is None or self._closing:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the node is stopping
            pass

    def _thread_call(self, fn):
        """Best effort: fn() read from the loop thread (pysyncobj's status);
        None if it raced with pysyncobj's thread."""
        try:
            return fn()
        except RuntimeError:  # a dict changed size while being read
            return None

    def _on_state_changed(self, old: int, new: int) -> None:
        self._from_thread(self._on_state, new, self.sync.raftCurrentTerm if self.sync else 0)

    def _proposal_callback(self, result, error) -> None:
        if error != FAIL_REASON.SUCCESS:
            self._from_thread(self._on_proposal_error, error)

    def _serialize(self, path: str, data) -> None:
        """pysyncobj's snapshot hook (its thread): the store's wire form at
        the last applied index, taken on the loop, written as msgpack."""
        last, prev, cluster = data
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def take() -> None:
            started = time.perf_counter_ns()
            try:
                fut.set_result(self.machine.snapshot())
            except BaseException as exc:  # reported to pysyncobj's thread
                fut.set_exception(exc)
            self.snapshot_pause_seconds.observe_ns(time.perf_counter_ns() - started)

        if self._loop is None or self._closing:
            raise RuntimeError("node stopping")
        self._loop.call_soon_threadsafe(take)
        state = fut.result(SNAPSHOT_WAIT_S)
        body = msgpack.packb([state, list(last), list(prev), sorted(n.address for n in cluster)],
                             use_bin_type=True)
        with open(path, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())

    def _deserialize(self, path: str):
        """pysyncobj's snapshot-loading hook (its thread): hand the state to
        the loop; give pysyncobj back its two log entries and node set."""
        with open(path, "rb") as f:
            state, last, prev, cluster = msgpack.unpackb(f.read(), raw=False,
                                                         strict_map_key=False)
        last, prev = tuple(last), tuple(prev)
        self._from_thread(self._on_snapshot, last[1], state)
        return last, prev, {TCPNode(a) for a in cluster}

    # -- on the loop -----------------------------------------------------------------------

    def _submit(self, payload: bytes) -> None:
        if self.sync is None:  # proposals come from the service, after start()
            raise InvariantError("raft engine used before start()")
        self.sync._commit(payload, callback=self._proposal_callback)

    def _on_committed(self, index: int, payload: bytes) -> None:
        answers = self.machine.apply_committed(index, payload)
        self._after(answers)

    def _on_snapshot(self, index: int, state: list) -> None:
        log.info("node %d: loading raft snapshot at index %d", self.config.node_id, index)
        self._after(self.machine.load_snapshot(index, state))

    def _on_state(self, new: int, term: int) -> None:
        self._raft_state = new
        answers: list = []
        if new == _LEADER:
            self._leader_term = term
        elif self._leader_term is not None:
            self._leader_term = None
            answers = self.machine.lose_leadership()
        self._after(answers)

    def _on_proposal_error(self, error: int) -> None:
        answers: list = []
        if self.machine.pending:
            answers = self.machine.proposal_failed()
        elif self.machine.barrier_wanted is not None and not self.machine.is_master:
            self.machine.barrier_wanted = None  # the barrier itself failed
        self._after(answers)

    def _after(self, answers: list) -> None:
        """Answer clients, then make sure a leader is working towards
        deciding (a barrier in flight), and log role changes."""
        m = self.machine
        if (self._leader_term is not None and not m.is_master and m.barrier_wanted is None
                and not self._closing):
            self._submit(m.make_barrier(self._leader_term))
        was_master = self.is_master
        self.is_master = self._leader_term is not None and m.is_master
        for answer in answers:
            answer()
        if self.is_master is not was_master and self.on_role_change is not None:
            self.on_role_change(self.is_master)
        role = self._role()
        if role is not self._last_role:
            self._last_role = role
            log.info("node %d: %s in term %d", self.config.node_id, role.value, self._term())

    def _role(self) -> Role:
        if self.is_master:
            return Role.MASTER
        if self._raft_state == _FOLLOWER:
            return Role.SLAVE
        return Role.CANDIDATE  # electing, or elected and not yet deciding

    def _term(self) -> int:
        return self.sync.raftCurrentTerm if self.sync is not None else 0

    # -- peer links: client addresses and forwarding ----------------------------------------

    # Both are called by the peer network, which exists only with other
    # nodes, and so does the forwarder.

    def _on_link(self, peer_id: int, up: bool) -> None:
        net, forwarder = self.net, self.forwarder
        if net is None or forwarder is None:
            return
        if up:
            net.send(peer_id, message_to_wire(Hello(
                vote_id=self._term(), node_id=self.config.node_id,
                client_host=self.config.client_host, client_port=self.config.port)))
            forwarder.link_up(peer_id)
        else:
            forwarder.link_down(peer_id)

    def _on_message(self, peer_id: int, obj: object) -> None:
        forwarder = self.forwarder
        if forwarder is None:
            return
        msg = message_from_peer(peer_id, obj)
        if isinstance(msg, str):
            log.warning("node %d: %s", self.config.node_id, msg)
        elif isinstance(msg, Hello):
            self._clients[peer_id] = LeaderInfo(node_id=peer_id, host=msg.client_host,
                                                port=msg.client_port)
        elif isinstance(msg, ForwardBatch):
            forwarder.serve_batch(peer_id, msg, self.handle_forwarded,
                                  self.answer_forwarded_now)
        elif isinstance(msg, ForwardReplies):
            forwarder.on_replies(msg)
        elif isinstance(msg, Forward):
            forwarder.serve(peer_id, msg, self.handle_forwarded, self.answer_forwarded_now)
        elif isinstance(msg, ForwardReply):
            forwarder.on_reply(msg)
        elif isinstance(msg, Features):
            forwarder.on_features(peer_id, msg)
        elif isinstance(msg, ForwardCancel):
            forwarder.on_cancel(peer_id, msg)
        # Anything else is the native engine's: not ours to act on.
