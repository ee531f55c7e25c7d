"""Reading a data directory back after a restart or a crash.

Theory of operation
-------------------
`DiskStorage.recover()` (in `qserver.storage.disk`) lists the directory,
names the files, and composes the functions here; they read the files, make
the few repairs recovery makes (cut a torn tail, set aside a corrupt
snapshot, remove a log that predates a snapshot), and return what they
found. The caller sets its own state from that and fsyncs the directory when
a function says it removed or renamed a file.

Memory (a restart must fit where the node ran): the snapshot is decoded
first (into the caller's sink), then the log, so that records the snapshot
covers are checked one by one and dropped instead of being held until the
snapshot is chosen; segments are read in blocks into one reused buffer, not
whole (a damaged one is read whole, to judge the damage). Measured with
bench/memory_bench.py: a node holding 1,000,000 messages, 67,000 records
after its snapshot, peaked at 429 MB during recovery with both held and
380 MB without (its RSS once serving: 386 and 380 MB). A node alone does
not hold the records after the snapshot either: `recover_log(apply=)`
hands them over a block at a time as they are read, and the node applies
them (each is committed). With the whole log of 1,000,000 produces to
replay (`memory_bench.py --parts single --log-size 2000000`): 894 MB
(peak 902) held, 381 MB so, against 347 MB before the kill.

Recovery: the newest valid snapshot plus the log after it.
- A problem (torn or corrupt frame) in the newest segment with no valid
  record after it is a torn tail: it is cut off (durably) and reported with
  the file and offset. So is one in the newest segment whose damage holds a
  sector-aligned run of 512 zero bytes before valid records: the records
  written since the last sync reached the disk page by page, out of order,
  and one never arrived (a power loss; see `_zero_sector`). Any other
  problem (a bad frame followed by valid ones, a bad frame in an older
  segment, a gap between segments or between the snapshot and the log)
  raises `StorageError` naming the file and offset.
- An all-zero rest of a segment is the space the writer filled ahead of its
  records (see `disk.PREALLOCATE_BYTES`), not damage.
- A snapshot that does not decode is set aside (renamed `*.corrupt`, and
  reported) and the next older one is used, if the log covers what the
  skipped one held; otherwise `StorageError`.
- If the log's record at the snapshot's trans_id has another vote_id, or the
  log ends before the snapshot, the log is from before an installed
  snapshot (a crash between installing it and removing the old log): it is
  removed and reported.

`StorageError` and `Segment` live here rather than in `disk` so that both
modules use them without an import cycle (disk imports this module and
re-exports StorageError).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ..errors import InvariantError, QServerError
from ..state.entries import Record
from .format import ScanResult, decode_snapshot, decode_vote, frame_offsets, resync, scan

# Snapshots and segments are read back in blocks of this size: a segment
# (up to disk.SEGMENT_BYTES, 64 MiB) is never held whole unless it is
# damaged.
_READ_BLOCK = 1024 * 1024
_SEGMENT_BLOCK = 4 * 1024 * 1024

# The smallest unit a disk writes whole. Records written over the zeros
# ahead reach the disk page by page, in any order, until a sync: after a
# power loss, a sector of zeros can lie between records that did arrive.
_SECTOR_BYTES = 512
_ZERO_SECTOR = bytes(_SECTOR_BYTES)

Report = Callable[[str], None]  # takes a line for `Recovered.reports`
Apply = Callable[[list[Record]], None]  # takes the log's records as read (recover_log)


class StorageError(QServerError):
    """Raised when a data directory cannot be trusted or written: corruption
    before the tail of the log, a gap in it, an unreadable vote, a corrupt
    snapshot that nothing else covers, a failed write or fsync (after which
    the DiskStorage refuses further work: the node must stop and recover).

    The message names the file and, where it applies, the byte offset.
    """

    def __init__(self, path: str, offset: int | None, problem: str) -> None:
        self.path = path
        self.offset = offset
        self.problem = problem
        where = path if offset is None else f"{path}: offset {offset}"
        super().__init__(f"{where}: {problem}")


class Segment:
    """One segment file of the log, as recovery found it or the writer
    keeps it."""

    __slots__ = ("first", "path", "size", "allocated")

    def __init__(self, first: int, path: str, size: int, allocated: int | None = None) -> None:
        self.first = first  # trans_id of its first record (its name)
        self.path = path
        self.size = size  # bytes of valid frames (what we wrote or kept)
        # length of the file: size plus preallocated zeros (current segment)
        self.allocated = size if allocated is None else allocated


class LogFound(NamedTuple):
    """What `recover_log` (and then `fit_log_to_snapshot`) kept of the log."""

    records: list[Record]  # every record kept (above keep_after), in trans_id order;
    # none of those handed to recover_log's `apply` (see applied_to)
    segments: list[Segment]  # the segments that hold the log, oldest first
    last_offsets: list[int]  # where the last segment's valid frames start ([] if none)
    dir_changed: bool  # a segment file was removed: the directory needs an fsync
    first_id: int | None = None  # trans_id of the log's first record (None: empty log)
    last_id: int | None = None  # ... and of its last
    vote_at_keep_after: int | None = None  # vote_id of the record at keep_after, if in the log
    # (trans_id, vote_id) of the last record handed to recover_log's
    # `apply` (then `records` is empty); None if none was
    applied_to: tuple[int, int] | None = None


# -- reading files -----------------------------------------------------------

def read_file(path: str, size: int = -1) -> bytes:
    with open(path, "rb") as f:
        return f.read(size)


def _read_blocks(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            yield block


def _zeros_from(buf: bytes, start: int) -> bool:
    """Whether buf[start:] is all zero bytes (preallocated, never written)."""
    return buf.count(0, start) == len(buf) - start


def _zero_sector(buf: bytes, start: int, end: int) -> int | None:
    """The offset of the first sector-aligned run of _SECTOR_BYTES zeros
    in buf[start:end] (its first sector may begin before `start`), or None.

    A damaged record followed by valid ones is corruption, except where the
    damage holds such a sector in the newest segment: that is a write that
    never reached the disk, so everything from the damaged record on was
    written after the last sync that finished (etcd's WAL reads a torn
    write the same way). Cost: O(end - start)."""
    offset = start - start % _SECTOR_BYTES
    while offset + _SECTOR_BYTES <= end:
        if buf[offset:offset + _SECTOR_BYTES] == _ZERO_SECTOR:
            return offset
        offset += _SECTOR_BYTES
    return None


def _cut(path: str, size: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)  # a cut the disk forgot would put garbage before new records
    finally:
        os.close(fd)


# -- the vote, the log, the snapshots ------------------------------------------

def read_vote(path: str) -> tuple[int, int]:
    """The saved (vote_id, voted_for), or (0, 0) if there is no vote file.
    Raises StorageError if it does not decode."""
    try:
        buf = read_file(path)
    except FileNotFoundError:
        return (0, 0)
    try:
        return decode_vote(buf)
    except ValueError as exc:
        # A vote is replaced by rename, never torn: this is damage, and
        # forgetting a vote could let this node vote twice in one epoch.
        raise StorageError(path, 0, f"vote unreadable: {exc}") from None


class _Kept:
    """Where recover_log puts the records above keep_after, in order: handed
    to `apply` as they are read once the log is known to continue the
    snapshot (it starts at trans_id 1 without one; with one, right after it,
    or with the snapshot's vote_id at its trans_id), else held (LogFound.
    records). A record already kept (a damaged segment is scanned again,
    whole) is skipped."""

    __slots__ = ("apply", "keep_after", "snapshot_vote", "held", "upto", "streaming",
                 "applied_to")

    def __init__(self, apply: Apply | None, keep_after: int, snapshot_vote: int | None) -> None:
        self.apply = apply
        self.keep_after = keep_after
        self.snapshot_vote = snapshot_vote
        self.held: list[Record] = []
        self.upto = keep_after  # trans_id of the last record kept
        self.streaming: bool | None = None if apply is not None else False  # None: undecided
        self.applied_to: tuple[int, int] | None = None

    def add(self, records: list[Record], log_first: int, vote_at: int | None) -> None:
        """Keep `records` (all above keep_after, in order, from a log whose
        first record is `log_first`; `vote_at`: the vote_id seen at
        keep_after, if any)."""
        if records and records[0].trans_id <= self.upto:
            records = [r for r in records if r.trans_id > self.upto]
        if not records:
            return
        if self.streaming is None:  # the first records: may they be applied as read?
            if self.keep_after == 0:
                self.streaming = log_first == 1
            else:
                self.streaming = log_first == self.keep_after + 1 or (
                    log_first <= self.keep_after and vote_at == self.snapshot_vote)
        last = records[-1]
        self.upto = last.trans_id
        if self.streaming:
            assert self.apply is not None  # (streaming is False without one)
            self.apply(records)
            self.applied_to = (last.trans_id, last.vote_id)
        else:
            self.held += records


def recover_log(segment_files: list[tuple[int, str]], report: Report,
                keep_after: int = 0, apply: Apply | None = None,
                snapshot_vote: int | None = None) -> LogFound:
    """Read the segments, given as (first trans_id, path) in trans_id order.

    Every record is checked; only those above `keep_after` (the snapshot's
    trans_id, whose vote_id is `snapshot_vote`) are kept: the others would
    be decoded, held until the whole log is read, and dropped. With `apply`,
    the records kept are handed to it in order, a block at a time, as they
    are read, when the log continues the snapshot (see _Kept; those are the
    records fit_log_to_snapshot keeps), so that a restart never holds the
    log it replays: a node alone applies them at once (each is committed).
    A damaged segment stops recovery with StorageError after records before
    the damage may have been applied; a torn tail does not. Otherwise they
    are returned (LogFound.records). Cuts a torn tail of the last segment
    (durably) and removes a last segment left with no records; each cut is
    reported. Raises StorageError for a gap between segments or damage that
    is not a torn tail (see the module docstring). Cost: reads every
    segment; holds one segment's bytes and the records kept (a block's
    with `apply`).
    """
    kept = _Kept(apply, keep_after, snapshot_vote)
    segments: list[Segment] = []
    last_offsets: list[int] = []
    dir_changed = False
    first_id: int | None = None
    last_id: int | None = None
    vote_at: int | None = None
    expect: int | None = None  # first trans_id of the next segment
    for i, (first, path) in enumerate(segment_files):
        is_last = i == len(segment_files) - 1
        if expect is not None and first != expect:
            raise StorageError(path, 0, f"log gap: the previous segment ends at trans_id "
                               f"{expect - 1}, this one starts at {first}")
        def keep(records: list[Record], vote: int | None,
                 log_first: int = first if first_id is None else first_id,
                 before: int | None = vote_at) -> None:
            """kept.add, with the vote_id at keep_after seen in this segment
            or before it."""
            kept.add(records, log_first, before if vote is None else vote)

        blocks = _scan_blocks(path, first, keep_after, keep)
        if blocks is not None:  # whole frames, then nothing or zeros written ahead
            result, offsets, allocated = blocks
            good_end = result.good_end_offset
        else:  # damage: the whole file, to tell a torn tail from corruption
            buf = read_file(path)
            result = scan(buf, first_trans_id=first, keep_after=keep_after)
            good_end = result.good_end_offset
            problem = result.problem
            allocated = good_end
            if problem is not None and _zeros_from(buf, good_end):
                allocated = len(buf)  # zeros written ahead of the records: not a problem
            elif problem is not None:
                after = result.last_trans_id if result.last_trans_id is not None else first - 1
                later = resync(buf, problem.offset + 1, after_trans_id=after)
                hole = None
                if later is not None and is_last:
                    hole = _zero_sector(buf, problem.offset, later)
                if later is not None and hole is None:
                    raise StorageError(path, problem.offset, f"{problem.kind} record "
                                       f"({problem.reason}) before valid records "
                                       f"(at offset {later})")
                if not is_last:
                    raise StorageError(path, problem.offset, f"{problem.kind} record "
                                       f"({problem.reason}) in a segment that is not the last")
                _cut(path, good_end)
                why = f"{problem.kind} record ({problem.reason})"
                if hole is not None:
                    why += (f", a sector of zeros at offset {hole} and records again at "
                            f"offset {later}: writes after the last sync that reached the "
                            f"disk out of order (a power loss)")
                report(f"{path}: cut {len(buf) - good_end} bytes at offset {problem.offset}: "
                       f"{why}")
            offsets = frame_offsets(memoryview(buf)[:good_end])
            del buf
            keep(result.records, result.vote_at_keep_after)  # (those kept already are skipped)
        if result.last_trans_id is None:
            expect = first
            if good_end == 0 and is_last:  # holds nothing: start afresh on append
                os.unlink(path)
                dir_changed = True
                continue
        else:
            expect = result.last_trans_id + 1
            if first_id is None:
                first_id = first
            last_id = result.last_trans_id
        if result.vote_at_keep_after is not None:
            vote_at = result.vote_at_keep_after
        segments.append(Segment(first, path, good_end, allocated))
        last_offsets = offsets
    return LogFound(kept.held, segments, last_offsets, dir_changed, first_id, last_id, vote_at,
                    kept.applied_to)


def _scan_blocks(path: str, first: int, keep_after: int,
                 keep: Callable[[list[Record], int | None], None]
                 ) -> tuple[ScanResult, list[int], int] | None:
    """Scan a segment read in blocks: (the result, the offsets of its
    frames, the file's length) if it holds whole, valid frames followed by
    nothing or by zeros only (the space written ahead); None if it has any
    other problem (the caller reads it whole to tell a torn tail from
    corruption). Each block's valid records above keep_after go to
    `keep(records, vote_id at keep_after if seen)` as they are read (the
    result's `records` is empty). Reads into one reused buffer of
    _SEGMENT_BLOCK bytes (more only for a longer record), not the file:
    nothing of a segment's size is allocated and freed (which also leaves
    the C heap fragmented)."""
    offsets: list[int] = []
    last_id: int | None = None
    vote_at: int | None = None
    expect = first
    buf = bytearray(_SEGMENT_BLOCK)
    base = 0  # file offset of buf[0]
    filled = 0  # bytes of buf read from the file; after the last whole frame at the loop's top
    with open(path, "rb") as f:
        while True:
            if filled == len(buf):  # one frame longer than the buffer
                buf.extend(bytes(len(buf)))
            with memoryview(buf) as view, view[filled:] as room:
                n = f.readinto(room)
            filled += n
            eof = n == 0
            with memoryview(buf) as view, view[:filled] as data:
                result = scan(data, base, first_trans_id=expect, keep_after=keep_after)
                good = result.good_end_offset - base
                with data[:good] as frames:
                    offsets += [base + o for o in frame_offsets(frames)]
            if result.last_trans_id is not None:
                last_id = result.last_trans_id
                expect = last_id + 1
            if result.vote_at_keep_after is not None:
                vote_at = result.vote_at_keep_after
            keep(result.records, vote_at)
            problem = result.problem
            if problem is None and eof:
                return ScanResult([], base + good, None, last_id, vote_at), offsets, base + good
            if problem is None or (problem.kind == "torn" and not eof):
                buf[:filled - good] = buf[good:filled]  # the incomplete frame to the front
                filled -= good
                base += good
                continue
            # a problem: fine only if every byte from it to the end is a zero
            if buf.count(0, good, filled) != filled - good:
                return None
            end = base + filled
            while n := f.readinto(buf):
                if buf.count(0, 0, n) != n:
                    return None
                end += n
            return ScanResult([], base + good, problem, last_id, vote_at), offsets, end


def read_snapshot(snapshot_files: list[tuple[int, str]], report: Report,
                  sink_factory: Callable[[], Any] | None = None
                  ) -> tuple[tuple[int, int, Any] | None, list[tuple[int, str]]]:
    """Decode the newest valid snapshot, given (trans_id, path) newest first.
    Returns ((trans_id, vote_id, state) or None, the newer ones that did
    not decode, newest first: each is reported here and set aside by
    `settle_snapshots` once the log is known to cover it). Raises
    StorageError if one cannot be read. `sink_factory`: see
    `DiskStorage.recover`. Cost: reads each snapshot tried.
    """
    skipped: list[tuple[int, str]] = []
    for sid, path in snapshot_files:
        try:
            sink = sink_factory() if sink_factory is not None else None
            trans_id, vote_id, state = decode_snapshot(_read_blocks(path), sink)
            if trans_id != sid:
                raise ValueError(f"holds trans_id {trans_id}")
        except ValueError as exc:
            skipped.append((sid, path))
            report(f"{path}: corrupt snapshot skipped ({exc}); kept as {path}.corrupt")
            continue
        except OSError as exc:
            raise StorageError(path, None, f"cannot read: {exc.strerror or exc}") from exc
        return (trans_id, vote_id, state), skipped
    return None, skipped


def settle_snapshots(snapshot_files: list[tuple[int, str]],
                     chosen: tuple[int, int, Any] | None, skipped: list[tuple[int, str]],
                     log: LogFound) -> bool:
    """After `read_snapshot` and `recover_log`: set aside (rename
    `*.corrupt`) the snapshots that did not decode and remove valid ones
    older than the chosen one. Returns whether a file was renamed or
    removed (the directory needs an fsync). Raises StorageError if a
    corrupt snapshot holds what neither an older snapshot nor the log
    (`log.first_id`..`log.last_id`) covers."""
    dir_changed = False
    base = chosen[0] if chosen is not None else 0
    if skipped:
        newest_skipped, newest_path = skipped[0]
        if newest_skipped > base and not (log.first_id is not None and log.last_id is not None
                                          and log.first_id <= base + 1
                                          and log.last_id >= newest_skipped):
            raise StorageError(newest_path, None, f"corrupt snapshot, and neither an older "
                               f"snapshot nor the log covers trans_ids {base + 1}.."
                               f"{newest_skipped}")
        for _sid, path in skipped:
            os.replace(path, path + ".corrupt")
        dir_changed = True
    for sid, path in snapshot_files:  # older valid ones: left by a crash before their removal
        if sid < base:
            os.unlink(path)
            dir_changed = True
    return dir_changed


def fit_log_to_snapshot(found: LogFound, snapshot: tuple[int, int, Any] | None,
                        report: Report) -> LogFound:
    """The log after the snapshot, from `recover_log(..., keep_after=` the
    snapshot's trans_id`)`, which kept only the records above it; a log
    that predates the snapshot (ends before it, or has another vote_id at
    its trans_id) is removed and reported. Raises StorageError for a gap
    between the snapshot (or trans_id 1, without one) and the log."""
    segments = found.segments
    base = snapshot[0] if snapshot is not None else 0
    if snapshot is not None and found.first_id is not None and found.last_id is not None:
        log_first, log_last = found.first_id, found.last_id
        why = None  # set if the log predates the snapshot
        if log_last < base:
            why = f"ends at trans_id {log_last}"
        elif log_first <= base and found.vote_at_keep_after != snapshot[1]:
            why = (f"has vote_id {found.vote_at_keep_after} at trans_id {base}, the snapshot "
                   f"{snapshot[1]}")
        if why is not None:
            if found.applied_to is not None:  # (_Kept applies only a log that continues it)
                raise InvariantError(f"{segments[0].path}: records applied from a log that "
                                     f"predates the snapshot")
            for seg in segments:
                os.unlink(seg.path)
                report(f"{seg.path}: removed: the log {why}; it predates the snapshot "
                       f"at trans_id {base}")
            return LogFound([], [], [], True)
        if log_first > base + 1:
            raise StorageError(segments[0].path, 0, f"log starts at trans_id {log_first}, "
                               f"the snapshot ends at {base}: entries in between are missing")
        return found
    if found.first_id is not None and found.first_id != 1 and snapshot is None:
        raise StorageError(segments[0].path, 0, f"log starts at trans_id "
                           f"{found.first_id} and no snapshot covers what is before")
    return found
