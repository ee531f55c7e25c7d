"""A cluster node's snapshots as files: writing our own, streaming the
newest to a slave, receiving one from the master.

Writing: once `log_size` entries have been applied since the newest
snapshot (a node alone: see `snapshot_due`; a node without a data
directory only when a slave behind its log needs one, as its snapshots
serve nothing else: NativeCore.snapshot_wanted), the node forks; the child
rolls its copy of the store back to the last committed entry (a master
applies ahead of the commit), writes it as a snapshot file
(storage.disk.write_snapshot_file) and exits, while the node goes on
serving: the pause is the fork itself (a few ms per GB of state; monitor
shows it). The node then adopts the file (old segments and
snapshots go) and the core may compact its in-memory log up to it.

Streaming: a slave behind the master's log gets that file in
SNAPSHOT_CHUNK_BYTES pieces, a few in flight ahead of its acks, so that no
message is large and the master's loop never blocks on it.

Receiving: the slave writes the pieces to a temporary file, checks the
whole (crc), builds its store from it chunk by chunk, and hands the core a
Snapshot whose state is that store; the adapter then installs the file the
core took as the node's newest snapshot (`received` holds every file
received since the last flush: two streams, e.g. a deposed master's and the
new master's, can end in one loop turn, and the core takes at most one of
them). A node without a data directory keeps its snapshot files in a
private temporary directory.

Only the cluster adapter (qserver.engines.native.driver) uses this; it routes
SnapshotChunk and SnapshotAck messages here and carries out the core's
`snapshot_sends`.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import BinaryIO, TypedDict

from ...errors import InvariantError
from ...state.store import SnapshotLoader
from ...stats import PAUSE_BUCKETS_S, Histogram
from ...storage import (
    DiskStorage,
    decode_snapshot,
    private_tmp_dir,
    remove_private_tmp_dir,
    snapshot_file_name,
    store_wire_iter,
    unlink_quietly,
    write_snapshot_file,
)
from ..base import JsonObject
from ..messages import Message, Snapshot, SnapshotAck, SnapshotChunk
from .core import NativeCore

__all__ = ["SnapshotFiles", "SNAPSHOT_CHUNK_BYTES", "SNAPSHOT_WINDOW_CHUNKS",
           "LONE_SNAPSHOT_MAX_LOGS", "SNAPSHOT_WRITER_NICE", "snapshot_due"]

log = logging.getLogger(__name__)

# Snapshot streaming: pieces of this size (far below peers.MAX_FRAME_BYTES,
# large enough that per-message costs vanish), at most this many in flight
# ahead of the slave's acks (enough to fill a LAN link, little memory).
SNAPSHOT_CHUNK_BYTES = 1024 * 1024
SNAPSHOT_WINDOW_CHUNKS = 4
# A stream whose slave has acked nothing for this long is dropped; the
# slave's next pull starts it again from the beginning.
SNAPSHOT_STALL_S = 30.0
# After a failed snapshot (fork or write), wait this long before the next
# attempt rather than fork in a loop; the log keeps growing meanwhile.
SNAPSHOT_RETRY_S = 10.0

# Linux prctl(PR_SET_PDEATHSIG): the snapshot child dies with the node.
_PR_SET_PDEATHSIG = 1

# A node alone waits for at most this many log_size runs of entries between
# snapshots (see snapshot_due): it bounds the log that a restart replays
# (applied as it is read, not held: node._recover), at about 200,000 records
# a second: 2 s at the default log_size.
LONE_SNAPSHOT_MAX_LOGS = 4
# ...and writes one anyway, once log_size entries came since the newest,
# when it has applied nothing for this long: a restart after the writes
# stop then replays next to nothing (SnapshotFiles.maybe_write).
LONE_QUIET_S = 0.25

# The forked writer's niceness above the node's (an os.nice increment): on a
# busy machine it leaves the cores to the node and its clients, whose
# requests wait while it competes with them (as RocksDB lowers its
# compaction threads' priority); on an idle one it runs at full speed. A
# node alone of a million messages writes one in about 0.7 s of CPU, which
# on two shared cores landed in the middle of the next requests. One node
# with fsync=batch against one in memory, four runs each of
# `cluster_bench.py --parts single,storage --modes produce`, trees
# alternating: 0.64, 0.65, 0.65, 0.62 (TCP) and 0.57, 0.64, 0.67, 0.64
# (UDP) without, 0.66, 0.65, 0.68, 0.65 and 0.67, 0.70, 0.68, 0.65 with.
SNAPSHOT_WRITER_NICE = 10


def snapshot_due(applied_since: int, log_size: int, alone: bool, last_messages: int) -> bool:
    """Whether a node writes a snapshot now, `applied_since` entries after
    its newest one, which held `last_messages` messages (0: none written
    since the node started).

    A cluster node: once log_size entries were applied. Its snapshot bounds
    its in-memory log (compacted only up to the newest snapshot, which is
    what a slave behind the log is sent).

    A node alone keeps only a few records in memory whatever its snapshots;
    they bound its restart (the log replayed after the newest) and the log's
    disk space. Each one writes the whole store, so one every log_size
    entries costs a store of N messages N / log_size message writes per
    entry, in a child that takes a core for as long as it writes: with
    a million messages and the default log_size, ten per produce, and the
    next snapshot is due before the last is written. So alone, a node also
    waits until the entries since its newest snapshot are as many as the
    messages that snapshot held (at most one message written per entry),
    but never more than LONE_SNAPSHOT_MAX_LOGS * log_size entries (and
    once it is quiet: LONE_QUIET_S)."""
    if applied_since < log_size:
        return False
    return not alone or applied_since >= min(last_messages, LONE_SNAPSHOT_MAX_LOGS * log_size)


class _Outgoing:
    """A snapshot file being streamed to one slave."""

    __slots__ = ("file", "trans_id", "vote_id", "size", "sent", "acked", "acked_at")

    def __init__(self, file: BinaryIO, trans_id: int, vote_id: int, now_s: float) -> None:
        self.file = file
        self.trans_id = trans_id
        self.vote_id = vote_id
        self.size = os.fstat(file.fileno()).st_size
        self.sent = 0  # bytes sent (file offset)
        self.acked = 0  # bytes the slave has stored
        self.acked_at = now_s  # last progress (monotonic s)


class _Incoming:
    """A snapshot file being received from the master."""

    __slots__ = ("source", "trans_id", "vote_id", "path", "fd", "offset")

    def __init__(self, source: int, trans_id: int, vote_id: int, path: str) -> None:
        self.source = source
        self.trans_id = trans_id
        self.vote_id = vote_id
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.offset = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _child_setup() -> None:
    """In the forked snapshot writer: no collections (they would touch, and
    so copy, every page of the parent's heap), default signal handling (the
    parent's handlers write to its wakeup pipe), death with the parent, and
    a CPU priority below the node's (SNAPSHOT_WRITER_NICE)."""
    gc.disable()
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    try:
        os.nice(SNAPSHOT_WRITER_NICE)
    except OSError:
        pass  # (refused: the writer runs at the node's priority, as before)


class _Stats(TypedDict):
    """What info() shows of the snapshots taken, sent and received."""

    taken: int
    failed: int
    last_pause_ms: float | None  # the fork's (None: no snapshot yet)
    max_pause_ms: float | None
    last_write_ms: float | None  # fork to adopted file
    sent: int
    installed: int


class SnapshotFiles:
    """One node's snapshot work (see the module docstring)."""

    def __init__(self, *, core: NativeCore, storage: DiskStorage | None, node_id: int,
                 log_size: int, send: Callable[[int, Message], bool],
                 step: Callable[[Message], None], schedule_flush: Callable[[], None]) -> None:
        """`send(peer_id, message)`: False if the link is down. `step(msg)`
        hands a message to the core (and schedules the adapter's flush)."""
        self.core = core
        self.storage = storage
        self.node_id = node_id
        # entries applied since the newest snapshot that make us write one
        # (alone: at least; see snapshot_due)
        self.snapshot_every = max(1, log_size)
        # messages the store held when the newest snapshot of this run was
        # forked (what it wrote, near enough; snapshot_due)
        self._last_messages = 0
        # A node alone's quiet test (LONE_QUIET_S): the applied_id last seen
        # by maybe_write, and since when (monotonic s) it has stood still.
        self._quiet_id = -1
        self._quiet_at = 0.0
        self._send = send
        self._step = step
        self._schedule_flush = schedule_flush
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start(); see _running
        self._own_dir = storage is None
        self.dir = private_tmp_dir("snap") if storage is None else storage.directory
        self._child: tuple[int, int, int, int, float] | None = None  # pid, fd, t, v, start
        self._retry_at = 0.0  # no new writer before this (monotonic s) after a failure
        self._outgoing: dict[int, _Outgoing] = {}  # streams to slaves, by node id
        self._incoming: _Incoming | None = None  # the stream from the master
        # Files received since the last flush, each with the loader (the
        # store built from it) that was stepped into the core as the
        # Snapshot's state: the flush installs the one the core took.
        self.received: list[tuple[SnapshotLoader, str, int]] = []
        self.stats: _Stats = {"taken": 0, "failed": 0, "last_pause_ms": None,
                              "max_pause_ms": None, "last_write_ms": None, "sent": 0,
                              "installed": 0}
        # Every fork's pause of the event loop (metrics; stats has the last and max).
        self.pause_seconds = Histogram(PAUSE_BUCKETS_S)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def _running(self) -> asyncio.AbstractEventLoop:
        """The event loop, once start() has run."""
        if self._loop is None:
            raise InvariantError("SnapshotFiles used before start()")
        return self._loop

    def info(self) -> JsonObject:
        """What monitor shows about snapshots (pauses in ms, as measured)."""
        info: JsonObject = dict(self.stats)
        info["snapshot_id"] = self.core.snapshot_id
        info["writing"] = self._child is not None
        info["streaming_to"] = sorted(self._outgoing)
        return info

    def _take_received(self, trans_id: int, state: object) -> str:
        """The path of the received file whose store the core took as
        `state` (InvariantError if there is none, or it is not at trans_id)."""
        for i, (loader, path, received_id) in enumerate(self.received):
            if loader is state:
                del self.received[i]
                if received_id != trans_id:
                    raise InvariantError(f"installing snapshot {trans_id}, its file holds "
                                         f"{received_id}")
                return path
        raise InvariantError(f"installing snapshot {trans_id}: no received file holds it")

    def install_into(self, storage: DiskStorage, trans_id: int, state: object) -> None:
        """The core took a snapshot we received (its state is `state`): move
        that file into place as the storage's newest (StorageError if that
        fails)."""
        storage.install_snapshot_file(self._take_received(trans_id, state), trans_id)
        self.stats["installed"] += 1

    def discard_unwanted(self) -> None:
        """Received snapshots the core did not take (it had moved on, or
        took another one of the same turn)."""
        received, self.received = self.received, []
        for _loader, path, _trans_id in received:
            unlink_quietly(path)

    # -- snapshots: writing our own --------------------------------------------

    def maybe_write(self) -> None:
        """Start a snapshot writer once log_size entries were applied since
        the newest snapshot (a node alone: see snapshot_due; one writer at
        a time); without a data directory, once a slave needs one
        (NativeCore.snapshot_wanted)."""
        if self._child is not None or self._loop is None:  # writing, or not started
            return
        core = self.core
        if core.snapshots_on_demand:  # (a node without a data directory)
            if core.snapshot_wanted and core.is_master and time.monotonic() >= self._retry_at:
                self._fork_snapshot(*core.snapshot_point())
            return
        since = core.applied_since_snapshot()
        if since < self.snapshot_every:  # (the common case, every turn: no call)
            return
        if not snapshot_due(since, self.snapshot_every, not core.peers, self._last_messages):
            # alone, not due yet: unless nothing was applied for LONE_QUIET_S
            # (the master's heartbeat flushes every 100 ms meanwhile)
            now = time.monotonic()
            if core.applied_id != self._quiet_id:
                self._quiet_id, self._quiet_at = core.applied_id, now
                return
            if now - self._quiet_at < LONE_QUIET_S:
                return
        trans_id, vote_id = core.snapshot_point()
        if time.monotonic() < self._retry_at:
            return
        self._fork_snapshot(trans_id, vote_id)

    def _fork_snapshot(self, trans_id: int, vote_id: int) -> None:
        try:
            r, w = os.pipe()
        except OSError as exc:
            self._snapshot_failed(trans_id, f"pipe: {exc}")
            return
        started = time.perf_counter()
        self._last_messages = self.core.store.message_count()
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(r)
            os.close(w)
            self._snapshot_failed(trans_id, f"fork: {exc}")
            return
        if pid == 0:  # the child: write the state as it is now, then exit
            status = 1
            try:
                os.close(r)
                _child_setup()
                self.core.prepare_snapshot(trans_id)
                write_snapshot_file(self.dir, trans_id, vote_id,
                                    store_wire_iter(self.core.store))
                status = 0
            except BaseException:
                traceback.print_exc(file=sys.stderr)
            finally:
                try:
                    os.write(w, bytes([status]))
                finally:
                    os._exit(status)
        pause_ms = (time.perf_counter() - started) * 1000
        self.pause_seconds.observe_ns(round(pause_ms * 1_000_000))
        os.close(w)
        stats = self.stats
        stats["last_pause_ms"] = round(pause_ms, 2)
        stats["max_pause_ms"] = round(max(pause_ms, stats["max_pause_ms"] or 0.0), 2)
        self._child = child = (pid, r, trans_id, vote_id, started)
        self._running.add_reader(r, self._snapshot_written, child)

    def _snapshot_written(self, child: tuple[int, int, int, int, float]) -> None:
        pid, r, trans_id, vote_id, started = child
        self._child = None
        self._running.remove_reader(r)
        try:
            status = os.read(r, 1)
        finally:
            os.close(r)
        self._reap(pid)
        if status != b"\0":
            self._snapshot_failed(trans_id, "the writer failed (see its traceback above)")
            return
        if self.storage is not None:
            if not self.storage.adopt_snapshot(trans_id):
                return  # a newer snapshot was installed meanwhile
        elif not self._keep_only(trans_id):
            return
        self.core.snapshot_taken(trans_id, vote_id)
        stats = self.stats
        stats["taken"] += 1
        stats["last_write_ms"] = round((time.perf_counter() - started) * 1000, 1)
        log.info("node %d: snapshot at trans_id %d written in %.0f ms (fork pause %.1f ms)",
                 self.node_id, trans_id, stats["last_write_ms"], stats["last_pause_ms"])
        self._schedule_flush()  # the core may compact now

    def _reap(self, pid: int) -> None:
        """Collect the exited writer without blocking: tearing down a large
        child's address space can take a while after it has reported."""
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if not done:
            self._running.call_later(0.05, self._reap, pid)

    def _snapshot_failed(self, trans_id: int, why: str) -> None:
        self.stats["failed"] += 1
        self._retry_at = time.monotonic() + SNAPSHOT_RETRY_S
        log.error("node %d: snapshot at trans_id %d failed: %s; retrying in %.0f s",
                  self.node_id, trans_id, why, SNAPSHOT_RETRY_S)

    def _keep_only(self, trans_id: int) -> bool:
        """Without storage: make the snapshot file at trans_id our newest and
        remove the others, unless a newer one was installed meanwhile (then
        this one goes). Returns whether it was kept."""
        keep = snapshot_file_name(trans_id)
        if trans_id < self.core.snapshot_id:
            unlink_quietly(os.path.join(self.dir, keep))
            return False
        for name in os.listdir(self.dir):
            if name.startswith("snapshot-") and name != keep:
                unlink_quietly(os.path.join(self.dir, name))
        return True

    def keep_installed(self, trans_id: int, state: object) -> None:
        """Without storage: a received snapshot the core took (its state is
        `state`) becomes our newest file."""
        path = self._take_received(trans_id, state)
        os.replace(path, os.path.join(self.dir, snapshot_file_name(trans_id)))
        self._keep_only(trans_id)
        self.stats["installed"] += 1

    def stop(self) -> None:
        """Kill a running writer, drop every stream, remove a private
        directory."""
        if self._child is not None:
            pid, r, *_ = self._child
            self._child = None
            self._running.remove_reader(r)
            os.close(r)
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for peer_id in list(self._outgoing):
            self.drop_stream(peer_id)
        if self._incoming is not None:
            self._incoming.close()
            unlink_quietly(self._incoming.path)
            self._incoming = None
        if self._own_dir:
            remove_private_tmp_dir(self.dir)

    # -- snapshots: streaming to a slave ---------------------------------------

    def stream(self, peer_id: int, trans_id: int, vote_id: int) -> None:
        if trans_id < self.core.snapshot_id:
            # A newer file was adopted since the core asked (a writer ended
            # in this turn) and the older one is gone: send the newer (the
            # slave installs it and pulls, or skips, what follows).
            trans_id, vote_id = self.core.snapshot_id, self.core.snapshot_vote
        current = self._outgoing.get(peer_id)
        if current is not None:
            if (current.trans_id == trans_id
                    and time.monotonic() - current.acked_at < SNAPSHOT_STALL_S):
                return  # under way
            self.drop_stream(peer_id)
        path = os.path.join(self.dir, snapshot_file_name(trans_id))
        try:
            file = open(path, "rb")  # stays readable if a newer snapshot removes it
        except OSError as exc:
            log.error("node %d: cannot send snapshot %s to node %d: %s", self.node_id,
                      path, peer_id, exc)
            return
        self._outgoing[peer_id] = _Outgoing(file, trans_id, vote_id, time.monotonic())
        self.stats["sent"] += 1
        log.info("node %d: streaming snapshot at trans_id %d to node %d", self.node_id,
                 trans_id, peer_id)
        self._pump(peer_id)

    def _pump(self, peer_id: int) -> None:
        out = self._outgoing[peer_id]
        window = SNAPSHOT_WINDOW_CHUNKS * SNAPSHOT_CHUNK_BYTES
        while out.sent < out.size and out.sent - out.acked < window:
            data = out.file.read(SNAPSHOT_CHUNK_BYTES)
            if not data:
                break
            msg = SnapshotChunk(vote_id=self.core.vote_id, node_id=self.node_id,
                                trans_id=out.trans_id, log_vote_id=out.vote_id, offset=out.sent,
                                data=data, last=out.sent + len(data) >= out.size)
            if not self._send(peer_id, msg):
                self.drop_stream(peer_id)
                return
            out.sent += len(data)

    def on_ack(self, peer_id: int, msg: SnapshotAck) -> None:
        out = self._outgoing.get(peer_id)
        if out is None or out.trans_id != msg.trans_id or msg.offset <= out.acked:
            return
        out.acked = min(msg.offset, out.sent)
        out.acked_at = time.monotonic()
        if out.acked >= out.size:
            self.drop_stream(peer_id)
        else:
            self._pump(peer_id)

    def drop_stream(self, peer_id: int) -> None:
        out = self._outgoing.pop(peer_id, None)
        if out is not None:
            out.file.close()

    # -- snapshots: receiving from the master ----------------------------------

    def on_chunk(self, peer_id: int, msg: SnapshotChunk) -> None:
        inc = self._incoming
        if msg.offset == 0:
            if inc is not None:
                inc.close()
            # Named by the sender too: two masters may each stream their
            # snapshot at the same trans_id.
            path = os.path.join(self.dir, f"incoming-{msg.trans_id:020d}-{peer_id}.snap.tmp")
            try:
                inc = self._incoming = _Incoming(peer_id, msg.trans_id, msg.log_vote_id, path)
            except OSError as exc:
                log.error("node %d: cannot receive snapshot into %s: %s",
                          self.node_id, path, exc)
                self._incoming = None
                return
        elif (inc is None or inc.source != peer_id or inc.trans_id != msg.trans_id
              or inc.offset != msg.offset):
            return  # out of step: the master's stream stalls and restarts
        try:
            view = memoryview(msg.data)
            while view:
                view = view[os.write(inc.fd, view):]
            if msg.last:
                os.fsync(inc.fd)
        except OSError as exc:
            log.error("node %d: writing %s failed: %s", self.node_id, inc.path, exc)
            inc.close()
            unlink_quietly(inc.path)
            self._incoming = None
            return
        inc.offset += len(msg.data)
        self._send(peer_id, SnapshotAck(vote_id=self.core.vote_id, node_id=self.node_id,
                                        trans_id=inc.trans_id, offset=inc.offset))
        if msg.last:
            inc.close()
            self._incoming = None
            self._install_received(msg, inc)

    def _install_received(self, msg: SnapshotChunk, inc: _Incoming) -> None:
        loader = self.core.store.snapshot_loader()
        try:
            with open(inc.path, "rb") as f:
                trans_id, vote_id, _ = decode_snapshot(iter(lambda: f.read(1 << 20), b""), loader)
            if (trans_id, vote_id) != (inc.trans_id, inc.vote_id):
                raise ValueError(f"holds ({trans_id}, {vote_id}), announced "
                                 f"({inc.trans_id}, {inc.vote_id})")
        except (OSError, ValueError) as exc:
            log.error("node %d: received snapshot %s is unusable: %s", self.node_id,
                      inc.path, exc)
            unlink_quietly(inc.path)
            return
        log.info("node %d: received snapshot at trans_id %d (%d bytes) from node %d",
                 self.node_id, trans_id, inc.offset, inc.source)
        self.received.append((loader, inc.path, trans_id))
        self._step(Snapshot(vote_id=msg.vote_id, node_id=msg.node_id, trans_id=trans_id,
                            log_vote_id=vote_id, state=loader))
