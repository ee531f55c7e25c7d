"""The asyncio adapter of the native engine: one NativeCore, its peer links,
its storage, its timer, and request forwarding.

Mechanical by design: a peer message is decoded and stepped into the core; a
proposal is handed to the core; once per event-loop turn the core's `Ready`
is carried out in order (persist vote, persist log, send, answer); one timer
is armed for the core's next deadline. Nothing else mutates the core.

Storage (when configured): the vote is saved (always fsynced) before any
message goes out; log changes are written before anything is sent or
answered, then handed to `durability.Durability` (`after_write`), which
owns when they are fsynced: the fsync policy, the batch timer, syncs off
the event loop, and the contract with the core (it reads `Ready.own_sync`
and reports with `NativeCore.synced_to`). A failed sync stops the node
(`on_fatal`). A node
configured alone but with storage runs this engine too, with no peers: it
elects itself at once and commits on its own.

Snapshots (writing our own in a forked child, streaming to a slave,
receiving from the master) are `snapshots.SnapshotFiles`; this adapter
routes their messages and carries out the core's snapshot sends.

A full disk: the log's current segment is filled with zeros ahead of its
records (storage.disk), and records are only ever written into that room,
which is reserved before anything reaches the core: a write (propose) that
does not fit once the zeros cannot be extended is answered "disk full"
before it is appended or applied; a slave takes a push whose records do not
fit as a heartbeat (it answers for what it holds, so the master never counts
them, and pulls them later). Then writes are refused until a timer
(DISK_RETRY_S) finds room again. Any other write error (EIO), or a record
written outside the room, stops the node as before.

Answering at once: a master alone (no peers) or in async mode, whose fsync
policy is off or batch (or without storage), answers a write once its
record is written, without waiting for another node; it needs no Ready, no
callback and no answer closure for that. While it is master, its storage
works and the log's room takes more than one request's record,
`commits_at_once` is on and the service calls `commit_now`, which appends
and applies the entry (`NativeCore.append_entry_now`; alone it also
commits) and returns the result: the service builds the answer in the same
call, as a node in memory does. With storage, each record is encoded once,
before it is appended (`encode_payload`, of the trans_id and vote_id it
will have; the fast path keeps more room in the log than any one record
takes), and written at once, in that call: a copy into the log's mapping
(`DiskStorage.append_payload`), so the answer
leaves with its record in the page cache, as on the general path (the
batch timer fsyncs it later). Pushes to the slaves go out with the turn's
Ready, as for proposals. A write that takes the general path (propose: a
batch, a dead-letter move, or any write while the room is low or the disk
full) turns the fast path off until its Ready is carried out, so the log
file keeps trans_id order; so does losing the master role, at once
(`_step_now`).

Leader transfer (`transfer_leader`, the core's TimeoutNow): the fast path
is off from the request until the transfer ends (the core refuses every
write meanwhile), and the core's timer covers the transfer's deadline. It
is off too while a master back from a long stall confirms its role (the
core's "A stall": `_on_timer` reports the stall, `confirming_role`).

Forwarding (`engines.forwarding`): a slave relays a client request to the
master over the internal link; if the master is unknown or unreachable the
client hears "no leader" at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable

from ...config import Config, Fsync, Mode
from ...errors import InvariantError
from ...state.entries import Entry
from ...state.log import Log
from ...state.store import SnapshotLoader, Store
from ...stats import Histogram
from ...storage import (
    FRAME_HEADER_BYTES,
    DiskStorage,
    StorageError,
    encode_payload,
    record_size_bound,
)
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
    Message,
    Push,
    Snapshot,
    SnapshotAck,
    SnapshotChunk,
    message_from_peer,
    message_to_wire,
)
from ..peers import PeerNetwork
from .core import NativeCore, OwnSync, Ready, Timing
from .durability import Durability
from .snapshots import SnapshotFiles

__all__ = ["ClusterEngine", "DEFAULT_TIMING"]

log = logging.getLogger(__name__)

# Heartbeats every 100 ms; a master silent for 600-1200 ms is replaced, so a
# failover completes in well under 2 s, while a briefly busy event loop on a
# loaded machine does not trigger elections.
DEFAULT_TIMING = Timing(heartbeat_ms=100, election_ms=600, pull_retry_ms=300)

# A timer that fires at least this late means the event loop stalled (the
# core's "A stall"): it was armed for a deadline at most a heartbeat away,
# and a busy loop turn takes milliseconds. The core is told before it ticks.
STALL_MS = 200

# Async mode: new records are pushed at most this often (NativeCore's
# push_interval_ms): one push carries several turns' records, which saves
# the slaves a turn, a decode and an acknowledgement per turn of the master.
ASYNC_PUSH_INTERVAL_MS = 2

# A node alone writes commit_now's records without a flush; it flushes at
# least every this many of them (fewer if log_size is smaller), so that the
# snapshot writer sees when one is due.
FAST_CHECK_RECORDS = 1024


# A full disk (see "A full disk" above): writes are refused with this reason,
# and the log is checked for room again this often.
DISK_FULL = "disk full"
DISK_RETRY_S = 1.0
# Room kept in the log beyond what writes reserve, for the records the core
# writes on its own (a new master's Noop, about 30 bytes each).
DISK_MARGIN_BYTES = 64 * 1024
# After a full disk, writes are accepted again once this much room is back.
DISK_FREE_BYTES = 1024 * 1024


def monotonic_ms() -> int:
    """The core's clock: monotonic, for its timers only (elections,
    heartbeats, pulls). A step of the wall clock (NTP, an operator) must not
    look like a silent master. Message times are wall-clock (the client
    protocols', forwarding.wall_ms)."""
    return int(time.monotonic() * 1000)


# What the adapter reads its clock through: a variable, looked up at every
# call, so that a test or bench may stop the clock (`driver.now_ms = ...`)
# also when this module is compiled (qserver.compiled), where the calls of a
# function defined here are bound when compiled.
now_ms: Callable[[], int] = monotonic_ms


class ClusterEngine:
    """The native engine on real sockets; the service's `Engine`."""

    def __init__(self, *, config: Config, store: Store, log_: Log,
                 storage: DiskStorage | None = None, vote: tuple[int, int] = (0, 0),
                 timing: Timing = DEFAULT_TIMING,
                 snapshot: tuple[int, int] | None = None) -> None:
        self.config = config
        self.storage = storage
        peers = [p for p in config.peers if p.node_id != config.node_id]
        self.core = NativeCore(
            node_id=config.node_id, peer_ids=[p.node_id for p in peers], store=store,
            log=log_,
            me=LeaderInfo(node_id=config.node_id, host=config.client_host, port=config.port),
            rng=random.Random(), now_ms=now_ms(), timing=timing,
            async_mode=config.mode is Mode.ASYNC, sync_rate=config.sync_rate,
            log_size=config.log_size, vote_id=vote[0], voted_for=vote[1],
            external_snapshots=True,
            # async mode answers a write once it is on our disk: no deferral
            deferred_sync=(storage is not None and config.fsync is Fsync.ALWAYS
                           and config.mode is not Mode.ASYNC),
            push_interval_ms=ASYNC_PUSH_INTERVAL_MS, snapshot=snapshot,
            # without a data directory, a snapshot only serves a slave behind
            snapshots_on_demand=storage is None)
        # The peer links and the forwarding over them: both or neither (a
        # node alone has no peers); only the links' callbacks use forwarder.
        self.net: PeerNetwork | None = None
        self.forwarder: Forwarder | None = None
        if peers:
            me = next(p for p in config.peers if p.node_id == config.node_id)
            self.net = PeerNetwork(
                node_id=config.node_id, listen=(me.host, me.port),
                peers={p.node_id: p.dial_address for p in peers},
                secret=config.secret, on_message=self._on_message, on_link=self._on_link,
                tls=peer_contexts(config))
            self.forwarder = Forwarder(node_id=config.node_id, net=self.net,
                                       vote_id=lambda: self.core.vote_id)
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start(); see _running
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        # Since when the armed timer's callback is due (now_ms): its
        # deadline, or the arming if that was later; kept when an overdue
        # timer is re-armed, so that a stall is measured in full.
        self._timer_due = 0
        self._flush_scheduled = False
        self._last_role: Role | None = None  # as last logged
        # Set by the node: how a request a slave forwarded is answered.
        self.handle_forwarded: ForwardedHandler | None = None
        self.answer_forwarded_now: AnswerNow | None = None
        # Called with the error when storage fails at run time (the node
        # must stop; it recovers from disk on restart). Set by the Node.
        self.on_fatal: FatalHandler | None = None
        # Set by the node: told when this node becomes or stops being master.
        self.on_role_change: RoleHandler | None = None
        # Set by the node: called after `_flush` ran a batch of answers
        # (Engine.on_answered).
        self.on_answered: Callable[[], None] | None = None
        self._was_master = False  # as last told to on_role_change
        # When the log is fsynced: exists iff storage does (None without).
        self.durability: Durability | None = None
        if storage is not None:
            self.durability = Durability(
                storage=storage, policy=config.fsync, node_id=config.node_id,
                synced=self.core.synced_to, fail=self._fail,
                schedule_flush=self._schedule_flush)
        self._closing = False  # close() began: no new disk-retry timers
        self._failed = False  # storage failed or the node halted: nothing more is carried out
        # A full disk: bytes of records reserved in the log's room since the
        # last flush (see _reserve), and whether writes are refused now.
        self._reserved = 0
        self._disk_full = False
        self._disk_timer: asyncio.TimerHandle | None = None
        # The fast path (commit_now): a node alone or in async mode whose
        # fsync policy lets it answer once a record is written (off, batch;
        # or no storage), while the log's room holds more than any one
        # request's record can take.
        self._fast_ok = ((not peers or config.mode is Mode.ASYNC)
                         and (storage is None or config.fsync is not Fsync.ALWAYS))
        self._fast_room = 2 * config.max_request_size + 2 * DISK_MARGIN_BYTES
        # What commit_now may write before it must look at the log's room:
        # the room less _fast_room, as of _update_fast_path, less what it
        # wrote since.
        self._fast_budget = -1
        # A node alone flushes for commit_now's records only when one's
        # trans_id reaches this (every _check_every records: the snapshot
        # writer looks whether one is due; fsync=batch flushes after each
        # sync anyway); with slaves, every turn (the push).
        self._check_every = max(1, min(FAST_CHECK_RECORDS, config.log_size))
        self._check_at = 0
        self.snapshots = SnapshotFiles(
            core=self.core, storage=storage, node_id=config.node_id, log_size=config.log_size,
            send=self._send_to, step=self._step_now, schedule_flush=self._schedule_flush)

    # -- Engine interface ----------------------------------------------------

    # True while the fast path holds (see "Answering at once" in the module
    # docstring and `_update_fast_path`); the service then calls
    # `commit_now` instead of `propose`.
    commits_at_once = False

    @property
    def is_master(self) -> bool:
        return self.core.is_master

    def leader(self) -> LeaderInfo | None:
        """The master, as far as clients should be sent to it: not one whose
        link is down (a dead master stays the core's leader_id until a new
        one is elected, which without a majority never happens)."""
        leader_id = self.core.leader_id
        if (leader_id and leader_id != self.config.node_id and self.net is not None
                and not self.net.connected(leader_id)):
            return None
        return self.core.leader()

    def status(self) -> EngineStatus:
        return self.core.status(now_ms())

    def slaves(self) -> list[dict] | None:
        connected = self.net.connected_ids() if self.net else set()
        out = self.core.slaves()
        peers = self.core.peers
        for s in out:
            s["connected"] = s["node_id"] in connected
            client = peers[s["node_id"]].client  # its client address, from its Hello
            if client is not None:
                s["host"], s["port"] = client.host, client.port
        return out

    def snapshot_info(self) -> dict | None:
        """What monitor shows about snapshots (pauses in ms, as measured)."""
        return self.snapshots.info()

    def storage_info(self) -> dict | None:
        """What monitor shows about the log on disk (None without storage)."""
        storage = self.storage
        if storage is None:
            return None
        return {"fsync": self.config.fsync.value, "records_written": storage.records_written,
                "fsyncs": storage.syncs, "disk_full": self._disk_full}

    def timings(self) -> dict[str, Histogram]:
        out = {"snapshot_pause": self.snapshots.pause_seconds}
        if self.durability is not None:
            out["fsync"] = self.durability.fsync_seconds
        return out

    def propose(self, entry: Entry, done: Done) -> None:
        # Until this turn's Ready is carried out, nothing commits at once:
        # the records of the fast path must follow this one in the log file.
        self.commits_at_once = False
        storage = self.storage
        if storage is not None and not self._reserve(storage, record_size_bound(entry)):
            done(None, DISK_FULL)  # before the core: nothing was appended or applied
            return
        self.core.propose(entry, done)
        self._schedule_flush()

    def read_index(self, done: Done) -> None:
        self.core.read_index(done)
        self._schedule_flush()

    def transfer_leader(self, node_id: int, done: TransferDone) -> None:
        """Hand the master role to `node_id` (Engine.transfer_leader; the
        core's "Leader transfer"). `done` runs from a flush."""
        self.commits_at_once = False  # now: the core refuses writes until it ends
        self.core.transfer_leader(node_id, done, now_ms())
        self._schedule_flush()

    def transfer_target(self) -> int | None:
        return self.core.transfer_target(now_ms())

    def commit_now(self, entry: Entry) -> object:
        """The fast path (only while `commits_at_once`; see "Answering at
        once" in the module docstring): append and apply `entry` and return
        what apply returned. With storage its record is written first (a
        copy into the log's mapping), so the answer may leave at once."""
        if not self.commits_at_once:
            raise InvariantError("commit_now while the engine does not commit at once")
        storage = self.storage
        core = self.core
        if storage is None:
            result = core.append_entry_now(entry)
            # The push to the slaves, unless the timer runs it anyway
            # (_push_timed: coalesced pushes, async mode).
            if not self._flush_scheduled and not self._push_timed():
                self._schedule_flush()
            return result
        # Encoded once, as the record append_entry_now appends will be: its
        # size checked against the room, then written.
        trans_id = core.log.last_trans_id + 1
        payload = encode_payload(trans_id, core.vote_id, entry)
        size = FRAME_HEADER_BYTES + len(payload)
        budget = self._fast_budget - size
        # Within the budget, the log's room holds this record and more than
        # one request's beyond it; past it, look at the room itself.
        if budget < 0 and storage.room < size + DISK_MARGIN_BYTES:
            # _update_fast_path keeps more room than one request can need
            raise InvariantError("commit_now without room for its record")
        result = core.append_entry_now(entry)
        try:
            storage.append_payload(payload)
        except StorageError as exc:
            self._fail(exc)  # the node stops; the answer is never written
            raise
        self._fast_budget = budget
        durability = self.durability
        if durability is not None and durability.wants_writes:
            durability.after_write(OwnSync.BEFORE_SEND)  # (arms the batch timer)
        if budget < 0:
            self._update_fast_path()
        if ((self.net is not None and not self._push_timed()) or trans_id >= self._check_at) \
                and not self._flush_scheduled:
            self._schedule_flush()
        return result

    def _push_timed(self) -> bool:
        """Whether the timer fires by the time the core pushes what was
        appended so far (`NativeCore.push_at`: async mode coalesces pushes
        for push_interval_ms). A write on the fast path then needs no flush
        of its own: one per push instead of one per loop turn, each of which
        did nothing else (take_ready found the push not due and the timer
        armed for it)."""
        return self._timer is not None and self._timer_at <= self.core.push_at()

    def forward(self, request: dict, respond: Respond,
                timeout_s: float | None = None) -> Cancel | None:
        """Relay a client request to the master; None if none is reachable."""
        leader_id = self.core.leader_id
        if not leader_id or leader_id == self.config.node_id or self.forwarder is None:
            return None
        return self.forwarder.forward(leader_id, request, respond, timeout_s)

    @property
    def epoch(self) -> int:
        """Receipts' epoch: the vote_id (one master per vote_id)."""
        return self.core.vote_id

    # -- lifecycle -------------------------------------------------------------

    @property
    def _running(self) -> asyncio.AbstractEventLoop:
        """The event loop, once start() has run."""
        if self._loop is None:
            raise InvariantError("ClusterEngine used before start()")
        return self._loop

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.snapshots.start(self._loop)
        if self.durability is not None:
            self.durability.start(self._loop)
        if self.net is not None:
            await self.net.start()
            log.info("node %d: cluster of %d, internal port %s, mode %s", self.config.node_id,
                     len(self.config.peers), self.net.address[1], self.config.mode.value)
        self._arm_timer()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._disk_timer is not None:
            self._disk_timer.cancel()
        if self.forwarder is not None:
            self.forwarder.close()
        self.snapshots.stop()
        if self.net is not None:
            await self.net.close()
        self._closing = True
        self.commits_at_once = False
        if self.durability is not None:
            # waits for a sync in flight, then closes the storage (or
            # leaves it as a crash would, after a failure)
            await self.durability.close()

    # -- events ----------------------------------------------------------------

    def _forwarding(self) -> Forwarder:
        """The forwarder, from a callback of the peer links (they exist
        together)."""
        if self.forwarder is None:
            raise InvariantError("a peer link event on a node without peers")
        return self.forwarder

    def _on_message(self, peer_id: int, obj: object) -> None:
        msg = message_from_peer(peer_id, obj)
        if isinstance(msg, str):  # a reason to drop it (isinstance: mypy narrows out str)
            log.warning("node %d: %s", self.config.node_id, msg)
            return
        # `type(msg) is C` written out each time: mypy narrows `msg` on it.
        if type(msg) is ForwardBatch:
            self._forwarding().serve_batch(peer_id, msg, self.handle_forwarded,
                                           self.answer_forwarded_now)
            return
        if type(msg) is ForwardReplies:
            self._forwarding().on_replies(msg)
            if self.on_answered is not None:  # the relayed answers: written now
                self.on_answered()
            return
        if type(msg) is Forward:
            self._forwarding().serve(peer_id, msg, self.handle_forwarded,
                                     self.answer_forwarded_now)
            return
        if type(msg) is ForwardReply:
            self._forwarding().on_reply(msg)
            return
        if type(msg) is Features:
            self._forwarding().on_features(peer_id, msg)
            return
        if type(msg) is ForwardCancel:
            self._forwarding().on_cancel(peer_id, msg)
            return
        if type(msg) is SnapshotChunk:
            self.snapshots.on_chunk(peer_id, msg)
            return
        if type(msg) is SnapshotAck:
            self.snapshots.on_ack(peer_id, msg)
            return
        if type(msg) is Snapshot:
            # Nodes send snapshots as files (SnapshotChunk), never as one
            # message (the simulated network's way); its state would be
            # loaded into the store unchecked.
            log.warning("node %d: node %d sent a snapshot as a message; dropped",
                        self.config.node_id, peer_id)
            return
        if type(msg) is Push and msg.records:
            storage = self.storage
            if storage is not None and not self._reserve(
                    storage, sum(record_size_bound(r.entry) for r in msg.records)):
                # No room to store them: take the push as a heartbeat. We
                # answer for what we hold, so the master never counts these
                # records here, and we pull them again once there is room.
                msg = dataclasses.replace(msg, records=())
        self._step_now(msg)

    def _step_now(self, msg: Message) -> None:
        self.core.step(msg, now_ms())
        if self.commits_at_once and not self.core.is_master:
            self.commits_at_once = False  # now, not at the flush: requests may come first
        self._schedule_flush()

    def _send_to(self, peer_id: int, msg: Message) -> bool:
        return self.net is not None and self.net.send(peer_id, message_to_wire(msg))

    def _on_link(self, peer_id: int, up: bool) -> None:
        if up:
            self.core.link_up(peer_id)
            self._forwarding().link_up(peer_id)
            self._schedule_flush()
        else:
            self._forwarding().link_down(peer_id)
            self.snapshots.drop_stream(peer_id)

    # -- carrying out the core's Ready ----------------------------------------

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._running.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._failed:
            return
        self._check_at = self.core.log.last_trans_id + self._check_every
        durability = self.durability  # not None iff there is storage
        ready = self.core.take_ready(now_ms())
        if durability is not None:
            try:
                self._persist(durability, ready)
            except StorageError as exc:
                self._fail(exc)
                return
            self._reserved = 0  # what was reserved is written
        elif ready.snapshot is not None:
            self.snapshots.keep_installed(ready.snapshot[0], ready.snapshot[2])
        self.snapshots.discard_unwanted()
        # This runs at the end of a loop turn (call_soon): what it sends and
        # answers goes out now, not one more turn later (a turn that would
        # first handle whatever else the loop polled), which is a slave's
        # and a client's wait at every step of a quorum write.
        net = self.net
        if net is not None and ready.messages:
            self._send_all(net, ready.messages)
            net.flush_all()
        if ready.answers:
            for answer in ready.answers:
                answer()
            if self.forwarder is not None:  # relayed requests' answers
                self.forwarder.flush_now()
            if self.on_answered is not None:  # the node's clients
                self.on_answered()
        if self._fast_ok:
            self._update_fast_path()
        if self.core.is_master is not self._was_master:
            self._role_changed()
        for peer_id, trans_id, vote_id in ready.snapshot_sends:
            self.snapshots.stream(peer_id, trans_id, vote_id)
        self.snapshots.maybe_write()
        role = self.core.role
        if role is not self._last_role:
            self._last_role = role
            log.info("node %d: %s in vote %d (leader %s)", self.config.node_id, role.value,
                     self.core.vote_id, self.core.leader_id or "unknown")
        self._arm_timer()

    @staticmethod
    def _send_all(net: PeerNetwork, messages: list[tuple[int, Message]]) -> None:
        """Send a Ready's messages, each encoded once; and a turn's pushes
        of the same records (the same tuple) to several slaves, encoded
        once too when they are alike."""
        bodies: dict[object, bytes | None] = {}
        for peer_id, msg in messages:
            key: object = id(msg)
            if type(msg) is Push and msg.records:
                key = (id(msg.records), msg.vote_id, msg.prev_vote_id, msg.prev_trans_id,
                       msg.commit_id, msg.last_trans_id, msg.read_round)
            if key in bodies:
                body = bodies[key]
            else:
                body = bodies[key] = net.encode(message_to_wire(msg))
            if body is not None:
                net.send_encoded(peer_id, body)

    def _persist(self, durability: Durability, ready: Ready) -> None:
        """Vote, snapshot, truncation, records: on disk (durability's
        storage) before anything of this turn is sent or answered, then
        fsynced as `durability` decides (the policy and `ready.own_sync`).
        A StorageError propagates: the node must stop and recover from
        disk."""
        storage = durability.storage
        if ready.vote is not None:
            storage.save_vote(*ready.vote)
        if ready.snapshot is not None:
            trans_id, vote_id, state = ready.snapshot
            if isinstance(state, SnapshotLoader):  # received as a file: move it in place
                self.snapshots.install_into(storage, trans_id, state)
            else:
                storage.install_snapshot(trans_id, vote_id, state)
        if ready.truncate_after is not None:
            storage.truncate_after(ready.truncate_after)
        if ready.snapshot is not None or ready.truncate_after is not None:
            durability.bump_epoch()
        if ready.records:
            storage.append(ready.records)
        durability.after_write(ready.own_sync)

    # -- a full disk -------------------------------------------------------------

    def _reserve(self, storage: DiskStorage, nbytes: int) -> bool:
        """Room in the log (`storage`, ours) for `nbytes` more of records
        this turn (on top of what was reserved since the last flush, and
        DISK_MARGIN_BYTES for the records the core writes on its own)?
        Reserved if so; if the disk is out of space, the node refuses
        writes until DISK_RETRY_S finds room again."""
        if self._disk_full or self._failed:
            return False
        total = self._reserved + nbytes
        if storage.room < total + DISK_MARGIN_BYTES:
            try:
                ok = storage.make_room(total + DISK_MARGIN_BYTES)
            except StorageError as exc:
                self._fail(exc)
                return False
            if not ok:
                self._disk_full = True
                log.warning("node %d: disk full in %s: refusing writes (and not storing "
                            "replicated records) until space is freed; checking every %g s",
                            self.config.node_id, storage.directory, DISK_RETRY_S)
                self._disk_timer = self._running.call_later(DISK_RETRY_S, self._retry_disk,
                                                            storage)
                return False
        self._reserved = total
        return True

    def _update_fast_path(self) -> None:
        """Decide `commits_at_once` (see "Answering at once" in the module
        docstring): on while this node is master, its storage works, and
        the log's room takes more than one request's record (made here as
        the general path would, `_reserve`); off otherwise, and until the
        next flush once a write takes the general path (propose)."""
        storage = self.storage
        on = (self._fast_ok and self.core.is_master and not self.core.transferring
              and not self.core.confirming_role
              and not self._disk_full and not self._failed and not self._closing
              and not self.core.ready.records)
        if on and storage is not None and storage.room < self._reserved + self._fast_room:
            try:
                on = storage.make_room(self._reserved + self._fast_room)
            except StorageError as exc:
                self._fail(exc)
                on = False
        self.commits_at_once = on
        if storage is not None:
            self._fast_budget = storage.room - self._fast_room if on else -1

    def _retry_disk(self, storage: DiskStorage) -> None:
        self._disk_timer = None
        if self._failed or self._closing:
            return
        try:
            ok = storage.make_room(self._reserved + DISK_MARGIN_BYTES + DISK_FREE_BYTES)
        except StorageError as exc:
            self._fail(exc)
            return
        if ok:
            self._disk_full = False
            log.warning("node %d: disk space available again in %s: accepting writes",
                        self.config.node_id, storage.directory)
        else:
            self._disk_timer = self._running.call_later(DISK_RETRY_S, self._retry_disk, storage)

    def _fail(self, exc: BaseException) -> None:
        """Storage failed: stop serving writes and stop the node loudly
        (the Node logs it and stops at once)."""
        if self._failed:
            return
        self._failed = True
        self.commits_at_once = False
        if self.durability is not None:
            self.durability.halt()
        if self.on_fatal is not None:
            self.on_fatal(exc)
        else:
            log.critical("node %d: storage failed, stopping: %s", self.config.node_id, exc)

    def halt(self) -> None:
        """A fatal error elsewhere in the node: carry out nothing more of
        the core's (no persist, send or answer), and leave the storage as a
        crash would at close()."""
        self._failed = True
        self.commits_at_once = False
        if self.durability is not None:
            self.durability.halt()

    def _arm_timer(self) -> None:
        deadline = self.core.next_deadline()
        if self._timer is not None:
            if self._timer_at == deadline:
                return
            self._timer.cancel()
        now = now_ms()
        if self._timer is None or self._timer_due >= now:
            # (a deadline already past when armed, at start-up, is no stall)
            self._timer_due = max(deadline, now)
        # else: replacing an overdue timer that has not run (a flush after
        # a stall, before the timer): it stays due since then
        self._timer_at = deadline
        delay = max(0.0, (deadline - now) / 1000.0)
        self._timer = self._running.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        now = now_ms()
        late = now - self._timer_due
        if late >= STALL_MS:
            # After a pause of the process, libuv runs the timers that
            # expired before it reads the sockets: what the others sent
            # meanwhile is unread. (After a stall inside a callback, it
            # reads first; the core does not move what it heard since.)
            log.info("node %d: event loop stalled for about %d ms; timeouts moved on by as "
                     "much", self.config.node_id, late)
            self.core.stalled(late, now)
        self.core.tick(now)
        self._flush()

    def _role_changed(self) -> None:
        master = self._was_master = self.core.is_master
        if self.on_role_change is not None:
            self.on_role_change(master)
