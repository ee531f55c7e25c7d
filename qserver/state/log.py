"""The in-memory replicated log: records ordered by trans_id.

Theory of operation
-------------------
The log is a gap-free run of `Record`s, trans_id `first` .. `last`. Entries
before `first` have been compacted away: their effect lives in the state
machine (and, once storage lands, in a snapshot), described by
`base_trans_id` / `base_vote_id`, the position of the last compacted entry.

A position is the pair (vote_id, trans_id) of a record; `last_position()` is
what an election compares first (design.md section 2: the last entry's epoch
before its trans_id).

Rules
- `append` only at `last + 1`; anything else is a bug in the caller.
- `truncate_after(t)` drops every record after trans_id t (a diverging
  slave); it never drops below the compaction base.
- `compact(keep)` keeps at most `keep` records (queue_server's log_size).

This module does no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvariantError
from .entries import Entry, Record

__all__ = ["Log", "COMPACT_SLACK", "LONE_LOG_RECORDS"]

_new = tuple.__new__

# Compaction runs when the log holds this many records over its bound, not on
# every append: one prefix deletion (an O(n) move of the list) per 1,024
# appends instead of one per append.
COMPACT_SLACK = 1024

# A node alone (no peers) has nobody to read its in-memory log: no slave
# pulls from it, and a restart replays the disk, not memory. So it keeps at
# most this many records (fewer if log_size says so), not log_size. Records
# this short-lived are freed by reference counting before the garbage
# collector's next pass (every 100,000 net allocations, node.GC_THRESHOLDS),
# so the collector never scans them, and a million-message node does not
# hold log_size records of them (bench/hotpath.py, bench/durability_bench.py).
LONE_LOG_RECORDS = 2048


class Log:
    """A bounded, trans_id-ordered run of records."""

    def __init__(self, *, base_trans_id: int = 0, base_vote_id: int = 0) -> None:
        # records[i].trans_id == base_trans_id + 1 + i. A list, not a deque:
        # get() in the middle is O(1) (a deque's is O(n/64), which made
        # replaying a long log quadratic); compaction drops a prefix of at
        # least COMPACT_SLACK records at once, so its O(n) move is amortized.
        self.records: list[Record] = []
        self.base_trans_id = base_trans_id  # last trans_id compacted away (0: none)
        self.base_vote_id = base_vote_id  # vote_id of that record

    @property
    def first_trans_id(self) -> int:
        """trans_id of the oldest retained record (base + 1 even when empty)."""
        return self.base_trans_id + 1

    @property
    def last_trans_id(self) -> int:
        return self.base_trans_id + len(self.records)

    def last_position(self) -> tuple[int, int]:
        """(vote_id, trans_id) of the newest record, or of the base."""
        if self.records:
            r = self.records[-1]
            return r.vote_id, r.trans_id
        return self.base_vote_id, self.base_trans_id

    def __len__(self) -> int:
        return len(self.records)

    def append_entry(self, entry: Entry, vote_id: int) -> Record:
        """Append `entry` as the next record under `vote_id`. O(1)."""
        records = self.records
        # tuple.__new__: the same Record, without NamedTuple's Python-level
        # __new__ (this runs on every write).
        record = _new(Record, (self.base_trans_id + len(records) + 1, vote_id, entry))
        records.append(record)
        return record

    def append(self, record: Record) -> None:
        """Append a record received from elsewhere (or read back from
        disk); it must be the next. O(1)."""
        records = self.records
        if record.trans_id != self.base_trans_id + len(records) + 1:  # (runs on every write)
            raise InvariantError(f"append of trans_id {record.trans_id} after {self.last_trans_id}")
        records.append(record)

    def extend(self, records: Sequence[Record]) -> None:
        """Append consecutive records received from elsewhere (a push), the
        first of them the next. O(len(records)); only the two ends are
        checked: the caller holds them consecutive (a push's decoder
        checks every one)."""
        if records:
            first = self.base_trans_id + len(self.records) + 1
            if records[0].trans_id != first or records[-1].trans_id != first + len(records) - 1:
                raise InvariantError(f"extend with trans_ids {records[0].trans_id}.."
                                     f"{records[-1].trans_id} after {first - 1}")
            self.records.extend(records)

    def get(self, trans_id: int) -> Record | None:
        """The record at trans_id, or None if compacted or not yet there. O(1)."""
        i = trans_id - self.base_trans_id - 1
        if 0 <= i < len(self.records):
            return self.records[i]
        return None

    def vote_id_at(self, trans_id: int) -> int | None:
        """vote_id of the record at trans_id (the base counts), or None."""
        if trans_id == self.base_trans_id:
            return self.base_vote_id
        r = self.get(trans_id)
        return None if r is None else r.vote_id

    def slice(self, start: int, limit: int) -> list[Record]:
        """At most `limit` records from trans_id `start` on. O(limit).
        Raises InvariantError if `start` is compacted away: a caller that
        needs those records must send a snapshot, never skip them."""
        if start <= self.base_trans_id:
            raise InvariantError(f"slice from {start}: compacted up to {self.base_trans_id}")
        i = start - self.base_trans_id - 1
        return self.records[i:i + limit]

    def truncate_after(self, trans_id: int) -> int:
        """Drop every record after `trans_id`; returns how many. O(dropped)."""
        if trans_id < self.base_trans_id:
            raise InvariantError(
                f"truncate to {trans_id} below compaction base {self.base_trans_id}")
        keep = max(0, trans_id - self.base_trans_id)
        dropped = max(0, len(self.records) - keep)
        del self.records[keep:]
        return dropped

    def compact(self, keep: int, upto: int) -> int:
        """Drop the oldest records so that at most `keep` remain, never past
        trans_id `upto` (what is applied). Returns how many. O(dropped)."""
        records = self.records
        # records[0].trans_id == base_trans_id + 1, so the records at or
        # below `upto` are the first upto - base_trans_id.
        dropped = min(len(records) - keep, upto - self.base_trans_id)
        if dropped <= 0:
            return 0
        r = records[dropped - 1]
        del records[:dropped]
        self.base_trans_id, self.base_vote_id = r.trans_id, r.vote_id
        return dropped
