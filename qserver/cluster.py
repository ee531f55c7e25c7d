"""The asyncio adapter of the native engine: one NativeCore, its peer links,
its storage, its timer, and request forwarding.

Mechanical by design: a peer message is decoded and stepped into the core; a
proposal is handed to the core; once per event-loop turn the core's `Ready`
is carried out in order (persist vote, persist log, send, answer); one timer
is armed for the core's next deadline. Nothing else mutates the core.

Storage (when configured): the vote is saved (always fsynced) before any
message goes out; log changes are written before anything is sent or
answered; with fsync=always they are also fsynced then, once per turn (group
commit); with fsync=batch a timer fsyncs every BATCH_SYNC_MS; with off, the
OS decides. A node configured alone but with storage runs this engine too,
with no peers: it elects itself at once and commits on its own.

Snapshots: once `log_size` entries have been applied since the newest
snapshot, the node forks; the child rolls its copy of the store back to
the last committed entry (a master applies ahead of the commit), writes it
as a snapshot file (storage.disk.write_snapshot_file) and exits, while the
node goes on serving: the pause is the fork itself (a few ms per GB of
state; monitor shows it). The node then adopts the file (old segments and
snapshots go) and the core may compact its in-memory log up to it. A slave
behind the master's log gets that file streamed in SNAPSHOT_CHUNK_BYTES
pieces, a few in flight ahead of its acks, so that no message is large and
the master's loop never blocks on it; the slave writes the pieces to a
temporary file, checks the whole (crc), builds its store from it chunk by
chunk, and installs the file as its own newest snapshot. A node without a
data directory keeps its snapshot files in a private temporary directory.

fsync off the event loop: with fsync=always a master writes its records,
sends them to the slaves at once and fsyncs in a worker thread meanwhile,
counting itself towards a majority only up to what that fsync covered
(NativeCore.deferred_sync; Raft thesis 10.2.1): its own fsync overlaps the
slaves', and its loop goes on serving. A slave still fsyncs before it
answers a push, since its answer counts. With fsync=batch the timed fsync
runs in the worker thread too. A failed fsync stops the node (`on_fatal`).

Forwarding: a slave relays a client request to the master as a `Forward`
message over the internal link and relays the `ForwardReply` back; if the
master is unknown or unreachable the client hears "no leader" at once, and
if the master does not answer within FORWARD_TIMEOUT_S, "forward timeout".
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from .config import Config
from .entries import Entry
from .errors import InvariantError
from .log import Log
from .peers import PeerNetwork
from .replication.base import Done, EngineStatus, LeaderInfo
from .replication.messages import (
    Forward,
    ForwardReply,
    Snapshot,
    SnapshotAck,
    SnapshotChunk,
    message_from_peer,
    message_to_wire,
)
from .replication.native import NativeCore, Timing
from .storage import (
    DiskStorage,
    KernelSync,
    StorageError,
    decode_snapshot,
    snapshot_file_name,
    store_wire_iter,
    unlink_quietly,
    write_snapshot_file,
)
from .store import SnapshotLoader, Store

__all__ = ["ClusterEngine", "FORWARD_TIMEOUT_S", "DEFAULT_TIMING"]

log = logging.getLogger("qserver.cluster")

# A forwarded request that the master has not answered in this time is
# answered "forward timeout" (the write may or may not have happened).
FORWARD_TIMEOUT_S = 10.0

# fsync=batch: how often written-but-unsynced log records are fsynced.
BATCH_SYNC_MS = 5

# Heartbeats every 100 ms; a master silent for 600-1200 ms is replaced, so a
# failover completes in well under 2 s, while a briefly busy event loop on a
# loaded machine does not trigger elections.
DEFAULT_TIMING = Timing(heartbeat_ms=100, election_ms=600, pull_retry_ms=300)


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

# At close, how long to wait for a sync in flight before leaving the log as a
# crash would (a disk that no longer answers).
CLOSE_SYNC_WAIT_S = 30.0

# Linux prctl(PR_SET_PDEATHSIG): the snapshot child dies with the node.
_PR_SET_PDEATHSIG = 1


def now_ms() -> int:
    return int(time.time() * 1000)


class _Outgoing:
    """A snapshot file being streamed to one slave."""

    __slots__ = ("file", "trans_id", "vote_id", "size", "sent", "acked", "acked_at")

    def __init__(self, file, trans_id: int, vote_id: int, now_s: float) -> None:
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


def _fsync_and_close(fd: int) -> None:
    """In the fsync thread: make a duplicated segment descriptor durable
    (fdatasync: the segment's file is allocated ahead, see storage.disk)."""
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _child_setup() -> None:
    """In the forked snapshot writer: no collections (they would touch, and
    so copy, every page of the parent's heap), default signal handling (the
    parent's handlers write to its wakeup pipe), death with the parent."""
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


class ClusterEngine:
    """The native engine on real sockets; the service's `Engine`."""

    def __init__(self, *, config: Config, store: Store, log_: Log,
                 storage: DiskStorage | None = None, vote: tuple[int, int] = (0, 0),
                 timing: Timing = DEFAULT_TIMING) -> None:
        self.config = config
        self.storage = storage
        peers = [p for p in config.peers if p.node_id != config.node_id]
        self.core = NativeCore(
            node_id=config.node_id, peer_ids=[p.node_id for p in peers], store=store,
            log=log_, me=LeaderInfo(node_id=config.node_id, host=config.host, port=config.port),
            rng=random.Random(), now_ms=now_ms(), timing=timing,
            async_mode=config.mode.value == "async", sync_rate=config.sync_rate,
            log_size=config.log_size, vote_id=vote[0], voted_for=vote[1],
            external_snapshots=True,
            # async mode answers a write once it is on our disk: no deferral
            deferred_sync=(storage is not None and config.fsync.value == "always"
                           and config.mode.value != "async"))
        self.net: PeerNetwork | None = None
        if peers:
            me = next(p for p in config.peers if p.node_id == config.node_id)
            self.net = PeerNetwork(
                node_id=config.node_id, listen=(me.host, me.port),
                peers={p.node_id: (p.host, p.port) for p in peers},
                secret=config.secret, on_message=self._on_message, on_link=self._on_link)
        self._batch_timer: asyncio.TimerHandle | None = None
        self.handle_forwarded: Callable[[dict, int, Callable[[dict], None]], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._flush_scheduled = False
        self._forwards: dict[int, tuple[Callable[[dict], None], asyncio.TimerHandle, int]] = {}
        self._next_forward = 1
        self._last_role = None
        # Called with the error when storage fails at run time (the node
        # must stop; it recovers from disk on restart). Set by the Node.
        self.on_fatal: Callable[[BaseException], None] | None = None
        # fsync off the event loop, one at a time: handed to the kernel
        # (KernelSync) or else to a worker thread. `_sync_again` asks for
        # another when it ends; truncations and installs bump the epoch, so
        # that a sync begun before one does not vouch for records after it.
        self._kernel_sync: KernelSync | None = None
        self._kernel_syncs: dict[int, tuple[int, int, int, int]] = {}  # token: fd, covered, mark, epoch
        self._next_sync_token = 1
        self._sync_pool: ThreadPoolExecutor | None = None
        self._sync_busy = False
        self._sync_again = False
        self._sync_epoch = 0
        self._closing = False  # close() began: no new syncs, it waits for the one in flight
        self._failed = False
        # Snapshots: where their files live, the running writer child, streams.
        self._own_snap_dir = storage is None
        self._snap_dir = (tempfile.mkdtemp(prefix="qserver-snap-") if storage is None
                          else storage.directory)
        self._snap_child: tuple[int, int, int, int, float] | None = None  # pid, fd, t, v, start
        self._snap_retry_at = 0.0
        self._outgoing: dict[int, _Outgoing] = {}
        self._incoming: _Incoming | None = None
        self._installing: tuple[str, int] | None = None  # a received file, until installed
        self.snapshot_stats = {"taken": 0, "failed": 0,
                               "last_pause_ms": None, "max_pause_ms": None, "last_write_ms": None,
                               "sent": 0, "installed": 0}

    # -- Engine interface ----------------------------------------------------

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
        return self.core.status()

    def slaves(self) -> list[dict]:
        connected = self.net.connected_ids() if self.net else set()
        out = self.core.slaves()
        for s in out:
            s["connected"] = s["node_id"] in connected
        return out

    def snapshot_info(self) -> dict:
        """What monitor shows about snapshots (pauses in ms, as measured)."""
        info = dict(self.snapshot_stats)
        info["snapshot_id"] = self.core.snapshot_id
        info["writing"] = self._snap_child is not None
        info["streaming_to"] = sorted(self._outgoing)
        return info

    def storage_info(self) -> dict | None:
        """What monitor shows about the log on disk (None without storage)."""
        storage = self.storage
        if storage is None:
            return None
        return {"fsync": self.config.fsync.value, "records_written": storage.records_written,
                "fsyncs": storage.syncs}

    def propose(self, entry: Entry, done: Done) -> None:
        self.core.propose(entry, done)
        self._schedule_flush()

    def forward(self, request: dict, respond: Callable[[dict], None]) -> bool:
        """Relay a client request to the master; False if none is reachable."""
        leader_id = self.core.leader_id
        if (not leader_id or leader_id == self.config.node_id or self.net is None
                or not self.net.connected(leader_id)):
            return False
        request_id = self._next_forward
        self._next_forward += 1
        msg = Forward(vote_id=self.core.vote_id, node_id=self.config.node_id,
                      request_id=request_id, request=request)
        if not self.net.send(leader_id, message_to_wire(msg)):
            return False
        timer = self._loop.call_later(FORWARD_TIMEOUT_S, self._forward_timeout, request_id)
        self._forwards[request_id] = (respond, timer, leader_id)
        return True

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.storage is not None and self.config.fsync.value != "off":
            self._kernel_sync = KernelSync.create()
            if self._kernel_sync is not None:
                self._loop.add_reader(self._kernel_sync.fileno(), self._kernel_sync_done)
        if self.net is not None:
            await self.net.start()
            log.info("node %d: cluster of %d, internal port %s, mode %s", self.config.node_id,
                     len(self.config.peers), self.net.address[1], self.config.mode.value)
        self._arm_timer()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._batch_timer is not None:
            self._batch_timer.cancel()
        for request_id in list(self._forwards):
            self._fail_forward(request_id, "node shutting down")
        self._stop_snapshot_work()
        if self.net is not None:
            await self.net.close()
        # A sync in flight is waited for and its outcome taken as usual: a
        # failed one must not be followed by storage.close()'s own fsync,
        # which could report success for pages the kernel dropped.
        self._closing = True
        deadline = self._loop.time() + CLOSE_SYNC_WAIT_S
        while self._sync_busy and not self._failed and self._loop.time() < deadline:
            await asyncio.sleep(0.001)
        if self._sync_busy and not self._failed:
            log.error("node %d: a sync did not finish within %.0f s; leaving the log as a "
                      "crash would", self.config.node_id, CLOSE_SYNC_WAIT_S)
            self._failed = True
        if self._sync_pool is not None:
            self._sync_pool.shutdown(wait=False)
        if self._kernel_sync is not None:
            self._loop.remove_reader(self._kernel_sync.fileno())
            self._kernel_sync.close()  # waits for anything still in flight
            for fd, *_ in self._kernel_syncs.values():
                os.close(fd)
            self._kernel_syncs.clear()
        if self.storage is not None and not self._failed:
            self.storage.close()
        elif self.storage is not None:
            self.storage.abandon()
        if self._own_snap_dir:
            shutil.rmtree(self._snap_dir, ignore_errors=True)

    # -- events ----------------------------------------------------------------

    def _on_message(self, peer_id: int, obj: object) -> None:
        msg = message_from_peer(peer_id, obj)
        if type(msg) is str:
            log.warning("node %d: %s", self.config.node_id, msg)
            return
        t = type(msg)
        if t is Forward:
            self._serve_forward(peer_id, msg)
            return
        if t is ForwardReply:
            pending = self._forwards.pop(msg.request_id, None)
            if pending is not None:
                pending[1].cancel()
                pending[0](msg.response)
            return
        if t is SnapshotChunk:
            self._receive_chunk(peer_id, msg)
            return
        if t is SnapshotAck:
            self._snapshot_acked(peer_id, msg)
            return
        self.core.step(msg, now_ms())
        self._schedule_flush()

    def _on_link(self, peer_id: int, up: bool) -> None:
        if up:
            self.core.link_up(peer_id)
            self._schedule_flush()
        else:
            for request_id, (_, _, target) in list(self._forwards.items()):
                if target == peer_id:
                    self._fail_forward(request_id, "master unreachable; outcome unknown")
            self._drop_stream(peer_id)

    def _serve_forward(self, peer_id: int, msg: Forward) -> None:
        def respond(response: dict) -> None:
            reply = ForwardReply(vote_id=self.core.vote_id, node_id=self.config.node_id,
                                 request_id=msg.request_id, response=response)
            self.net.send(peer_id, message_to_wire(reply))

        if self.handle_forwarded is None:
            respond({"code": -1, "reason": "no leader"})
            return
        self.handle_forwarded(msg.request, now_ms(), respond)

    def _forward_timeout(self, request_id: int) -> None:
        self._fail_forward(request_id, "forward timeout; outcome unknown")

    def _fail_forward(self, request_id: int, reason: str) -> None:
        pending = self._forwards.pop(request_id, None)
        if pending is not None:
            pending[1].cancel()
            pending[0]({"code": -1, "reason": reason})

    # -- carrying out the core's Ready ----------------------------------------

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._failed:
            return
        ready = self.core.take_ready()
        storage = self.storage
        if storage is not None:
            try:
                self._persist(storage, ready)
            except StorageError as exc:
                self._fail(exc)
                return
        elif ready.snapshot is not None:
            self._keep_installed(ready.snapshot[0])
        if self._installing is not None:  # received, but the core did not want it
            unlink_quietly(self._installing[0])
            self._installing = None
        if self.net is not None and ready.messages:
            self._send_all(ready.messages)
        for answer in ready.answers:
            answer()
        for peer_id, trans_id, vote_id in ready.snapshot_sends:
            self._start_stream(peer_id, trans_id, vote_id)
        self._maybe_snapshot()
        role = self.core.role
        if role is not self._last_role:
            self._last_role = role
            log.info("node %d: %s in vote %d (leader %s)", self.config.node_id, role.value,
                     self.core.vote_id, self.core.leader_id or "unknown")
        self._arm_timer()

    def _send_all(self, messages: list) -> None:
        encoded: dict[int, object] = {}
        send = self.net.send
        for peer_id, msg in messages:
            wire = encoded.get(id(msg))
            if wire is None:
                wire = encoded[id(msg)] = message_to_wire(msg)
            send(peer_id, wire)

    def _persist(self, storage: DiskStorage, ready) -> None:
        """Vote, snapshot, truncation, records: on disk before anything of
        this turn is sent or answered. A StorageError propagates: the node
        must stop and recover from disk."""
        if ready.vote is not None:
            storage.save_vote(*ready.vote)
        if ready.snapshot is not None:
            trans_id, vote_id, state = ready.snapshot
            if isinstance(state, SnapshotLoader):  # received as a file: move it in place
                path, expected = self._installing
                if expected != trans_id:
                    raise InvariantError(f"installing snapshot {trans_id}, received {expected}")
                storage.install_snapshot_file(path, trans_id)
                self._installing = None
                self.snapshot_stats["installed"] += 1
            else:
                storage.install_snapshot(trans_id, vote_id, state)
        if ready.truncate_after is not None:
            storage.truncate_after(ready.truncate_after)
        if ready.snapshot is not None or ready.truncate_after is not None:
            self._sync_epoch += 1
        if ready.records:
            storage.append(ready.records)
        if storage.dirty:
            policy = self.config.fsync.value
            if policy == "always":
                if self.core.deferred_sync and self.core.is_master:
                    # Our records went out already; we count them once synced.
                    if self.core.own_sync_urgent(now_ms()):
                        self._start_sync()
                    elif self._batch_timer is None:  # the slaves make the majority
                        self._batch_timer = self._loop.call_later(
                            BATCH_SYNC_MS / 1000, self._batch_sync)
                else:
                    # A slave's answers vouch for its records: sync before
                    # they go. (Deferring this too, holding the answers
                    # until a threaded fsync ends, cost the cluster 40% more
                    # CPU per write in bench/durability_bench.py: slower.)
                    storage.sync()
                    self.core.synced_to(storage.next_trans_id - 1)
            elif policy == "batch" and self._batch_timer is None:
                self._batch_timer = self._loop.call_later(BATCH_SYNC_MS / 1000, self._batch_sync)

    def _batch_sync(self) -> None:
        self._batch_timer = None
        if self.storage is not None and self.storage.dirty and not self._failed:
            try:
                self._start_sync()
            except StorageError as exc:
                self._fail(exc)

    def _start_sync(self) -> None:
        """fsync what is written so far off the event loop (one at a time)."""
        if self._closing:
            return  # storage.close() syncs what is left
        if self._sync_busy:
            self._sync_again = True
            return
        handle = self.storage.begin_sync()
        if handle is None:
            self.core.synced_to(self.storage.next_trans_id - 1)
            return
        fd, covered, mark = handle
        self._sync_busy = True
        if self._kernel_sync is not None:
            token = self._next_sync_token
            self._next_sync_token += 1
            try:
                self._kernel_sync.submit(fd, token)
            except OSError as exc:  # e.g. EINVAL: this file system will not; use the thread
                log.info("node %d: kernel fsync refused (%s); fsync runs in a thread",
                         self.config.node_id, exc.strerror or exc)
                self._loop.remove_reader(self._kernel_sync.fileno())
                self._kernel_sync.close()
                self._kernel_sync = None
            else:
                self._kernel_syncs[token] = (fd, covered, mark, self._sync_epoch)
                return
        if self._sync_pool is None:
            self._sync_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qserver-fsync")
        future = self._loop.run_in_executor(self._sync_pool, _fsync_and_close, fd)
        future.add_done_callback(partial(self._thread_sync_done, covered, mark, self._sync_epoch))

    def _kernel_sync_done(self) -> None:
        try:
            finished = self._kernel_sync.reap()
        except OSError as exc:
            self._fail(StorageError(self.storage.directory, None, f"fsync failed: {exc}"))
            return
        for token, res in finished:
            fd, covered, mark, epoch = self._kernel_syncs.pop(token)
            os.close(fd)
            error = OSError(-res, os.strerror(-res)) if res < 0 else None
            self._sync_finished(covered, mark, epoch, error)

    def _thread_sync_done(self, covered: int, mark: int, epoch: int,
                          future: asyncio.Future) -> None:
        error = future.exception()
        if error is not None and not isinstance(error, OSError):
            self._sync_busy = False
            self._fail(error)  # our bug, but the sync's outcome is unknown
            return
        self._sync_finished(covered, mark, epoch, error)

    def _sync_finished(self, covered: int, mark: int, epoch: int, error: OSError | None) -> None:
        self._sync_busy = False
        if self._failed or self.storage is None:
            return
        try:
            self.storage.end_sync(mark, error)
            if self._closing:
                return
            if epoch == self._sync_epoch:
                self.core.synced_to(covered)
            if self._sync_again or (self.storage.dirty and self.core.own_sync_urgent(now_ms())):
                self._sync_again = False
                self._start_sync()
            elif self.storage.dirty and self._batch_timer is None:
                self._batch_timer = self._loop.call_later(BATCH_SYNC_MS / 1000, self._batch_sync)
        except StorageError as exc:
            self._fail(exc)
            return
        self._schedule_flush()

    def _fail(self, exc: BaseException) -> None:
        """Storage failed: stop serving writes and stop the node loudly."""
        if self._failed:
            return
        self._failed = True
        log.critical("node %d: storage failed, stopping: %s", self.config.node_id, exc)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _arm_timer(self) -> None:
        deadline = self.core.next_deadline()
        if self._timer is not None:
            if self._timer_at == deadline:
                return
            self._timer.cancel()
        self._timer_at = deadline
        delay = max(0.0, (deadline - now_ms()) / 1000.0)
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.core.tick(now_ms())
        self._flush()

    # -- snapshots: writing our own --------------------------------------------

    def _maybe_snapshot(self) -> None:
        """Start a snapshot writer once log_size entries were applied since
        the newest snapshot (one writer at a time)."""
        if self._snap_child is not None or self._loop is None:
            return
        trans_id, vote_id = self.core.snapshot_point()
        if trans_id - self.core.snapshot_id < max(1, self.config.log_size):
            return
        if time.monotonic() < self._snap_retry_at:
            return
        self._fork_snapshot(trans_id, vote_id)

    def _fork_snapshot(self, trans_id: int, vote_id: int) -> None:
        try:
            r, w = os.pipe()
        except OSError as exc:
            self._snapshot_failed(trans_id, f"pipe: {exc}")
            return
        started = time.perf_counter()
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
                write_snapshot_file(self._snap_dir, trans_id, vote_id,
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
        os.close(w)
        stats = self.snapshot_stats
        stats["last_pause_ms"] = round(pause_ms, 2)
        stats["max_pause_ms"] = round(max(pause_ms, stats["max_pause_ms"] or 0.0), 2)
        self._snap_child = (pid, r, trans_id, vote_id, started)
        self._loop.add_reader(r, self._snapshot_written)

    def _snapshot_written(self) -> None:
        pid, r, trans_id, vote_id, started = self._snap_child
        self._snap_child = None
        self._loop.remove_reader(r)
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
        stats = self.snapshot_stats
        stats["taken"] += 1
        stats["last_write_ms"] = round((time.perf_counter() - started) * 1000, 1)
        log.info("node %d: snapshot at trans_id %d written in %.0f ms (fork pause %.1f ms)",
                 self.config.node_id, trans_id, stats["last_write_ms"], stats["last_pause_ms"])
        self._schedule_flush()  # the core may compact now

    def _reap(self, pid: int) -> None:
        """Collect the exited writer without blocking: tearing down a large
        child's address space can take a while after it has reported."""
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if not done:
            self._loop.call_later(0.05, self._reap, pid)

    def _snapshot_failed(self, trans_id: int, why: str) -> None:
        self.snapshot_stats["failed"] += 1
        self._snap_retry_at = time.monotonic() + SNAPSHOT_RETRY_S
        log.error("node %d: snapshot at trans_id %d failed: %s; retrying in %.0f s",
                  self.config.node_id, trans_id, why, SNAPSHOT_RETRY_S)

    def _keep_only(self, trans_id: int) -> bool:
        """Without storage: make the snapshot file at trans_id our newest and
        remove the others, unless a newer one was installed meanwhile (then
        this one goes). Returns whether it was kept."""
        keep = snapshot_file_name(trans_id)
        if trans_id < self.core.snapshot_id:
            unlink_quietly(os.path.join(self._snap_dir, keep))
            return False
        for name in os.listdir(self._snap_dir):
            if name.startswith("snapshot-") and name != keep:
                unlink_quietly(os.path.join(self._snap_dir, name))
        return True

    def _keep_installed(self, trans_id: int) -> None:
        """Without storage: a received snapshot becomes our newest file."""
        if self._installing is None:
            return
        path, expected = self._installing
        self._installing = None
        if expected != trans_id:
            raise InvariantError(f"installing snapshot {trans_id}, received {expected}")
        os.replace(path, os.path.join(self._snap_dir, snapshot_file_name(trans_id)))
        self._keep_only(trans_id)
        self.snapshot_stats["installed"] += 1

    def _stop_snapshot_work(self) -> None:
        if self._snap_child is not None:
            pid, r, *_ = self._snap_child
            self._snap_child = None
            self._loop.remove_reader(r)
            os.close(r)
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for peer_id in list(self._outgoing):
            self._drop_stream(peer_id)
        if self._incoming is not None:
            self._incoming.close()
            unlink_quietly(self._incoming.path)
            self._incoming = None

    # -- snapshots: streaming to a slave ---------------------------------------

    def _start_stream(self, peer_id: int, trans_id: int, vote_id: int) -> None:
        current = self._outgoing.get(peer_id)
        if current is not None:
            if (current.trans_id == trans_id
                    and time.monotonic() - current.acked_at < SNAPSHOT_STALL_S):
                return  # under way
            self._drop_stream(peer_id)
        path = os.path.join(self._snap_dir, snapshot_file_name(trans_id))
        try:
            file = open(path, "rb")  # stays readable if a newer snapshot removes it
        except OSError as exc:
            log.error("node %d: cannot send snapshot %s to node %d: %s", self.config.node_id,
                      path, peer_id, exc)
            return
        self._outgoing[peer_id] = _Outgoing(file, trans_id, vote_id, time.monotonic())
        self.snapshot_stats["sent"] += 1
        log.info("node %d: streaming snapshot at trans_id %d to node %d", self.config.node_id,
                 trans_id, peer_id)
        self._pump(peer_id)

    def _pump(self, peer_id: int) -> None:
        out = self._outgoing[peer_id]
        window = SNAPSHOT_WINDOW_CHUNKS * SNAPSHOT_CHUNK_BYTES
        while out.sent < out.size and out.sent - out.acked < window:
            data = out.file.read(SNAPSHOT_CHUNK_BYTES)
            if not data:
                break
            msg = SnapshotChunk(vote_id=self.core.vote_id, node_id=self.config.node_id,
                                trans_id=out.trans_id, log_vote_id=out.vote_id, offset=out.sent,
                                data=data, last=out.sent + len(data) >= out.size)
            if not self.net.send(peer_id, message_to_wire(msg)):
                self._drop_stream(peer_id)
                return
            out.sent += len(data)

    def _snapshot_acked(self, peer_id: int, msg: SnapshotAck) -> None:
        out = self._outgoing.get(peer_id)
        if out is None or out.trans_id != msg.trans_id or msg.offset <= out.acked:
            return
        out.acked = min(msg.offset, out.sent)
        out.acked_at = time.monotonic()
        if out.acked >= out.size:
            self._drop_stream(peer_id)
        else:
            self._pump(peer_id)

    def _drop_stream(self, peer_id: int) -> None:
        out = self._outgoing.pop(peer_id, None)
        if out is not None:
            out.file.close()

    # -- snapshots: receiving from the master ----------------------------------

    def _receive_chunk(self, peer_id: int, msg: SnapshotChunk) -> None:
        inc = self._incoming
        if msg.offset == 0:
            if inc is not None:
                inc.close()
            path = os.path.join(self._snap_dir, f"incoming-{msg.trans_id:020d}.snap.tmp")
            try:
                inc = self._incoming = _Incoming(peer_id, msg.trans_id, msg.log_vote_id, path)
            except OSError as exc:
                log.error("node %d: cannot receive snapshot into %s: %s",
                          self.config.node_id, path, exc)
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
            log.error("node %d: writing %s failed: %s", self.config.node_id, inc.path, exc)
            inc.close()
            unlink_quietly(inc.path)
            self._incoming = None
            return
        inc.offset += len(msg.data)
        self.net.send(peer_id, message_to_wire(SnapshotAck(
            vote_id=self.core.vote_id, node_id=self.config.node_id, trans_id=inc.trans_id,
            offset=inc.offset)))
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
            log.error("node %d: received snapshot %s is unusable: %s", self.config.node_id,
                      inc.path, exc)
            unlink_quietly(inc.path)
            return
        log.info("node %d: received snapshot at trans_id %d (%d bytes) from node %d",
                 self.config.node_id, trans_id, inc.offset, inc.source)
        self._installing = (inc.path, trans_id)
        self.core.step(Snapshot(vote_id=msg.vote_id, node_id=msg.node_id, trans_id=trans_id,
                                log_vote_id=vote_id, state=loader), now_ms())
        self._schedule_flush()
