"""Reading a data directory back after a restart or a crash.

Theory of operation
-------------------
`DiskStorage.recover()` (in `qserver.storage.disk`) lists the directory,
names the files, and composes the functions here; they read the files, make
the few repairs recovery makes (cut a torn tail, set aside a corrupt
snapshot, remove a log that predates a snapshot), and return what they
found. The caller sets its own state from that and fsyncs the directory when
a function says it removed or renamed a file.

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

from ..errors import QServerError
from ..state.entries import Record
from .format import decode_snapshot, decode_vote, resync, scan

# Snapshots are read back in blocks of this size.
_READ_BLOCK = 1024 * 1024

# The smallest unit a disk writes whole. Records written over the zeros
# ahead reach the disk page by page, in any order, until a sync: after a
# power loss, a sector of zeros can lie between records that did arrive.
_SECTOR_BYTES = 512
_ZERO_SECTOR = bytes(_SECTOR_BYTES)

Report = Callable[[str], None]  # takes a line for `Recovered.reports`


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

    records: list[Record]  # every record kept, in trans_id order
    segments: list[Segment]  # the segments that hold them, oldest first
    last_buf: bytes | memoryview  # the last segment's valid frames (b"" if none)
    dir_changed: bool  # a segment file was removed: the directory needs an fsync


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


def recover_log(segment_files: list[tuple[int, str]], report: Report) -> LogFound:
    """Read the segments, given as (first trans_id, path) in trans_id order.

    Cuts a torn tail of the last segment (durably) and removes a last
    segment left with no records; each cut is reported. Raises StorageError
    for a gap between segments or damage that is not a torn tail (see the
    module docstring). Cost: reads every segment.
    """
    records: list[Record] = []
    segments: list[Segment] = []
    last_buf: bytes | memoryview = b""
    dir_changed = False
    expect: int | None = None  # first trans_id of the next segment
    for i, (first, path) in enumerate(segment_files):
        is_last = i == len(segment_files) - 1
        if expect is not None and first != expect:
            raise StorageError(path, 0, f"log gap: the previous segment ends at trans_id "
                               f"{expect - 1}, this one starts at {first}")
        buf = read_file(path)
        result = scan(buf, first_trans_id=first)
        good_end = result.good_end_offset
        problem = result.problem
        allocated = good_end
        if problem is not None and _zeros_from(buf, good_end):
            allocated = len(buf)  # zeros written ahead of the records: not a problem
        elif problem is not None:
            after = result.records[-1].trans_id if result.records else first - 1
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
        expect = first + len(result.records)
        if good_end == 0 and is_last:  # holds nothing: start afresh on append
            os.unlink(path)
            dir_changed = True
            continue
        records.extend(result.records)
        segments.append(Segment(first, path, good_end, allocated))
        last_buf = buf if good_end == len(buf) else memoryview(buf)[:good_end]  # no copy
    return LogFound(records, segments, last_buf, dir_changed)


def recover_snapshot(snapshot_files: list[tuple[int, str]], records: list[Record],
                     report: Report, sink_factory: Callable[[], Any] | None = None
                     ) -> tuple[tuple[int, int, Any] | None, bool]:
    """Decode the newest valid snapshot, given (trans_id, path) newest first,
    and return ((trans_id, vote_id, state) or None, whether a file was
    renamed or removed: the directory needs an fsync).

    Corrupt ones newer than it are renamed `*.corrupt` and reported, valid
    older ones removed. Raises StorageError if a corrupt snapshot holds
    what neither an older snapshot nor `records` covers, or one cannot be
    read. `sink_factory`: see `DiskStorage.recover`. Cost: reads each
    snapshot tried.
    """
    chosen = None
    dir_changed = False
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
        chosen = (trans_id, vote_id, state)
        break
    base = chosen[0] if chosen is not None else 0
    if skipped:
        newest_skipped, newest_path = skipped[0]
        if newest_skipped > base and not (records and records[0].trans_id <= base + 1
                                          and records[-1].trans_id >= newest_skipped):
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
    return chosen, dir_changed


def fit_log_to_snapshot(found: LogFound, snapshot: tuple[int, int, Any] | None,
                        report: Report) -> LogFound:
    """The log after the snapshot: records at or below it are dropped; a log
    that predates it (ends before it, or has another vote_id at its
    trans_id) is removed and reported. Raises StorageError for a gap
    between the snapshot (or trans_id 1, without one) and the log."""
    records, segments = found.records, found.segments
    base = snapshot[0] if snapshot is not None else 0
    if snapshot is not None and records:
        log_first, log_last = records[0].trans_id, records[-1].trans_id
        at = records[base - log_first] if log_first <= base <= log_last else None
        why = None  # set if the log predates the snapshot
        if log_last < base:
            why = f"ends at trans_id {log_last}"
        elif at is not None and at.vote_id != snapshot[1]:
            why = f"has vote_id {at.vote_id} at trans_id {base}, the snapshot {snapshot[1]}"
        if why is not None:
            for seg in segments:
                os.unlink(seg.path)
                report(f"{seg.path}: removed: the log {why}; it predates the snapshot "
                       f"at trans_id {base}")
            return LogFound([], [], b"", True)
        if log_first > base + 1:
            raise StorageError(segments[0].path, 0, f"log starts at trans_id {log_first}, "
                               f"the snapshot ends at {base}: entries in between are missing")
        return found._replace(records=records[base + 1 - log_first:])
    if records and records[0].trans_id != 1:
        raise StorageError(segments[0].path, 0, f"log starts at trans_id "
                           f"{records[0].trans_id} and no snapshot covers what is before")
    return found
