"""A node's replicated state: the queues, and the log of the decisions that
built them.

- `store`: the queue state machine: messages and their indexes; `decide`
  (the master, with its clock) turns a request into an entry, `apply`
  (every node, no clock) plays an entry.
- `entries`: the log entries (the master's decisions) and the `Record` that
  places one in the log, with their wire form.
- `log`: the in-memory log, records ordered by trans_id, and its compaction.

This package does no I/O (tests/test_core_purity.py checks its imports).
Its public API is what it exports below; the modules' other names are
internal.
"""

from .entries import (
    Confirm,
    Consume,
    Entry,
    Kind,
    Noop,
    Produce,
    Record,
    entry_from_wire,
    entry_to_wire,
    record_from_wire,
    record_to_wire,
)
from .log import COMPACT_SLACK, LONE_LOG_RECORDS, Log
from .store import DEFAULT_TTL_MS, SnapshotLoader, Store

__all__ = [
    # store
    "Store",
    "SnapshotLoader",
    "DEFAULT_TTL_MS",
    # entries
    "Entry",
    "Kind",
    "Noop",
    "Produce",
    "Consume",
    "Confirm",
    "Record",
    "entry_to_wire",
    "entry_from_wire",
    "record_to_wire",
    "record_from_wire",
    # log
    "Log",
    "COMPACT_SLACK",
    "LONE_LOG_RECORDS",
]
