"""One node's storage on disk: the log in segment files, snapshots, the vote.

Theory of operation
-------------------
The byte formats are in `qserver.storage.format`; this module does the I/O.
Files in the data directory::

    log-<first trans_id, 20 digits>.seg   record frames, consecutive trans_ids
    snapshot-<trans_id, 20 digits>.snap   the state machine up to trans_id
    vote                                   (vote_id, voted_for)
    vote.spare                             space kept for the next vote
    *.tmp                                  a write in progress: never read;
                                           recover() removes it
    *.corrupt                              a snapshot recover() set aside
    LOCK                                   flock'ed while open: one process
                                           per directory

The log is the run of segments in trans_id order; a segment is named by its
first record and the next segment starts right after its last. Records at
or below the newest snapshot may linger in the segment that holds the
snapshot point; recovery skips them.

A node opens the directory, calls `recover()` once, then uses `save_vote`,
`append`, `truncate_after`, `sync`, `write_snapshot`, `install_snapshot`,
in the order `Ready` lists them, and `close()` at shutdown.

Durability: what survives a crash
- `append` hands the frames to the OS before it returns (a copy into the
  page cache, see "Writing" below), so a process crash (kill -9) loses
  nothing appended. What a power loss keeps depends on
  `sync()`: everything appended before the last `sync()` survives.
- The node calls `sync()` by its fsync policy (config `fsync`): `always`,
  once per event-loop turn before answering; `batch`, from a timer every few
  ms; `off`, never (the OS writes back when it likes: a power loss loses
  recent entries, and can leave a tail that stops the node, see `recovery`).
- Whatever the policy, these are durable when they return: `save_vote` (a
  vote must be on disk before it is granted), `truncate_after` (a truncation
  the disk forgot could splice old records after new ones), snapshots, the
  cuts `recover()` makes, and every segment but the last (fsynced when the
  log rolls past it, once per `segment_bytes`). So after a power loss only
  the newest segment can have a damaged tail, and that tail is cut.
- `recover()` fsyncs what it keeps: after a process crash, the records it
  returns may still be only in the page cache, and the node acts on them.

The current segment's file is filled with zeros ahead of its records
(PREALLOCATE_BYTES at a time) and the records are written over them, so
that a sync is an fdatasync that changes no metadata (no file size, no new
blocks). Recovery takes an all-zero rest of a segment for that space, not
for damage; a segment is trimmed to its records when the log rolls past it
and at close.

Writing: on Linux the records are copied into a shared mapping
(MAP_SHARED) of the current segment's zeros, not written with pwrite(2).
The mapping is the page cache itself, which write(2) would fill: a process
crash loses nothing copied, fdatasync writes the pages back (Linux tracks
pages dirtied through a mapping like written ones), and recovery reads them
with read(2). A copy costs a fraction of a system call, so the native
engine's fast path writes each record as it is appended and answers at
once. The mapping runs from the page holding the segment's end to the end
of its zeros and is made again when the zeros grow; it is dropped before
the file is cut or closed. Where a mapping cannot be made (another system,
or mmap fails), records go by pwrite. The price: a page the disk fails to
read in (or the file cut under the node, or a full copy-on-write file
system) reaches a copy as SIGBUS, which kills the node at once, where
pwrite's error would have stopped it with a StorageError; either way the
record being written is never acknowledged (`qserver run` enables
faulthandler, so the stack shows where).

A full disk: those zeros are also the log's reserve. `make_room(n)` makes
sure n bytes of zeros lie ahead (writing more zeros if needed) and says
False, without harm, when the file system is out of space (ENOSPC,
EDQUOT); records written into that room never allocate, so they cannot
fail for lack of space. The node reserves room before it accepts a write
(engines/native/driver.py) and refuses the write otherwise. A segment roll that finds no
space for the new segment leaves the records in the current one, past
segment_bytes. Every other write error (EIO), and a write outside the room
that meets a full disk, poisons the storage (StorageError) and stops the
node. On copy-on-write file systems (btrfs, ZFS) an overwrite allocates
too, so there a full disk still stops the node.

Recovery (`recover()`): the newest valid snapshot plus the log after it.
A torn tail of the newest segment is cut; any other damage raises
`StorageError` naming the file and offset. What is cut, set aside or
refused, and why, is in `qserver.storage.recovery`, which does the reading.

Not thread-safe: one task of the node owns a DiskStorage.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import shutil
import sys
import tempfile
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable
from typing import Any, Literal, NamedTuple, overload
from zlib import crc32

from ..config import Fsync
from ..errors import InvariantError
from ..state.entries import Record
from .format import (
    FRAME_HEADER,
    FRAME_HEADER_BYTES,
    encode_record,
    encode_snapshot_chunks,
    encode_vote,
    frame_offsets,
    framed,
)
from .recovery import (
    Apply,
    Segment,
    StorageError,
    fit_log_to_snapshot,
    read_file,
    read_snapshot,
    read_vote,
    recover_log,
    settle_snapshots,
)

__all__ = ["DiskStorage", "Recovered", "StorageError", "SEGMENT_BYTES", "snapshot_file_name",
           "unlink_quietly", "write_snapshot_file"]

log = logging.getLogger(__name__)

# A new segment is started once the current one holds this much: small
# enough that a snapshot soon frees the space of old entries, large enough
# that rolls (one fsync and one file each) are rare.
SEGMENT_BYTES = 64 * 1024 * 1024

# The current segment's file is filled with zeros this far (or
# segment_bytes, if less) ahead of the records written into it, so that
# fdatasync(2) of records written over them changes no metadata: no new
# file size and no new blocks, hence no journal commit, only the data. Real
# zeros, not posix_fallocate: ext4 marks fallocated blocks "unwritten", and
# the first write into one needs a journal commit at the next sync anyway.
# Measured on this machine's ext4 with 6 KB written per sync: zeros about
# 140 us and 50 us of CPU per sync, fallocate or append about 220 us and
# 95 us. The zeros reach the disk with the next sync (1 MiB: a few ms,
# once per MiB of records). A segment is trimmed to its records when the
# log rolls past it and at close.
PREALLOCATE_BYTES = 1024 * 1024
_ZEROS = bytes(PREALLOCATE_BYTES)

# Where each write began is kept (marks) at least every this many records:
# a truncation reads the frame headers from the mark before its cut to the
# next (see _cut_offset), while the fast path's one-record writes add no
# mark each.
MARK_SPACING = 64

# append_payload's frame header, written into the mapping.
_pack_header_into = FRAME_HEADER.pack_into

# errnos that mean "no space": the write may be tried again once space is
# freed (every other write error stops the node).
_OUT_OF_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

_SEGMENT_RE = re.compile(r"^log-(\d{20})\.seg$")
_SNAPSHOT_RE = re.compile(r"^snapshot-(\d{20})\.snap$")
_VOTE = "vote"
# A file kept ready for the next vote, so that a vote can be saved on a full
# disk (an election must not stop a node whose disk is full): the new vote
# is written over its bytes (no allocation) and renamed over `vote`, which
# frees the old vote's block for the next spare. Its content means nothing.
_VOTE_SPARE = "vote.spare"
_VOTE_SPARE_BYTES = 4096
_LOCK = "LOCK"
_TMP = ".tmp"


class Recovered(NamedTuple):
    """What `recover()` found."""

    vote: tuple[int, int]  # (vote_id, voted_for); (0, 0) if none was saved
    snapshot: tuple[int, int, list] | None  # (trans_id, vote_id, state) or None
    records: list[Record]  # the log after the snapshot, gap-free (none when applied)
    reports: list[str]  # what was cut, removed or skipped, with file and offset
    # (trans_id, vote_id) of the last record recover's `apply` took (then
    # `records` is empty); None if it took none
    applied_to: tuple[int, int] | None = None


# -- small I/O helpers ------------------------------------------------------

def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    n = os.pwrite(fd, data, offset)
    if n < len(data):  # rare: a short write; go on from where it stopped
        view = memoryview(data)
        while n < len(view):
            n += os.pwrite(fd, view[n:], offset + n)


# A node without storage keeps its snapshot or dump files in a private
# temporary directory, `qserver-<kind>-<pid>-*` (`private_tmp_dir`), removed
# when it stops (`remove_private_tmp_dir`). One killed (kill -9) never
# removes it, and those files hold its messages: the next such node to
# start removes the directories whose owner is gone. The owner holds an
# flock on the directory's _OWNER_LOCK while it lives; the kernel drops it
# when the process dies, whatever its pid namespace (a pid alone would not
# tell, for a /tmp shared between containers).
_TMP_NAME = re.compile(r"qserver-[a-z]+-\d+-[^/]+")
_OWNER_LOCK = ".owner.lock"
_owned_tmp_dirs: dict[str, int] = {}  # path -> the descriptor holding its lock


def private_tmp_dir(kind: str) -> str:
    """A new temporary directory `qserver-<kind>-<pid>-*` for a node without
    storage, locked as this process's; first, those of processes that are
    gone are removed."""
    remove_stale_tmp_dirs(tempfile.gettempdir())
    path = tempfile.mkdtemp(prefix=f"qserver-{kind}-{os.getpid()}-")
    # Locked under another name, then renamed: a node starting meanwhile
    # never finds the lock file unlocked (it would take this directory for
    # a dead node's).
    locking = os.path.join(path, _OWNER_LOCK + ".new")
    fd = os.open(locking, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # (a new file: nobody else holds it)
    os.rename(locking, os.path.join(path, _OWNER_LOCK))
    _owned_tmp_dirs[path] = fd
    return path


def remove_private_tmp_dir(path: str) -> None:
    """Remove a directory `private_tmp_dir` made, and release its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _owned_tmp_dirs.pop(path, None)
    if fd is not None:
        os.close(fd)


def remove_stale_tmp_dirs(root: str) -> list[str]:
    """Remove the directories in `root` that `private_tmp_dir` made for a
    process that is gone: those whose owner lock can be taken. One whose
    owner lives, one without a lock file (being made right now), and any
    other name stay. Returns the paths removed."""
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if _TMP_NAME.fullmatch(name) is None or path in _owned_tmp_dirs:
            continue
        try:
            fd = os.open(os.path.join(path, _OWNER_LOCK), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives
        finally:
            os.close(fd)  # (releases the lock taken, if it was)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def unlink_quietly(path: str) -> None:
    """Remove a file if it is there; a file already gone is not an error."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_file_atomic(directory: str, name: str, pieces: Iterable[bytes]) -> None:
    """Write `name` in `directory` under a temporary name, fsync it, rename
    it into place, fsync the directory. Raises StorageError on failure (the
    temporary file is removed)."""
    final = os.path.join(directory, name)
    tmp = final + _TMP
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for piece in pieces:
                _write_all(fd, piece)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        unlink_quietly(tmp)
        raise StorageError(final, None, f"write failed: {exc.strerror or exc}") from exc
    except BaseException:
        unlink_quietly(tmp)
        raise


def snapshot_file_name(trans_id: int) -> str:
    """The name of the snapshot at trans_id inside a data directory."""
    return f"snapshot-{trans_id:020d}.snap"


def write_snapshot_file(directory: str, trans_id: int, vote_id: int,
                        state: Iterable[Any]) -> str:
    """Write a snapshot file of `state` at trans_id, atomically and durably,
    and return its path; nothing else in the directory changes. Made for a
    forked child that writes the state as it was at the fork while the node
    goes on; the node then calls `DiskStorage.adopt_snapshot(trans_id)`.
    Raises StorageError if the write fails."""
    name = snapshot_file_name(trans_id)
    _write_file_atomic(directory, name, encode_snapshot_chunks(trans_id, vote_id, state))
    return os.path.join(directory, name)


class DiskStorage:
    """The on-disk storage of one node (see the module docstring)."""

    def __init__(self, directory: str, fsync: Fsync | str = Fsync.BATCH, *,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        """Use `DiskStorage.open`, which also creates and locks the directory."""
        self.directory = os.fspath(directory)
        self.policy = Fsync(fsync)  # when the node calls sync(); see the module doc
        self.segment_bytes = segment_bytes
        self._segments: list[Segment] = []  # the log, oldest first; the last is current
        self._fd = -1  # open on the last segment (append only) or -1
        # Where writes (one or more frames) into the last segment began, at
        # least every MARK_SPACING records: first trans_id and offset, in
        # order. A truncation reads the frame headers from the mark before
        # its cut (`_cut_offset`).
        self._mark_ids = array("Q")
        self._mark_offsets = array("Q")
        self._next_trans_id = 1  # trans_id the next append must have
        self._base = 0  # trans_id of the newest snapshot (0: none)
        self._dirty = False  # the last segment has writes not yet fsynced
        self._appends = 0  # append() calls so far: tells a background sync what it covered
        self.records_written = 0  # records appended since the node started
        self.syncs = 0  # fsyncs of the log's records so far (monitor shows it)
        self._dir_dirty = False  # files were created or removed since the last fsync of the dir
        self._recovered = False
        self._failed: StorageError | None = None  # set by a failed write: refuse all work
        self._lock_fd = -1
        # The shared mapping records are copied into (see "Writing"): of
        # the current segment's file from _map_start to _map_end; None
        # while there is none (made by _write when it needs one).
        self._map: mmap.mmap | None = None
        self._map_start = 0
        self._map_end = 0
        self._mappable = sys.platform == "linux"  # False: pwrite only

    @classmethod
    def open(cls, directory: str, fsync: Fsync | str = Fsync.BATCH, *,
             segment_bytes: int = SEGMENT_BYTES) -> DiskStorage:
        """Create `directory` if needed, lock it, and return its storage.

        Raises StorageError if it cannot be created or another process holds
        it; ValueError for an unknown fsync policy. Call `recover()` next.
        """
        storage = cls(directory, fsync, segment_bytes=segment_bytes)
        path = os.path.join(storage.directory, _LOCK)
        try:
            os.makedirs(storage.directory, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageError(path, None, f"cannot open: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StorageError(path, None, "another process has this data directory "
                                               "open") from exc
            raise StorageError(path, None, f"cannot lock: {exc.strerror or exc}") from exc
        storage._lock_fd = fd
        return storage

    # -- paths ---------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _segment_path(self, first: int) -> str:
        return self._path(f"log-{first:020d}.seg")

    def _snapshot_path(self, trans_id: int) -> str:
        return self._path(snapshot_file_name(trans_id))

    # -- state checks --------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise self._failed
        if not self._recovered:
            raise InvariantError("DiskStorage used before recover()")

    def _fail(self, path: str, offset: int | None, what: str, exc: OSError) -> StorageError:
        """Poison the storage after a failed write or fsync: the file's state
        is unknown (and after a failed fsync, the kernel may have dropped the
        dirty pages), so only a restart and recovery can go on."""
        self._failed = StorageError(path, offset, f"{what} failed: {exc.strerror or exc}")
        return self._failed

    @property
    def next_trans_id(self) -> int:
        """The trans_id the next appended record must have."""
        return self._next_trans_id

    @property
    def dirty(self) -> bool:
        """True if records were appended since the last sync()."""
        return self._dirty or self._dir_dirty

    # -- recovery ------------------------------------------------------------

    def recover(self, sink_factory: Callable[[], Any] | None = None,
                replay: Callable[[tuple[int, int, Any] | None], Apply] | None = None
                ) -> Recovered:
        """Read the directory back: vote, newest valid snapshot, log after it.

        `sink_factory`: when given, each snapshot tried is decoded into a
        fresh `sink_factory()` (see `format.decode_snapshot`), and the
        snapshot's state in the result is that sink (`Store.snapshot_loader`
        builds the store as it reads, so a million messages are never held
        twice); otherwise the state is the wire list.

        `replay`: when given, it is called with the snapshot chosen (as in
        the result; None without one) before the log is read, and returns a
        function that takes the log's records after the snapshot in order
        as they are read, a block at a time, instead of the result's
        `records` (`recovery.recover_log`: only a log that continues the
        snapshot; `Recovered.applied_to` says how far). For a node alone,
        whose every record is committed: its restart never holds the log it
        replays.

        Cuts a torn tail (durably), removes unfinished writes, sets aside a
        corrupt snapshot; each is reported in `Recovered.reports` (and logged).
        Afterwards the storage appends at the record after the last one.
        Raises StorageError (file and offset) when the log cannot be trusted.
        Cost: reads every segment and the snapshots it tries.
        """
        if self._failed is not None:
            raise self._failed
        if self._recovered:
            raise InvariantError("recover() called twice")
        reports: list[str] = []

        def report(text: str) -> None:
            reports.append(text)
            log.warning("storage: %s", text)

        try:
            names = sorted(os.listdir(self.directory))
        except OSError as exc:
            raise StorageError(self.directory, None, f"cannot list: {exc.strerror or exc}") from exc
        for name in names:
            if name.endswith(_TMP):
                path = self._path(name)
                os.unlink(path)
                self._dir_dirty = True
                report(f"{path}: removed an unfinished write")
        vote = read_vote(self._path(_VOTE))
        segment_ids = sorted(int(m[1]) for n in names if (m := _SEGMENT_RE.match(n)))
        snapshot_ids = sorted((int(m[1]) for n in names if (m := _SNAPSHOT_RE.match(n))),
                              reverse=True)

        # The snapshot first, so that the log's records at or below it are
        # checked and dropped one by one rather than all held until it is
        # chosen (a million-message node's peak after a restart).
        snapshot_files = [(sid, self._snapshot_path(sid)) for sid in snapshot_ids]
        snapshot, skipped = read_snapshot(snapshot_files, report, sink_factory)
        base = snapshot[0] if snapshot is not None else 0
        found = recover_log([(first, self._segment_path(first)) for first in segment_ids],
                            report, keep_after=base,
                            apply=None if replay is None else replay(snapshot),
                            snapshot_vote=snapshot[1] if snapshot is not None else None)
        self._dir_dirty |= found.dir_changed
        self._dir_dirty |= settle_snapshots(snapshot_files, snapshot, skipped, found)
        found = fit_log_to_snapshot(found, snapshot, report)
        self._dir_dirty |= found.dir_changed
        records, segments = found.records, found.segments

        self._segments = segments
        self._base = base
        last_id = found.last_id  # (None once fit_log_to_snapshot removed the log)
        self._next_trans_id = last_id + 1 if last_id is not None and last_id > base else base + 1
        if segments:
            last = segments[-1]
            self._index_frames(last.first, found.last_offsets)
            if last.first + len(found.last_offsets) != self._next_trans_id:
                # only records at or below the snapshot remain in it; they end
                # at the snapshot point (checked above), so this cannot happen
                raise InvariantError(f"{last.path}: recovered log does not end at the snapshot")
            self._fd = os.open(last.path, os.O_RDWR)  # written at last.size (mapped)
            self._dirty = True  # what we read may be in the page cache only
        self._recovered = True
        self.sync()
        self._make_vote_spare()
        return Recovered(vote, snapshot, records, reports, found.applied_to)

    # -- the vote ------------------------------------------------------------

    def save_vote(self, vote_id: int, voted_for: int) -> None:
        """Persist (vote_id, voted_for) atomically and durably, whatever the
        fsync policy: it must be on disk before the vote is granted.
        Written over the spare file when there is one, so that it needs no
        new space (a full disk); otherwise as a new file. Cost: two fsyncs.
        Raises StorageError if the write fails."""
        self._check_usable()
        data = encode_vote(vote_id, voted_for)
        if not self._save_vote_in_spare(data):
            self._write_atomic(_VOTE, [data])
        self._make_vote_spare()

    def _save_vote_in_spare(self, data: bytes) -> bool:
        """Write the vote over the spare file's bytes, fsync it, rename it
        over `vote`, fsync the directory. False if there is no spare."""
        spare = self._path(_VOTE_SPARE)
        try:
            fd = os.open(spare, os.O_WRONLY)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise self._fail(spare, None, "open", exc) from exc
        try:
            try:
                if os.fstat(fd).st_size < len(data):
                    return False
                _pwrite_all(fd, data, 0)
                os.ftruncate(fd, len(data))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(spare, self._path(_VOTE))
            self._fsync_dir()
        except OSError as exc:
            raise self._fail(self._path(_VOTE), None, "write", exc) from exc
        return True

    def _make_vote_spare(self) -> None:
        """Best effort: have a spare ready for the next vote (none on a full
        disk: that vote then needs a new file, see save_vote)."""
        spare = self._path(_VOTE_SPARE)
        if os.path.exists(spare):
            return
        try:
            fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:
            return
        try:
            _write_all(fd, bytes(_VOTE_SPARE_BYTES))
        except OSError:
            unlink_quietly(spare)
        finally:
            os.close(fd)

    def _write_atomic(self, name: str, pieces: Iterable[bytes]) -> None:
        """Write a file under a temporary name, fsync it, rename it over
        `name`, fsync the directory: a reader sees the old file or the whole
        new one, never a part."""
        _write_file_atomic(self.directory, name, pieces)
        self._dir_dirty = False

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._dir_dirty = False

    # -- the log -------------------------------------------------------------

    def append(self, records: Iterable[Record]) -> None:
        """Append records (the next must be `next_trans_id`, then one by one).

        One copy (or write(2)) per segment touched: a process crash loses
        nothing, a power loss what came after the last `sync()`. Starts a
        new segment (fsyncing the full one) once the current holds
        `segment_bytes`, if there is space for it. Records that fit in the room reserved with
        `make_room` never allocate; others extend the zeros first.
        Raises InvariantError on a trans_id out of order (our bug),
        StorageError if the write fails. Cost: O(bytes).
        """
        self._check_usable()
        expect = self._next_trans_id
        encoded: list[bytes] = []
        for record in records:
            if record.trans_id != expect:
                raise InvariantError(f"append of trans_id {record.trans_id}, "
                                     f"{expect} was due")
            encoded.append(encode_record(record))
            expect += 1
        self.append_frames(encoded)

    def append_frames(self, encoded: list[bytes]) -> None:
        """`append` of records already encoded (`encode_record`), the first
        of them `next_trans_id`: the caller vouches for their order (the
        native engine's fast path encodes each record once, as it appends
        it to the log). Raises StorageError if the write fails."""
        self._check_usable()
        if not encoded:
            return
        expect = self._next_trans_id + len(encoded)
        trans_id = self._next_trans_id
        seg = self._segments[-1] if self._fd >= 0 else None
        data = b"".join(encoded)
        left = len(data)  # bytes still to place
        if seg is not None and seg.size + left <= self.segment_bytes:
            # The common case: every frame goes into the current segment,
            # one write.
            self._write(seg, data, len(encoded), trans_id)
            self._next_trans_id = expect
            return
        frames: list[bytes] = []
        pending = 0  # bytes in frames
        first = trans_id  # of frames[0]
        may_roll = True  # False once a roll found no space (not tried again in this call)
        for frame in encoded:
            if seg is None:  # no current segment (so nothing in `frames`): one is required
                seg = self._roll(trans_id, left, required=True)
            elif (may_roll and seg.size + pending > 0
                  and seg.size + pending + len(frame) > self.segment_bytes):
                if frames:
                    self._write(seg, b"".join(frames), len(frames), first)
                    frames, pending, first = [], 0, trans_id
                rolled = self._roll(trans_id, left, required=False)
                if rolled is None:
                    may_roll = False
                else:
                    seg = rolled
            frames.append(frame)
            pending += len(frame)
            left -= len(frame)
            trans_id += 1
        if frames and seg is not None:  # (frames are only ever added to a segment)
            self._write(seg, b"".join(frames), len(frames), first)
        self._next_trans_id = expect

    def append_payload(self, payload: bytes) -> None:
        """`append_frames` of one record's frame, given its payload
        (`encode_payload`), the next trans_id: the native engine's fast
        path, a record at a time. Within the current mapping it is a copy
        of the payload and one of the frame's header, packed in place (no
        frame is joined first), and the counters that _write keeps,
        written out here: this runs once per record. A kill -9 between
        the two copies leaves a torn tail that recovery cuts, as one
        inside a single copy could; the record was not answered yet."""
        mapped = self._map
        if mapped is not None and self._failed is None:
            seg = self._segments[-1]  # (a mapping is of the current segment)
            start = seg.size
            size = len(payload)
            end = start + FRAME_HEADER_BYTES + size
            if end <= self._map_end and end <= self.segment_bytes:  # (else it may roll)
                at = start - self._map_start
                mapped[at + FRAME_HEADER_BYTES:end - self._map_start] = payload
                _pack_header_into(mapped, at, size, crc32(payload))
                first = self._next_trans_id
                ids = self._mark_ids
                if not ids or first - ids[-1] >= MARK_SPACING:
                    ids.append(first)
                    self._mark_offsets.append(start)
                seg.size = end
                self._next_trans_id = first + 1
                self._dirty = True
                self._appends += 1
                self.records_written += 1
                return
        self.append_frames([framed(payload)])

    def _write(self, seg: Segment, data: bytes, count: int, first: int) -> None:
        """Write `count` frames (`data`; the first is trans_id `first`) at
        the end of `seg`, the current segment: copied into the mapping,
        made first if this goes past it; else with pwrite."""
        start = seg.size
        ids = self._mark_ids
        if not ids or first - ids[-1] >= MARK_SPACING:
            ids.append(first)
            self._mark_offsets.append(start)
        end = start + len(data)
        if end > seg.allocated:  # not reserved with make_room: extend the zeros now
            self._fill_zeros(seg, end + min(PREALLOCATE_BYTES, self.segment_bytes))
        if end > self._map_end and self._mappable and end <= seg.allocated:
            self._remap(seg, start)
        if end <= self._map_end:
            assert self._map is not None  # (_map_end is 0 without one)
            self._map[start - self._map_start:end - self._map_start] = data
        else:
            try:
                if os.pwrite(self._fd, data, start) != len(data):  # rare: a short write
                    _pwrite_all(self._fd, data, start)  # (all again, from the start)
            except OSError as exc:
                raise self._fail(seg.path, start, "write", exc) from exc
        seg.size = end
        if end > seg.allocated:
            seg.allocated = end
        self._dirty = True
        self._appends += 1
        self.records_written += count

    def _remap(self, seg: Segment, start: int) -> None:
        """Map the current segment from the page holding `start` to the end
        of its zeros (`seg.allocated`, the file's length). If the system
        will not, records go by pwrite from now on."""
        self._unmap()
        offset = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            self._map = mmap.mmap(self._fd, seg.allocated - offset, offset=offset)
        except (OSError, ValueError) as exc:
            self._mappable = False
            log.info("storage: cannot map %s (%s); records are written with pwrite",
                     seg.path, exc)
            return
        self._map_start, self._map_end = offset, seg.allocated

    def _unmap(self) -> None:
        """Drop the mapping (before the file is cut or closed)."""
        if self._map is not None:
            self._map.close()
            self._map = None
            self._map_start = self._map_end = 0

    def _fill_zeros(self, seg: Segment, length: int) -> bool:
        """Fill the current segment's file with zeros up to `length` bytes
        (from where its zeros end). Returns False if the file system is out
        of space (ENOSPC, EDQUOT): the zeros written so far stay, and count.
        Raises StorageError, poisoning the storage, for any other error (an
        I/O error: the disk itself is failing)."""
        at = seg.allocated
        try:
            while at < length:
                n = os.pwrite(self._fd, memoryview(_ZEROS)[:min(PREALLOCATE_BYTES, length - at)],
                              at)
                if n <= 0:
                    raise OSError(errno.ENOSPC, "no progress writing zeros")
                at += n
                seg.allocated = at
        except OSError as exc:
            if exc.errno in _OUT_OF_SPACE:
                return False
            raise self._fail(seg.path, at, "write", exc) from exc
        return True

    @property
    def room(self) -> int:
        """Bytes of zeros ahead of the records in the current segment: what
        the log can take without allocating (see make_room)."""
        if self._fd < 0:
            return 0
        seg = self._segments[-1]
        return seg.allocated - seg.size

    def make_room(self, nbytes: int) -> bool:
        """Reserve space for the next `nbytes` of records: make sure the
        current segment has at least that many zeros ahead of its records
        (filling up to PREALLOCATE_BYTES more while there is space), starting
        the segment if there is none (`log-<next_trans_id>.seg`). Returns
        False if the file system is out of space (nothing is poisoned:
        records written so far are intact; try again later). Raises
        StorageError for any other failure (see `_fill_zeros`).

        `append` of records that fit in the room never allocates, so it
        cannot fail for lack of space (on file systems that overwrite in
        place: ext4, xfs, tmpfs; not copy-on-write ones such as btrfs or
        ZFS, where an overwrite allocates too and ENOSPC there stops the
        node). Cost: nothing when the room is there; else a write of zeros
        (about PREALLOCATE_BYTES)."""
        self._check_usable()
        if self._fd < 0:
            if self._open_segment(self._next_trans_id, nbytes, required=False) is None:
                return False
        if self.room >= nbytes:
            return True
        seg = self._segments[-1]
        self._fill_zeros(seg, seg.size + nbytes + min(PREALLOCATE_BYTES, self.segment_bytes))
        return self.room >= nbytes

    def _trim(self, seg: Segment) -> None:
        """Cut the current segment's file to its records (the space allocated
        ahead goes) and make that durable."""
        try:
            if seg.allocated > seg.size:
                self._unmap()
                os.ftruncate(self._fd, seg.size)
                seg.allocated = seg.size
            os.fdatasync(self._fd)
        except OSError as exc:
            raise self._fail(seg.path, None, "fsync", exc) from exc

    @overload
    def _roll(self, first: int, nbytes: int, *, required: Literal[True]) -> Segment: ...
    @overload
    def _roll(self, first: int, nbytes: int, *, required: bool) -> Segment | None: ...

    def _roll(self, first: int, nbytes: int, *, required: bool) -> Segment | None:
        """Start `log-<first>.seg`, with zeros for at least `nbytes` of
        records, as the current segment; the one before is closed trimmed
        and fsynced first (every segment but the last is durable and ends
        with its last record). Without the space for the new one, returns
        None and the current segment stays (records go on past
        segment_bytes, into the room reserved there), unless `required`
        (there is no current segment): then StorageError."""
        return self._open_segment(first, nbytes, required=required)

    @overload
    def _open_segment(self, first: int, nbytes: int, *, required: Literal[True]) -> Segment: ...
    @overload
    def _open_segment(self, first: int, nbytes: int, *, required: bool) -> Segment | None: ...

    def _open_segment(self, first: int, nbytes: int, *, required: bool) -> Segment | None:
        """Make `log-<first>.seg` the current segment: it is written under a
        temporary name (zeros for `nbytes` and a step more, less if space
        runs out), then the current segment is closed (trimmed, fsynced),
        then it is renamed into place: so a crash never leaves a segment
        after one that may lack a synced tail. Out of space for `nbytes`:
        nothing changes and None is returned, or StorageError is raised if
        `required`."""
        path = self._segment_path(first)
        tmp = path + _TMP
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            if exc.errno in _OUT_OF_SPACE and not required:
                return None
            raise self._fail(path, None, "create", exc) from exc
        seg = Segment(first, path, 0)
        previous_fd = self._fd
        self._fd = fd  # _fill_zeros writes to the current descriptor
        try:
            filled = self._fill_zeros(seg, nbytes + min(PREALLOCATE_BYTES, self.segment_bytes))
        except BaseException:
            os.close(fd)
            unlink_quietly(tmp)
            raise
        finally:
            self._fd = previous_fd
        if not filled and seg.allocated < nbytes:
            os.close(fd)
            unlink_quietly(tmp)
            if required:
                raise self._fail(path, 0, "write", OSError(errno.ENOSPC,
                                                           os.strerror(errno.ENOSPC)))
            return None
        try:
            if self._fd >= 0:
                old = self._segments[-1]
                self._trim(old)
                self._unmap()
                os.close(self._fd)
                self._fd = -1
                self._dirty = False
            os.replace(tmp, path)
        except OSError as exc:
            os.close(fd)
            unlink_quietly(tmp)
            raise self._fail(path, None, "create", exc) from exc
        except BaseException:
            os.close(fd)
            unlink_quietly(tmp)
            raise
        self._fd = fd
        self._segments.append(seg)
        self._index_frames(first, [])
        self._dir_dirty = True
        return seg

    def sync(self) -> None:
        """Make everything appended so far durable: fsync the current
        segment, and the directory if a segment was created or removed.
        Does nothing if nothing changed. Raises StorageError on failure
        (and refuses further work: see StorageError)."""
        if self._failed is not None:
            raise self._failed
        if self._dirty and self._fd >= 0:
            seg = self._segments[-1]
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                raise self._fail(seg.path, None, "fsync", exc) from exc
            self.syncs += 1
        self._dirty = False
        self._sync_dir()

    def begin_sync(self) -> tuple[int, int, int] | None:
        """Start a sync to be finished off the event loop: the directory is
        fsynced now if it changed (rare: a segment created or removed), and
        the caller gets (fd, covered, mark): a duplicate of the current
        segment's descriptor to fsync and close in another thread, the last
        trans_id that fsync makes durable, and a mark for `end_sync`. None
        if nothing is waiting to be synced. A segment roll meanwhile does
        not matter: it fsyncs the old segment itself, and the duplicate keeps
        the file open. Raises StorageError as sync() does."""
        if self._failed is not None:
            raise self._failed
        self._sync_dir()
        if not self._dirty or self._fd < 0:
            self._dirty = False
            return None
        try:
            fd = os.dup(self._fd)
        except OSError as exc:
            raise self._fail(self._segments[-1].path, None, "dup", exc) from exc
        return fd, self._next_trans_id - 1, self._appends

    def end_sync(self, mark: int, error: OSError | None = None) -> None:
        """Finish a sync begun by `begin_sync`: with `error`, the storage is
        poisoned (StorageError raised); otherwise it is clean unless more was
        appended since."""
        if error is not None:
            path = self._segments[-1].path if self._segments else self.directory
            raise self._fail(path, None, "fsync", error)
        self.syncs += 1
        if self._appends == mark:
            self._dirty = False

    def _sync_dir(self) -> None:
        if self._dir_dirty:
            try:
                self._fsync_dir()
            except OSError as exc:
                raise self._fail(self.directory, None, "fsync", exc) from exc

    def truncate_after(self, trans_id: int) -> None:
        """Drop every record after `trans_id` (a diverging log), durably:
        later segments are removed and the one holding trans_id is cut right
        after it and fsynced. A no-op if the log ends at or before trans_id.
        Raises InvariantError below the snapshot (those records are gone).
        Cost: within the current segment, a read of the one write the cut
        falls into (its frame headers); a segment's headers when the cut
        falls in an older one.
        """
        self._check_usable()
        if trans_id >= self._next_trans_id - 1:
            return
        if trans_id < self._base:
            raise InvariantError(f"truncate after {trans_id}, below the snapshot at {self._base}")
        segments = self._segments
        end_id = self._next_trans_id  # after the last record of the segment cut into
        while segments and segments[-1].first > trans_id:
            seg = segments.pop()
            end_id = seg.first
            if self._fd >= 0:
                self._unmap()
                os.close(self._fd)
                self._fd = -1
            try:
                os.unlink(seg.path)
            except OSError as exc:
                raise self._fail(seg.path, None, "unlink", exc) from exc
            self._dir_dirty = True
        self._dirty = False
        if segments:
            seg = segments[-1]
            try:
                if self._fd < 0:  # the cut is in an older segment: index it
                    self._index_frames(seg.first, frame_offsets(read_file(seg.path, seg.size)))
                    self._fd = os.open(seg.path, os.O_RDWR)
                if trans_id + 1 < end_id:
                    seg.size = self._cut_offset(seg, trans_id + 1)
                if seg.allocated > seg.size:  # also zeroes what was cut
                    self._unmap()
                    os.ftruncate(self._fd, seg.size)
                    seg.allocated = seg.size
                os.fsync(self._fd)
            except OSError as exc:
                raise self._fail(seg.path, None, "truncate", exc) from exc
        self._sync_dir()
        self._next_trans_id = trans_id + 1

    def _index_frames(self, first: int, offsets: list[int]) -> None:
        """The marks of a segment read back (or new): one per frame, the
        first frame being trans_id `first`."""
        self._mark_ids = array("Q", range(first, first + len(offsets)))
        self._mark_offsets = array("Q", offsets)

    def _cut_offset(self, seg: Segment, trans_id: int) -> int:
        """Where the frame of `trans_id` starts in `seg` (the current
        segment, whose marks these are, and which holds that frame),
        dropping the marks from it on. Reads the headers of the one write
        that holds it (at most a turn's records)."""
        ids, offsets = self._mark_ids, self._mark_offsets
        i = bisect_right(ids, trans_id) - 1
        if i < 0:
            raise InvariantError(f"{seg.path}: no write holds trans_id {trans_id}")
        start = offsets[i]
        skip = trans_id - ids[i]  # frames of that write to keep
        if skip:
            end = offsets[i + 1] if i + 1 < len(offsets) else seg.size
            with open(seg.path, "rb") as f:
                f.seek(start)
                frames = frame_offsets(f.read(end - start), skip + 1)
            if len(frames) <= skip:  # never: the write's frames were all accepted
                raise InvariantError(f"{seg.path}: no frame of trans_id {trans_id} at {start}")
            start += frames[skip]
            i += 1
        del ids[i:]
        del offsets[i:]
        return start

    # -- snapshots -----------------------------------------------------------

    def write_snapshot(self, trans_id: int, vote_id: int, state: Iterable[Any]) -> None:
        """Save a snapshot of our own state at `trans_id` (vote_id: that
        entry's), then remove older snapshots and the segments it covers.

        `state`: `Store.to_wire()` or `format.store_wire_iter(store)` (which
        never builds the whole wire form); it is consumed within this call.
        Atomic (temporary name, fsync, rename, fsync of the directory) and
        durable whatever the policy. Requires base <= trans_id <= the last
        appended record. Raises StorageError if the write fails (the log is
        untouched: the node may go on). Cost: O(state) in bytes, blocking.
        """
        self._check_usable()
        if not self._base <= trans_id < self._next_trans_id:
            raise InvariantError(f"snapshot at {trans_id} outside the log "
                                 f"({self._base}..{self._next_trans_id - 1})")
        self._save_snapshot(trans_id, vote_id, state)
        segments = self._segments
        while len(segments) > 1 and segments[1].first <= trans_id + 1:
            seg = segments.pop(0)  # every record in it is at or below trans_id
            unlink_quietly(seg.path)
            self._dir_dirty = True
        self._base = trans_id
        self._sync_dir()

    def install_snapshot(self, trans_id: int, vote_id: int, state: Iterable[Any]) -> None:
        """Save a snapshot received from the master and restart the log after
        it: every other snapshot and every segment is removed; the next
        append is trans_id + 1. Atomic and durable as `write_snapshot`.
        A crash between the rename and the removals is repaired by
        `recover()` (the old log predates the snapshot: it is removed)."""
        self._check_usable()
        if trans_id < self._base:
            raise InvariantError(f"install of a snapshot at {trans_id}, "
                                 f"below ours at {self._base}")
        self._save_snapshot(trans_id, vote_id, state)
        self._restart_log_after(trans_id)

    def adopt_snapshot(self, trans_id: int) -> bool:
        """Make the snapshot file at trans_id, written by
        `write_snapshot_file` (in another process), the newest: remove older
        snapshots and the segments it covers, as `write_snapshot` does.
        A snapshot overtaken meanwhile (an installed one is newer) is removed
        instead. Returns whether it was adopted. Raises StorageError if the
        file is missing."""
        self._check_usable()
        path = self._snapshot_path(trans_id)
        if not os.path.exists(path):
            raise StorageError(path, None, "adopted snapshot file is missing")
        if trans_id < self._base or trans_id >= self._next_trans_id:
            unlink_quietly(path)
            return False
        self._remove_snapshots_but(trans_id)
        segments = self._segments
        while len(segments) > 1 and segments[1].first <= trans_id + 1:
            seg = segments.pop(0)
            unlink_quietly(seg.path)
            self._dir_dirty = True
        self._base = trans_id
        self._sync_dir()
        return True

    def install_snapshot_file(self, path: str, trans_id: int) -> None:
        """As `install_snapshot`, for a snapshot already written (complete
        and fsynced, e.g. received from the master in chunks) to `path` in
        this directory: it is renamed into place instead of written again."""
        self._check_usable()
        if trans_id < self._base:
            raise InvariantError(f"install of a snapshot at {trans_id}, "
                                 f"below ours at {self._base}")
        try:
            os.replace(path, self._snapshot_path(trans_id))
            self._fsync_dir()
        except OSError as exc:
            raise self._fail(path, None, "install snapshot", exc) from exc
        self._remove_snapshots_but(trans_id)
        self._restart_log_after(trans_id)

    def _remove_snapshots_but(self, trans_id: int) -> None:
        for other in os.listdir(self.directory):
            m = _SNAPSHOT_RE.match(other)
            if m and int(m[1]) != trans_id:
                unlink_quietly(self._path(other))
                self._dir_dirty = True

    def _restart_log_after(self, trans_id: int) -> None:
        if self._fd >= 0:
            self._unmap()
            os.close(self._fd)
            self._fd = -1
        for seg in self._segments:
            unlink_quietly(seg.path)
        self._segments = []
        self._index_frames(0, [])
        self._dirty = False
        self._dir_dirty = True
        self._base = trans_id
        self._next_trans_id = trans_id + 1
        self._sync_dir()

    def _save_snapshot(self, trans_id: int, vote_id: int, state: Iterable[Any]) -> None:
        self._write_atomic(snapshot_file_name(trans_id),
                           encode_snapshot_chunks(trans_id, vote_id, state))
        self._remove_snapshots_but(trans_id)

    # -- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        """Orderly shutdown: sync (whatever the policy) and close the files."""
        try:
            if self._recovered and self._failed is None:
                self.sync()
                if self._fd >= 0:
                    self._trim(self._segments[-1])
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close the files without syncing: what a crash leaves behind (the
        page cache still holds what was appended). For tests and for
        stopping after a StorageError."""
        if self._fd >= 0:
            self._unmap()
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
        self._recovered = False
        if self._failed is None:
            self._failed = StorageError(self.directory, None, "storage closed")
