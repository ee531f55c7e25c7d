"""When the native engine's log is fsynced, and how a sync runs off the
event loop: one `Durability` per node with storage, driven by the driver.

Theory of operation
-------------------
The driver carries out each of the core's Readys: it writes the log change
(a truncation or a snapshot install, after which it calls `bump_epoch()`;
then the records, `DiskStorage.append`), then calls
`after_write(ready.own_sync)`, before it sends or answers anything of that
Ready. `own_sync` is the core's side of the contract (engines.native.core,
"Our own copy on disk"): how its counting relies on our own fsync. The
policy (config.Fsync) decides what is done with it, whenever the storage
holds unsynced writes:

- off: nothing; the OS writes back when it likes.
- batch: a sync off the loop BATCH_SYNC_MS after the first write that found
  no batch timer armed.
- always, BEFORE_SEND: `storage.sync()` at once, on the event loop: the
  Ready's messages and answers (a slave's PushReply) vouch for the records.
  (Deferring this too, holding the answers until a threaded fsync ended,
  cost the cluster 40% more CPU per write in bench/durability_bench.py.)
- always, NOW: a sync off the loop starts at once (a deferring master whose
  own copy must count: its slaves alone cannot make a majority).
- always, MAY_WAIT: by the batch timer (its slaves can).

The core hears of every sync by `synced(covered)` (NativeCore.synced_to, an
input): at once for one on the loop; when it ends for one off the loop,
followed by `schedule_flush()`, since what it commits comes out in the next
Ready, and that Ready's own_sync says how soon what was written meanwhile
must be synced.

A sync off the loop: `storage.begin_sync()` hands over a duplicate of the
current segment's descriptor, the last trans_id it covers and a mark;
fdatasync runs in the kernel (KernelSync: Linux AIO, no thread, no GIL
hand-over) or else in a one-thread executor; `storage.end_sync(mark,
error)` finishes it on the loop.

Rules
- One sync off the loop at a time; one asked for meanwhile (NOW, or the
  batch timer) starts when it ends, and covers everything written by then.
- Epochs: a truncation or a snapshot install may replace records that a
  sync in flight covers; a sync begun in an earlier epoch is finished with
  the storage but never reported to the core.
- A failed sync (or any storage error here) is fatal: `fail(exc)` once, and
  from then on nothing is synced or reported, and close() leaves the log as
  a crash would (`storage.abandon()`): a later fsync could report success
  for pages the kernel dropped after the failure. `halt()` (a fatal error
  elsewhere in the node) does the same without `fail`.
- close(): no new sync; the one in flight is waited for (at most
  CLOSE_SYNC_WAIT_S) and its outcome heeded; then `storage.close()` (which
  syncs what is left), or abandon after a failure or a sync that never
  ended.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from time import perf_counter_ns

from ...config import BATCH_SYNC_MS, Fsync
from ...errors import InvariantError
from ...stats import FSYNC_BUCKETS_S, Histogram
from ...storage import DiskStorage, KernelSync, StorageError
from .core import OwnSync

__all__ = ["Durability", "BATCH_SYNC_MS", "CLOSE_SYNC_WAIT_S"]

log = logging.getLogger(__name__)

# At close, how long to wait for a sync in flight before leaving the log as a
# crash would (a disk that no longer answers).
CLOSE_SYNC_WAIT_S = 30.0


def _fsync_and_close(fd: int) -> None:
    """In the fsync thread: make a duplicated segment descriptor durable
    (fdatasync: the segment's file is allocated ahead, see storage.disk)."""
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


class Durability:
    """The fsync scheduling of one node's log (see the module docstring).

    `synced(trans_id)`: the core's input (NativeCore.synced_to).
    `fail(exc)`: the storage failed; the node must stop (called once).
    `schedule_flush()`: ask the driver to carry out the core's next Ready.
    """

    def __init__(self, *, storage: DiskStorage, policy: Fsync, node_id: int,
                 synced: Callable[[int], None], fail: Callable[[BaseException], None],
                 schedule_flush: Callable[[], None]) -> None:
        self.storage = storage
        self.policy = policy
        self.node_id = node_id
        self._synced = synced
        self._fail_cb = fail
        self._schedule_flush = schedule_flush
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        # None: fdatasync runs in _pool (no Linux AIO here, or it refused a file)
        self._kernel_sync: KernelSync | None = None
        # submitted to the kernel, by token: (fd, covered, mark, epoch); one at most
        self._kernel_syncs: dict[int, tuple[int, int, int, int]] = {}
        self._next_token = 1
        self._pool: ThreadPoolExecutor | None = None  # one thread, made at its first use
        self._batch_timer: asyncio.TimerHandle | None = None  # armed: a sync is due by it
        # Whether a write outside a Ready (the driver's fast path, a record
        # at a time) must call after_write: False while the batch timer is
        # armed (it will sync that write too) and with fsync=off.
        self.wants_writes = policy is not Fsync.OFF
        self._busy = False  # a sync off the loop is under way (one at most)
        self._again = False  # another was asked for while _busy: it starts when that ends
        self._epoch = 0  # truncations and installs so far; a sync reports only in its own
        self._closing = False  # close() began: no new syncs, it waits for the one in flight
        self._failed = False  # storage failed or the node halted: nothing more synced or reported
        # set iff not _busy or _failed: what close() waits for
        self._settled = asyncio.Event()
        self._settled.set()
        # Every log fsync's time from its start to its end (metrics: an
        # fsync off the loop includes its wait for the kernel or thread).
        self.fsync_seconds = Histogram(FSYNC_BUCKETS_S)
        self._sync_started_ns = 0  # perf_counter_ns() when the sync off the loop began

    @property
    def _running(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise InvariantError("Durability used before start()")
        return self._loop

    @property
    def in_flight(self) -> bool:
        """A sync off the event loop is under way."""
        return self._busy

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run on `loop`; hand syncs to the kernel where it can take them."""
        self._loop = loop
        if self.policy is not Fsync.OFF:
            self._kernel_sync = KernelSync.create()
            if self._kernel_sync is not None:
                loop.add_reader(self._kernel_sync.fileno(), self._kernel_sync_done)

    def after_write(self, own_sync: OwnSync) -> None:
        """A turn's log changes are written (the Ready's `own_sync` says how
        the core relies on them): sync now, start a sync off the loop, or
        leave it to the batch timer, as the policy says. Called before
        anything of that Ready is sent or answered. Raises StorageError
        (the node must stop; nothing of the Ready may go out)."""
        storage = self.storage
        if not storage.dirty:
            return
        policy = self.policy
        if policy is Fsync.ALWAYS and own_sync is OwnSync.BEFORE_SEND:
            started = perf_counter_ns()
            storage.sync()
            self.fsync_seconds.observe_ns(perf_counter_ns() - started)
            self._synced(storage.next_trans_id - 1)
        elif policy is Fsync.ALWAYS and own_sync is OwnSync.NOW:
            self._start_sync()
        elif policy is not Fsync.OFF and self._batch_timer is None:
            self.wants_writes = False
            self._batch_timer = self._running.call_later(BATCH_SYNC_MS / 1000,
                                                         self.batch_sync)

    def bump_epoch(self) -> None:
        """The log was truncated or a snapshot installed: a sync begun before
        must not vouch for the records after it."""
        self._epoch += 1

    def batch_sync(self) -> None:
        """The batch timer fired: sync what is written, off the loop."""
        self._batch_timer = None
        self.wants_writes = True
        if self.storage.dirty and not self._failed:
            try:
                self._start_sync()
            except StorageError as exc:
                self._fail(exc)

    def halt(self) -> None:
        """The node stops after a fatal error (ours or elsewhere): sync and
        report nothing more; close() leaves the log as a crash would."""
        self._failed = True
        self._settled.set()

    async def close(self) -> None:
        """Stop syncing; wait (CLOSE_SYNC_WAIT_S at most) for a sync in
        flight and heed its outcome: a failed one must not be followed by
        storage.close()'s own fsync, which could report success for pages
        the kernel dropped. Then close the storage, or abandon it."""
        self._closing = True
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None
        if not self._settled.is_set():
            try:
                await asyncio.wait_for(self._settled.wait(), CLOSE_SYNC_WAIT_S)
            except TimeoutError:
                log.error("node %d: a sync did not finish within %.0f s; leaving the log as "
                          "a crash would", self.node_id, CLOSE_SYNC_WAIT_S)
                self._failed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._kernel_sync is not None:
            self._running.remove_reader(self._kernel_sync.fileno())
            self._kernel_sync.close()  # waits for anything still in flight
            for fd, *_ in self._kernel_syncs.values():
                os.close(fd)
            self._kernel_syncs.clear()
        if not self._failed:
            self.storage.close()
        else:
            self.storage.abandon()

    # -- a sync off the loop ---------------------------------------------------

    def _start_sync(self) -> None:
        """fsync what is written so far off the event loop (one at a time).
        Raises StorageError."""
        if self._closing:
            return  # storage.close() syncs what is left
        if self._busy:
            self._again = True
            return
        handle = self.storage.begin_sync()
        if handle is None:
            self._synced(self.storage.next_trans_id - 1)
            return
        fd, covered, mark = handle
        self._sync_started_ns = perf_counter_ns()
        self._busy = True
        self._settled.clear()
        if self._kernel_sync is not None:
            token = self._next_token
            self._next_token += 1
            try:
                self._kernel_sync.submit(fd, token)
            except OSError as exc:  # e.g. EINVAL: this file system will not; use the thread
                log.info("node %d: kernel fsync refused (%s); fsync runs in a thread",
                         self.node_id, exc.strerror or exc)
                self._running.remove_reader(self._kernel_sync.fileno())
                self._kernel_sync.close()
                self._kernel_sync = None
            else:
                self._kernel_syncs[token] = (fd, covered, mark, self._epoch)
                return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qserver-fsync")
        future = self._running.run_in_executor(self._pool, _fsync_and_close, fd)
        future.add_done_callback(partial(self._thread_sync_done, covered, mark, self._epoch))

    def _kernel_sync_done(self) -> None:
        kernel_sync = self._kernel_sync
        if kernel_sync is None:  # its reader goes with it: cannot happen
            return
        try:
            finished = kernel_sync.reap()
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
            self._ended()
            self._fail(error)  # our bug, but the sync's outcome is unknown
            return
        self._sync_finished(covered, mark, epoch, error)

    def _sync_finished(self, covered: int, mark: int, epoch: int, error: OSError | None) -> None:
        self._ended()
        if self._failed:
            return
        try:
            self.storage.end_sync(mark, error)
            if self._closing:
                return
            if epoch == self._epoch:
                self._synced(covered)
            if self._again:
                self._again = False
                self._start_sync()
            # else what was written meanwhile is left to the flush below
            # (its Ready says how soon it must be synced)
        except StorageError as exc:
            self._fail(exc)
            return
        self._schedule_flush()

    def _ended(self) -> None:
        """The sync off the loop ended (its outcome is dealt with next)."""
        self.fsync_seconds.observe_ns(perf_counter_ns() - self._sync_started_ns)
        self._busy = False
        self._settled.set()

    def _fail(self, exc: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        self._settled.set()
        self._fail_cb(exc)
