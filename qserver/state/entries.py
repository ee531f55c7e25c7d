"""Log entries: the decisions the master made, in a form any node can apply.

Theory of operation
-------------------
A client request is turned into an entry by `Store.decide()` on the master.
The entry records every decision that depended on the master's clock or on
its choice: the msg_id of a new message, the absolute ready time and ttl in
milliseconds, which message a consume delivered and when it comes back.
Applying an entry (`Store.apply()`) therefore never reads a clock or a
random source, so every node that applies the same entries in the same order
ends with the same state.

Each entry travels and is stored inside a `Record` that carries its global
position (`trans_id`, gap-free from 1) and the election epoch (`vote_id`)
under which the master wrote it.

Rules
- Entries are immutable values; nothing mutates one after `decide()`.
  They are NamedTuples rather than the house style's frozen dataclasses, on
  purpose: a produce creates an entry and a record on the hot path, and
  tuples are cheaper to build. They are not, however, untracked by the
  cyclic garbage collector as plain tuples of atoms are (CPython untracks
  exact tuples only): a retained log record and its entry are two objects
  that every full collection scans, most of its pause on a node with a
  long log (bench/gc_bench.py). Built with `tuple.__new__` on the hot
  paths (no NamedTuple `__new__` in Python), they still cost about 2,600
  more instructions per record than plain tuples would (construction and
  tracking, measured under callgrind).
- The wire/disk form is a plain list (msgpack friendly), tagged by `Kind`.
  `entry_from_wire` validates a list that came from a peer or a disk and
  raises `ValueError` on anything malformed; it never returns a half entry.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from ..wire.requests import (
    MAX_DEDUP_WINDOW_MS,
    MAX_DELIVERIES,
    MAX_PRIORITY,
    MAX_QUEUE_SIZE,
    PAUSED_STATES,
)

__all__ = [
    "Kind",
    "Noop",
    "Produce",
    "Consume",
    "Confirm",
    "ConsumeMany",
    "Nack",
    "Touch",
    "DeadLetter",
    "Configure",
    "ProduceBatch",
    "Clear",
    "FINAL_NONE",
    "FINAL_MAX_DELIVERIES",
    "FINAL_EXPIRED",
    "SETTINGS",
    "Entry",
    "Record",
    "entry_to_wire",
    "entry_from_wire",
    "record_to_wire",
    "record_from_wire",
    "PRODUCE_WIRE_HEAD",
    "entry_weight",
]


class Kind(enum.IntEnum):
    NOOP = 0
    PRODUCE = 1
    CONSUME = 2
    CONFIRM = 3
    CONSUME_MANY = 4
    NACK = 5
    TOUCH = 6
    DEAD_LETTER = 7
    CONFIGURE = 8
    PRODUCE_BATCH = 9
    CLEAR = 10


# What happens when a delivery's lease runs out unconfirmed (`final`): it
# comes back (FINAL_NONE), or it was the message's last delivery and the
# message leaves its queue, to the dead-letter queue or deleted, for this
# reason. The numbers are stored; the names are what show answers.
FINAL_NONE = 0
FINAL_MAX_DELIVERIES = 1  # delivered max_deliveries times
FINAL_EXPIRED = 2  # its ttl ended its retries


class Noop(NamedTuple):
    """An entry that changes nothing; a new master writes one to commit the
    entries of earlier epochs (the replication issue uses it)."""


class Produce(NamedTuple):
    """New message(s): one per real queue, all or nothing.

    `targets` holds (queue, msg_id) pairs; a plain queue has one, a virtual
    queue one per real queue, in the configured order.
    """

    targets: tuple[tuple[str, int], ...]
    data: str
    ready_ms: int  # absolute unix ms at which the message may be delivered
    ttl_ms: int  # absolute unix ms; a delivery whose next retry reaches it is the last
    retry_ms: int  # 0 = at-most-once; > 0 = redelivered this long after a consume


class Consume(NamedTuple):
    """Delivery of `msg_id` from `queue`.

    `retry_at_ms` is the absolute time at which the lease runs out: the
    message becomes deliverable again unless confirmed (or, if `final` is
    not FINAL_NONE, leaves the queue then); 0 means the message is deleted
    by this delivery (at-most-once, or its last delivery before the ttl).
    `epoch` names the master that decided it (its vote_id, or the raft
    engine's epoch number): the delivery's receipt is (epoch, msg_id,
    deliveries), unique across failovers because one epoch has one master
    and a message's deliveries only grow. 0 = no receipt (entries written
    before receipts existed; at-most-once and last deliveries).
    """

    queue: str
    msg_id: int
    retry_at_ms: int
    epoch: int = 0
    final: int = FINAL_NONE


class ConsumeMany(NamedTuple):
    """Several deliveries decided together (a consume with `count`, or
    from several queues): (queue, msg_id, retry_at_ms, final) each, in
    delivery order, as `Consume`'s fields."""

    items: tuple[tuple[str, int, int, int], ...]
    epoch: int


class Nack(NamedTuple):
    """An in-flight message given back: deliverable again at `ready_ms`
    (its lease ends, its nacks count grows)."""

    queue: str
    msg_id: int
    ready_ms: int


class Touch(NamedTuple):
    """An in-flight message's lease changed: it runs out at `retry_at_ms`;
    `final` as in `Consume` (a lease reaching the ttl makes it final)."""

    queue: str
    msg_id: int
    retry_at_ms: int
    final: int


class DeadLetter(NamedTuple):
    """`msg_id` leaves `queue` for `reason` (FINAL_MAX_DELIVERIES or
    FINAL_EXPIRED): deleted, and produced as a new message into each of
    `targets` ((queue, msg_id) pairs: the dead-letter queue, or its real
    queues if it is virtual; empty without a dead-letter queue), ready at
    `ready_ms`, with a fresh ttl `ttl_ms` and the origin fields."""

    queue: str
    msg_id: int
    reason: int
    targets: tuple[tuple[str, int], ...]
    ready_ms: int
    ttl_ms: int


class Configure(NamedTuple):
    """A queue's settings changed: (name, value) pairs of SETTINGS. Creates
    the queue if it does not exist."""

    queue: str
    settings: tuple[tuple[str, object], ...]


class ProduceBatch(NamedTuple):
    """New messages with what a plain `Produce` has not: a batch, a
    priority, a dedup id. One entry, all or nothing.

    `queue` is the name the client produced to (a real or a virtual queue):
    its dedup table records the items' dedup ids. `targets` holds (real
    queue, first msg_id) pairs: item k (0-based) becomes message
    first + k in each of them. `items` are (data, ready_ms, ttl_ms,
    retry_ms, priority, dedup_id) with dedup_id "" for none; duplicates are
    not in the entry (the master found them in the table). `accepted_ms`
    is the master's clock when it decided: the time the dedup table
    records. Before adding, the table drops the ids accepted at or before
    `cutoff_ms` (accepted_ms minus the queue's dedup window): pruned by
    entry times, never a node's own clock."""

    queue: str
    targets: tuple[tuple[str, int], ...]
    items: tuple[tuple[str, int, int, int, int, str], ...]
    accepted_ms: int
    cutoff_ms: int


class Clear(NamedTuple):
    """Every message of `queue` removed (action 6); its settings, max_id
    and dedup table stay."""

    queue: str


class Confirm(NamedTuple):
    """Deletion of a delivered (or still pending) message by its consumer."""

    queue: str
    msg_id: int


Entry = (Noop | Produce | Consume | Confirm | ConsumeMany | Nack | Touch | DeadLetter | Configure
         | ProduceBatch | Clear)


def _max_deliveries(value: object) -> int:
    if type(value) is not int or not 0 <= value <= MAX_DELIVERIES:
        raise ValueError(f"must be an integer from 0 to {MAX_DELIVERIES}")
    return value


def _dead_letter(value: object) -> str:
    # "" = none; otherwise a queue name (the request layer checks its length)
    if type(value) is not str or len(value) > 255:
        raise ValueError("must be a queue name")
    return value


def _max_size(value: object) -> int:
    # 0 = the node's queue_size
    if type(value) is not int or not 0 <= value <= MAX_QUEUE_SIZE:
        raise ValueError(f"must be an integer from 0 to {MAX_QUEUE_SIZE}")
    return value


def _dedup_window_ms(value: object) -> int:
    if type(value) is not int or not 0 <= value <= MAX_DEDUP_WINDOW_MS:
        raise ValueError(f"must be an integer from 0 to {MAX_DEDUP_WINDOW_MS}")
    return value


def _paused(value: object) -> str:
    if value not in PAUSED_STATES or type(value) is not str:
        raise ValueError(f"must be one of {', '.join(PAUSED_STATES)}")
    return value


# A queue's settings, each with its check (raises ValueError) and default
# (the value in force when neither config (5) nor the node's XML set it).
SETTINGS: dict[str, tuple[Any, object]] = {
    "max_deliveries": (_max_deliveries, 0),  # 0 = unlimited
    "dead_letter": (_dead_letter, ""),  # "" = none: such messages are deleted
    "max_size": (_max_size, 0),  # 0 = the node's queue_size
    "dedup_window_ms": (_dedup_window_ms, 300_000),  # SQS FIFO's 5 minutes; 0 = off
    "paused": (_paused, "none"),
}


class Record(NamedTuple):
    """An entry at its place in the log."""

    trans_id: int  # global position, gap-free, starting at 1
    vote_id: int  # election epoch of the master that wrote it
    entry: Entry


def entry_to_wire(entry: Entry) -> list[Any]:
    """Encode an entry as a msgpack-friendly list."""
    if type(entry) is Produce:
        return [Kind.PRODUCE, [list(t) for t in entry.targets], entry.data,
                entry.ready_ms, entry.ttl_ms, entry.retry_ms]
    if type(entry) is Consume:
        if entry.epoch or entry.final:
            return [Kind.CONSUME, entry.queue, entry.msg_id, entry.retry_at_ms, entry.epoch,
                    entry.final]
        return [Kind.CONSUME, entry.queue, entry.msg_id, entry.retry_at_ms]
    if type(entry) is Confirm:
        return [Kind.CONFIRM, entry.queue, entry.msg_id]
    if type(entry) is Noop:
        return [Kind.NOOP]
    if type(entry) is ConsumeMany:
        return [Kind.CONSUME_MANY, [list(i) for i in entry.items], entry.epoch]
    if type(entry) is Nack:
        return [Kind.NACK, entry.queue, entry.msg_id, entry.ready_ms]
    if type(entry) is Touch:
        return [Kind.TOUCH, entry.queue, entry.msg_id, entry.retry_at_ms, entry.final]
    if type(entry) is DeadLetter:
        return [Kind.DEAD_LETTER, entry.queue, entry.msg_id, entry.reason,
                [list(t) for t in entry.targets], entry.ready_ms, entry.ttl_ms]
    if type(entry) is Configure:
        return [Kind.CONFIGURE, entry.queue, [list(s) for s in entry.settings]]
    if type(entry) is ProduceBatch:
        return [Kind.PRODUCE_BATCH, entry.queue, [list(t) for t in entry.targets],
                [list(i) for i in entry.items], entry.accepted_ms, entry.cutoff_ms]
    if type(entry) is Clear:
        return [Kind.CLEAR, entry.queue]
    raise TypeError(f"not an entry: {entry!r}")


def _int(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _id(value: object, what: str) -> int:
    # msg_ids and trans_ids start at 1: a 0 is malformed, and must be refused
    # here (a peer's fault) rather than fail later in apply (our fault).
    if type(value) is not int or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _str(value: object, what: str) -> str:
    if type(value) is not str:
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    return value


def _final(value: object) -> int:
    # The type first: compiled (qserver.compiled), `in` on a tuple of ints
    # narrows `value` to int and would take True or 1.0 for 1.
    if type(value) is not int or value not in (FINAL_NONE, FINAL_MAX_DELIVERIES, FINAL_EXPIRED):
        raise ValueError(f"final must be 0, 1 or 2, got {value!r}")
    return value


def _targets(raw: object, *, empty: bool) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, (list, tuple)) or (not raw and not empty):
        raise ValueError("targets must be a non-empty list")
    targets = []
    for t in raw:
        if not isinstance(t, (list, tuple)) or len(t) != 2:
            raise ValueError("target must be [queue, msg_id]")
        targets.append((_str(t[0], "queue"), _id(t[1], "msg_id")))
    if len({name for name, _ in targets}) != len(targets):
        raise ValueError("targets name a queue twice")
    return tuple(targets)


def _settings(raw: object) -> tuple[tuple[str, object], ...]:
    if not isinstance(raw, (list, tuple)):
        raise ValueError("settings must be a list")
    out = []
    for pair in raw:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError("setting must be [name, value]")
        name, value = pair
        known = SETTINGS.get(name) if type(name) is str else None
        if known is None:
            raise ValueError(f"unknown setting {name!r}")
        try:
            out.append((name, known[0](value)))
        except ValueError as exc:
            raise ValueError(f"setting {name}: {exc}") from None
    return tuple(out)


def _batch_items(raw: object) -> tuple[tuple[str, int, int, int, int, str], ...]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError("batch items must be a non-empty list")
    items = []
    for item in raw:
        if not isinstance(item, (list, tuple)) or len(item) != 6:
            raise ValueError("batch item must be [data, ready_ms, ttl_ms, retry_ms, priority, "
                             "dedup_id]")
        priority = item[4]
        if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be an integer from 0 to {MAX_PRIORITY}")
        items.append((_str(item[0], "data"), _int(item[1], "ready_ms"), _int(item[2], "ttl_ms"),
                      _int(item[3], "retry_ms"), priority, _str(item[5], "dedup_id")))
    return tuple(items)


def entry_from_wire(obj: object) -> Entry:
    """Decode and validate an entry; raises ValueError when malformed."""
    if not isinstance(obj, (list, tuple)) or not obj:
        raise ValueError("entry must be a non-empty list")
    kind = obj[0]
    # Not `kind == Kind.X` alone: True == 1 and 1.0 == 1 would pass it.
    if type(kind) is not int and type(kind) is not Kind:
        raise ValueError(f"entry kind must be an integer, got {kind!r}")
    if kind == Kind.PRODUCE and len(obj) == 6:
        return Produce(targets=_targets(obj[1], empty=False), data=_str(obj[2], "data"),
                       ready_ms=_int(obj[3], "ready_ms"), ttl_ms=_int(obj[4], "ttl_ms"),
                       retry_ms=_int(obj[5], "retry_ms"))
    if kind == Kind.CONSUME and len(obj) in (4, 6):
        return Consume(queue=_str(obj[1], "queue"), msg_id=_id(obj[2], "msg_id"),
                       retry_at_ms=_int(obj[3], "retry_at_ms"),
                       epoch=_int(obj[4], "epoch") if len(obj) == 6 else 0,
                       final=_final(obj[5]) if len(obj) == 6 else FINAL_NONE)
    if kind == Kind.CONFIRM and len(obj) == 3:
        return Confirm(queue=_str(obj[1], "queue"), msg_id=_id(obj[2], "msg_id"))
    if kind == Kind.NOOP and len(obj) == 1:
        return Noop()
    if kind == Kind.CONSUME_MANY and len(obj) == 3:
        raw = obj[1]
        if not isinstance(raw, (list, tuple)) or not raw:
            raise ValueError("consume items must be a non-empty list")
        items = []
        for item in raw:
            if not isinstance(item, (list, tuple)) or len(item) != 4:
                raise ValueError("consume item must be [queue, msg_id, retry_at_ms, final]")
            items.append((_str(item[0], "queue"), _id(item[1], "msg_id"),
                          _int(item[2], "retry_at_ms"), _final(item[3])))
        if len({(q, i) for q, i, _, _ in items}) != len(items):
            raise ValueError("consume items name a message twice")
        return ConsumeMany(items=tuple(items), epoch=_int(obj[2], "epoch"))
    if kind == Kind.NACK and len(obj) == 4:
        return Nack(queue=_str(obj[1], "queue"), msg_id=_id(obj[2], "msg_id"),
                    ready_ms=_int(obj[3], "ready_ms"))
    if kind == Kind.TOUCH and len(obj) == 5:
        return Touch(queue=_str(obj[1], "queue"), msg_id=_id(obj[2], "msg_id"),
                     retry_at_ms=_id(obj[3], "retry_at_ms"), final=_final(obj[4]))
    if kind == Kind.DEAD_LETTER and len(obj) == 7:
        reason = _final(obj[3])
        if reason == FINAL_NONE:
            raise ValueError("dead letter needs a reason")
        return DeadLetter(queue=_str(obj[1], "queue"), msg_id=_id(obj[2], "msg_id"),
                          reason=reason, targets=_targets(obj[4], empty=True),
                          ready_ms=_int(obj[5], "ready_ms"), ttl_ms=_int(obj[6], "ttl_ms"))
    if kind == Kind.CONFIGURE and len(obj) == 3:
        return Configure(queue=_str(obj[1], "queue"), settings=_settings(obj[2]))
    if kind == Kind.PRODUCE_BATCH and len(obj) == 6:
        return ProduceBatch(queue=_str(obj[1], "queue"), targets=_targets(obj[2], empty=False),
                            items=_batch_items(obj[3]), accepted_ms=_int(obj[4], "accepted_ms"),
                            cutoff_ms=_int(obj[5], "cutoff_ms"))
    if kind == Kind.CLEAR and len(obj) == 2:
        return Clear(queue=_str(obj[1], "queue"))
    raise ValueError(f"unknown entry kind {kind!r} with {len(obj)} fields")


def _text_bytes(text: str) -> int:
    # UTF-8 takes at most 4 bytes a code point, 1 for ASCII (isascii is O(1))
    return len(text) if text.isascii() else 4 * len(text)


def entry_weight(entry: Entry) -> int:
    """About how many bytes an entry takes on the wire, from above for the
    kinds that carry client data: what the replication layer counts to
    keep one message far below the peer frame limit. O(1), O(b) for a
    batch of b."""
    if type(entry) is Produce:
        return 48 + _text_bytes(entry.data) + 24 * len(entry.targets)
    if type(entry) is ProduceBatch:
        weight = 64 + 24 * len(entry.targets)
        for item in entry.items:
            weight += 40 + _text_bytes(item[0]) + _text_bytes(item[5])
        return weight
    if type(entry) is ConsumeMany:
        return 16 + 32 * len(entry.items)
    return 64  # the others: a queue name and a few ints


def record_to_wire(record: Record) -> list[Any]:
    """Encode a record as [trans_id, vote_id, entry]."""
    return [record.trans_id, record.vote_id, entry_to_wire(record.entry)]


_new = tuple.__new__
_PRODUCE = int(Kind.PRODUCE)
# A produce entry's wire list is its kind, then its fields: the hot encoders
# (a push, a payload on disk) build it as this 1-tuple joined to the entry,
# one C-level concatenation; msgpack writes a tuple as the array a list
# would be, so the bytes are record_to_wire's (tests hold it).
PRODUCE_WIRE_HEAD = (_PRODUCE,)


def record_from_wire(obj: object) -> Record:
    """Decode and validate a record; raises ValueError when malformed."""
    if type(obj) is list and len(obj) == 3:
        # The common record, a produce to one queue as msgpack gives it: the
        # checks of the general path below, inline (a restart decodes every
        # record of its log, a slave every record pushed). Anything else,
        # valid or not, takes the general path.
        trans_id, vote_id, e = obj
        if (type(e) is list and len(e) == 6 and type(trans_id) is int and trans_id >= 1
                and type(vote_id) is int and vote_id >= 0):
            kind, targets, data, ready_ms, ttl_ms, retry_ms = e
            if (type(kind) is int and kind == _PRODUCE and type(targets) is list
                    and len(targets) == 1 and type(targets[0]) is list and len(targets[0]) == 2
                    and type(data) is str and type(ready_ms) is int and ready_ms >= 0
                    and type(ttl_ms) is int and ttl_ms >= 0 and type(retry_ms) is int
                    and retry_ms >= 0):
                name, msg_id = targets[0]
                if type(name) is str and type(msg_id) is int and msg_id >= 1:
                    return _new(Record, (trans_id, vote_id, _new(Produce, (
                        ((name, msg_id),), data, ready_ms, ttl_ms, retry_ms))))
    if not isinstance(obj, (list, tuple)) or len(obj) != 3:
        raise ValueError("record must be [trans_id, vote_id, entry]")
    return Record(trans_id=_id(obj[0], "trans_id"), vote_id=_int(obj[1], "vote_id"),
                  entry=entry_from_wire(obj[2]))
