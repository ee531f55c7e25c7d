"""The queue state machine: messages, the pending indexes and the retry index.

Theory of operation
-------------------
A `Store` holds named `Queue`s. A queue holds its messages in a dict by
msg_id and indexes every message in exactly one of three places:

- `fifo`: a deque of msg_ids of never-delivered messages, in
  non-decreasing ready time (and increasing id) from head to tail;
- `pending`: the keys of the other never-delivered messages (those that
  came in out of ready-time order, e.g. a delayed produce followed by
  undelayed ones), sorted by ready time;
- `retrying`: messages delivered at-least-once and not yet confirmed, keyed
  by the time at which they become deliverable again (the retry deadline).

A key is one int, `time_ms << 64 | msg_id`, so that the sorted lists sort by
time and then by id (FIFO among messages with the same time) without
allocating a tuple per message. The FIFO is in the same (ready time, id)
order but holds no key: most messages are produced in time order (ready
now, ids increasing), so they are appended to the FIFO as the msg_id int
that is already the dict key, and a head's key is computed when needed.
That saves the ~48 bytes of a key and its list slot per message (a node
with a million 100-byte messages: 423 MB -> 375 MB RSS).

FIFO rules (apply reads no clock, so they depend only on the entries):
- A produce goes to the FIFO's tail when the FIFO is empty or its ready
  time is >= `fifo_ready` (at least the tail's ready time); otherwise its
  key goes to `pending`. A snapshot load does the same in msg_id order.
  So a delayed produce at the tail sends the produces after it to
  `pending` until the clock reaches its ready time (or it leaves the FIFO):
  a delay's worth of produces pay for keys, as all did before the FIFO.
- A consume delivers the earliest of the FIFO's head, `pending`'s head and
  `retrying`'s head, and takes the FIFO's head with a popleft.
- Deleting a never-delivered message (confirm, revert) takes it from the
  FIFO's head or tail in O(1), from `pending` in O(log n), or from the
  middle of the FIFO in O(n) (`deque.remove`: only a confirm of a message
  never delivered, or a revert, gets there). There are no tombstones.
- A revert puts a never-delivered message back at the FIFO's head or tail
  when that keeps its order, else into `pending`: any never-delivered
  message may be in `pending`, and `to_wire()` does not see which index
  holds a message.

Two steps change state, and they are kept apart on purpose:

1. `decide(request, now_ms)` runs on the master only. It reads the state and
   the clock and returns either a reply (nothing to change: an empty
   consume, a full queue, a bad time) or an `Entry` that records every
   decision: the msg_id, the absolute times, which message a consume
   delivered and its new retry deadline.
2. `apply(entry)` runs on every node, for every entry, in log order. It reads
   no clock: replaying the same entries gives the same state on any node.

The master applies its own entry right after deciding it (so that the next
decision sees it); the replication layer decides when the client hears.

Rules (queue_server's semantics, see design.md section 1)
- A consume delivers the message with the earliest time among the heads of
  `fifo` and `pending` (ready time <= now) and the head of `retrying`
  (deadline <= now).
- retry = 0: the message is deleted when it is delivered (at-most-once).
- retry > 0: it moves to `retrying` at now + retry, unless that deadline
  reaches its ttl, in which case this delivery is the last and deletes it.
- An expired message that was never delivered is still delivered once.
- A confirm deletes the message wherever it is; an unknown id is not an error.
- Queues come into being with their first produce (a logged entry), so every
  node lists the same queues. Consuming or monitoring an unknown queue does
  not create it.

This module does no I/O.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain, takewhile
from typing import Any, Final

from sortedcontainers import SortedList

from ..errors import InvariantError
from ..wire.requests import (
    DEFAULT_PRIORITY,
    RELATIVE_TIME_LIMIT_S,
    ConfirmRequest,
    ConsumeRequest,
    ProduceBatchRequest,
    ProduceRequest,
)
from .entries import (
    FINAL_EXPIRED,
    FINAL_MAX_DELIVERIES,
    FINAL_NONE,
    SETTINGS,
    Clear,
    Configure,
    Confirm,
    Consume,
    ConsumeMany,
    DeadLetter,
    Entry,
    Nack,
    Noop,
    Produce,
    ProduceBatch,
    Touch,
)

__all__ = ["Message", "Queue", "Store", "SnapshotLoader", "DedupTable", "DEFAULT_TTL_MS",
           "WAIT_STATUS_SAMPLE", "Receipt", "receipt_text", "message_view", "REASON_NAMES",
           "DEFAULT_PRIORITY", "DEDUP_MAX_IDS"]

_ID_BITS = 64
_ID_MASK = (1 << _ID_BITS) - 1
# A prioritized message's key in `pready`: priority << 128 | time << 64 | id.
_PRIO_SHIFT = 128

# Builds a NamedTuple entry from a tuple of its fields: the same value as
# Produce(...), without the Python-level __new__ that NamedTuple generates
# (under half the cost; an entry is built on every write). Only for tuples
# in field order.
_new = tuple.__new__

# queue_server's default lifetime for a message produced without ttl.
DEFAULT_TTL_MS = 3_600_000

# Undo record tags (see Store.apply's `undo` and Store.revert).
_UNPRODUCE = "unproduce"  # (tag, queue, msg_id, previous max_id, queue created)
_RESTORE = "restore"  # (tag, queue, msg_id, the Message as it was)
_RECOUNT = "recount"  # (tag, queue, dead_lettered as it was)
_RESET = "reset"  # (tag, queue, explicit settings as they were, queue created)
_UNPRODUCE_MANY = "unproduce many"  # (tag, queue, first msg_id, count, previous max_id, created)
_UNCLEAR = "unclear"  # (tag, queue, its message containers as they were)
_UNDEDUP = "undedup"  # (tag, table owner, virtual, DedupTable changes)

# A dedup table holds at most this many ids (per queue): at ~300 bytes an id
# of 36 characters (bench/producer_bench.py measures it: the id string 85,
# the (ref, time) tuple 56, the msg_id 28, the OrderedDict's slot and node
# ~90), 1,000,000 ids are ~285 MB, the bound of one queue's table. Past it
# the oldest ids go first, even inside the window: a producer that resends
# after a million newer dedup ids is not recognised (README, "Idempotent
# produce").
DEDUP_MAX_IDS = 1_000_000

# wait_status sums the waiting time of at most this many of the oldest ready
# messages (queue_server's sample size): a cheap congestion signal.
WAIT_STATUS_SAMPLE = 16
# ...each counted for at most this many seconds, as queue_server did.
WAIT_STATUS_CAP_S = 255


# A message is a plain tuple (data, ready_ms, ttl_ms, retry_ms, retry_at_ms),
# longer once it has been delivered or is a dead letter (below), read
# through these indexes, rather than an object: tuples of atomic values
# are untracked by the cyclic garbage collector, so a million stored
# messages cost its full passes nothing (with objects, those passes cost
# more than the rest of a produce; bench/). Exact tuples only: CPython does
# not untrack tuple subclasses such as NamedTuple. A consume replaces the
# tuple instead of mutating it.
#   data: the client's string; ready_ms: when first deliverable;
#   ttl_ms: a delivery whose next retry reaches it is the last;
#   retry_ms: 0 = at-most-once; retry_at_ms: 0 while waiting for a
#   delivery, else when the current delivery's lease runs out (its key
#   time in `retrying` or `finals`).
# A message delivered at least once (or nacked) has 9 fields, the 5 and
#   deliveries, nacks: how often it was delivered and nacked;
#   epoch: of the master that decided its current delivery (0: none);
#     with msg_id and deliveries it makes the delivery's receipt;
#   final: FINAL_NONE, or why it leaves when its lease runs out (`finals`).
# A dead letter has 12: the 9 (zeros until delivered) and
#   origin_queue, origin_msg_id, reason (FINAL_MAX_DELIVERIES/FINAL_EXPIRED).
# Never-delivered messages keep the short form: the extra fields would cost
# a million stored messages 24 MB.
Message = tuple[Any, ...]
# (Final: mypy then knows each index.)
DATA: Final = 0
READY_MS: Final = 1
TTL_MS: Final = 2
RETRY_MS: Final = 3
RETRY_AT_MS: Final = 4
DELIVERIES: Final = 5
NACKS: Final = 6
EPOCH: Final = 7
FINAL: Final = 8
ORIGIN_QUEUE: Final = 9
ORIGIN_MSG_ID: Final = 10
REASON: Final = 11
# The lengths a message tuple may have.
_SHORT, _DELIVERED, _DEAD_LETTER = 5, 9, 12
# The lengths of a snapshot row with a priority: 1 + a message's + 1.
_PRIORITIZED_ROWS = (_SHORT + 2, _DELIVERED + 2, _DEAD_LETTER + 2)

# The names of a dead letter's reason, as show and the README give them.
REASON_NAMES = {FINAL_MAX_DELIVERIES: "max_deliveries", FINAL_EXPIRED: "expired"}

# A receipt as the request layer parsed it: (epoch, msg_id, deliveries);
# (0, 0, 0) for a string that is not a receipt (it matches nothing).
Receipt = tuple[int, int, int]


def receipt_text(epoch: int, msg_id: int, deliveries: int) -> str:
    """The receipt string a client gets for a delivery."""
    return f"{epoch}.{msg_id}.{deliveries}"


def _receipt_matches(msg_id: int, msg: Message, receipt: Receipt) -> bool:
    """Whether `receipt` names the message's current delivery."""
    return (len(msg) > _SHORT and msg[EPOCH] != 0 and receipt[0] == msg[EPOCH]
            and receipt[1] == msg_id and receipt[2] == msg[DELIVERIES])


def _with_delivery(msg: Message, retry_at_ms: int, epoch: int, final: int) -> Message:
    """`msg` delivered once more: its lease runs out at `retry_at_ms`."""
    if len(msg) == _SHORT:
        return (msg[0], msg[1], msg[2], msg[3], retry_at_ms, 1, 0, epoch, final)
    return (msg[0], msg[1], msg[2], msg[3], retry_at_ms, msg[DELIVERIES] + 1, msg[NACKS],
            epoch, final, *msg[_DELIVERED:])


def _long(msg: Message) -> Message:
    """`msg` with the delivery fields: a message that was in flight when an
    old log or snapshot was written has the short form (delivered at least
    once, no receipt)."""
    if len(msg) > _SHORT:
        return msg
    return (*msg, 1 if msg[RETRY_AT_MS] else 0, 0, 0, FINAL_NONE)


def message_view(msg_id: int, msg: Message, now_ms: int,
                 priority: int = DEFAULT_PRIORITY) -> dict[str, Any]:
    """What show and peek answer for a message (times in unix seconds)."""
    retry_at_ms = msg[RETRY_AT_MS]
    if retry_at_ms:
        final = len(msg) > _SHORT and msg[FINAL]
        state = "in_flight" if final or retry_at_ms > now_ms else "ready"
    else:
        state = "ready" if msg[READY_MS] <= now_ms else "delayed"
    long = len(msg) > _SHORT
    view: dict[str, Any] = {
        "msg_id": msg_id, "state": state, "data": msg[DATA], "priority": priority,
        "ready_at": msg[READY_MS] / 1000, "ttl": msg[TTL_MS] / 1000, "retry": msg[RETRY_MS] / 1000,
        "retry_at": retry_at_ms / 1000 if state == "in_flight" else 0,
        "deliveries": msg[DELIVERIES] if long else 0,
        "nacks": msg[NACKS] if long else 0}
    if len(msg) == _DEAD_LETTER:
        view.update(origin_queue=msg[ORIGIN_QUEUE], origin_msg_id=msg[ORIGIN_MSG_ID],
                    dead_letter_reason=REASON_NAMES[msg[REASON]])
    return view


# sortedcontainers ships no type information: to mypy SortedList is Any.
class _Keys(SortedList):  # type: ignore[misc]
    """A SortedList of a queue's index keys, with cheaper versions of the
    three operations on the hot path:

    - `add` of a key after every key held: the common case, as a produce is
      ready now and a delivery comes back at now + retry, both later than
      the keys before them;
    - `remove` of the smallest key: a consume takes the head of an index;
    - `first()`: the smallest key, or None (`sl[0]` and `len(sl)` are two
      Python calls; this is one).

    Each costs about half of what the library's general code costs for
    that case, or less (instruction counts; bench/hotpath.py shows the
    effect on a request). Every other case takes the library's own code.

    Why reaching into SortedList's state is acceptable here: `_lists` (the
    sorted sublists, none empty, no sublist at all when the list is empty),
    `_maxes` (each sublist's largest key), `_len`, `_load` and `_index` (the
    positional tree, empty until a positional lookup builds it) are the
    layout that sortedcontainers documents on its "Implementation Details"
    page and has kept since 1.x. The fast paths do what the library's `add`
    and `remove` do once their bisects land on the last or the first
    sublist, and leave splitting, joining and the `_index` upkeep to the
    library's `_expand` and `_delete`, as its own methods do. `_check()`
    (run by the store's tests after every step) verifies the structure.
    """

    def add(self, value: int) -> None:
        maxes = self._maxes
        if maxes and value >= maxes[-1]:
            last = self._lists[-1]
            last.append(value)
            maxes[-1] = value
            self._len += 1
            if self._index or len(last) > self._load << 1:
                self._expand(len(maxes) - 1)
        else:
            SortedList.add(self, value)

    def remove(self, value: int) -> None:
        lists = self._lists
        if lists and lists[0][0] == value:
            self._delete(0, 0)
        else:
            SortedList.remove(self, value)

    def first(self) -> int | None:
        """The smallest key, or None when empty. O(1)."""
        lists = self._lists
        return lists[0][0] if lists else None


class DedupTable:
    """The dedup ids a queue accepted: dedup_id -> (ref, accepted_ms), in
    the order they were first accepted (an id accepted again after its
    window keeps its place, with the new time). `ref` is the msg_id, or for
    a virtual queue the ((real queue, msg_id), ...) of the produce.

    Built by apply from entries only; pruned from the oldest end by the
    entries' cutoffs and by DEDUP_MAX_IDS. (An OrderedDict: it pops its
    oldest key in O(1), where a dict's iteration would step over the holes
    that pops leave.)"""

    __slots__ = ("ids",)

    def __init__(self) -> None:
        self.ids: OrderedDict[str, tuple[Any, int]] = OrderedDict()

    def find(self, dedup_id: str, now_ms: int, window_ms: int) -> Any:
        """The ref of `dedup_id` if it was accepted less than `window_ms`
        before `now_ms`, else None. O(1)."""
        found = self.ids.get(dedup_id)
        if found is None or now_ms >= found[1] + window_ms:
            return None
        return found[0]

    def prune(self, cutoff_ms: int, changes: list[Any] | None) -> None:
        """Drop the oldest ids while they were accepted at or before
        `cutoff_ms` (stopping at the first that was not). Amortised O(1).
        With `changes`, records what `undo` needs."""
        ids = self.ids
        while ids:
            dedup_id = next(iter(ids))
            value = ids[dedup_id]
            if value[1] > cutoff_ms:
                return
            del ids[dedup_id]
            if changes is not None:
                changes.append((True, dedup_id, value))

    def add(self, dedup_id: str, ref: Any, accepted_ms: int, changes: list[Any] | None) -> None:
        """Record `dedup_id`; the oldest id goes if the table is full. O(1)."""
        ids = self.ids
        previous = ids.get(dedup_id)
        if previous is None and len(ids) >= DEDUP_MAX_IDS:
            oldest, value = ids.popitem(last=False)
            if changes is not None:
                changes.append((True, oldest, value))
        if changes is not None:
            changes.append((False, dedup_id, previous))
        ids[dedup_id] = (ref, accepted_ms)

    def undo(self, changes: list[Any]) -> None:
        """Take back the `prune`s and `add`s that recorded `changes`, newest
        first (an id may be added, then evicted by the same entry)."""
        ids = self.ids
        for removed, dedup_id, value in reversed(changes):
            if removed:  # it was the oldest: first again
                ids[dedup_id] = value
                ids.move_to_end(dedup_id, last=False)
            elif value is None:  # added at the end: the newest
                del ids[dedup_id]
            else:
                ids[dedup_id] = value  # accepted again in place: it kept its position

    def to_wire(self) -> list[Any]:
        return [[d, [list(t) for t in ref] if type(ref) is tuple else ref, at]
                for d, (ref, at) in self.ids.items()]

    @classmethod
    def from_wire(cls, raw: object, what: str) -> DedupTable:
        """Raises ValueError on anything `to_wire` does not give."""
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"{what}: dedup table is not a list")
        table = cls()
        ids = table.ids
        for row in raw:
            if not isinstance(row, (list, tuple)) or len(row) != 3 or type(row[0]) is not str \
                    or type(row[2]) is not int:
                raise ValueError(f"{what}: bad dedup row {row!r}")
            ref = row[1]
            if isinstance(ref, (list, tuple)):
                if not ref or not all(isinstance(t, (list, tuple)) and len(t) == 2
                                      and type(t[0]) is str and type(t[1]) is int for t in ref):
                    raise ValueError(f"{what}: bad dedup ref {ref!r}")
                ref = tuple((t[0], t[1]) for t in ref)
            elif type(ref) is not int:
                raise ValueError(f"{what}: bad dedup ref {ref!r}")
            ids[row[0]] = (ref, row[2])
        return table


def _settings_view(max_deliveries: int, dead_letter: str, max_size: int, dedup_window_ms: int,
                   paused: str) -> dict[str, Any]:
    """The settings as config (5) answers them (seconds, null for none)."""
    window_s = dedup_window_ms / 1000
    return {"max_deliveries": max_deliveries, "dead_letter": dead_letter or None,
            "max_size": max_size,
            "dedup_window": int(window_s) if window_s.is_integer() else window_s,
            "paused": paused}


class Queue:
    """A real queue: messages by id, plus the FIFO, pending and retry
    indexes, and the three indexes of prioritized messages.

    Priorities: a message produced with a priority other than the default
    (DEFAULT_PRIORITY) has it in `priorities` and is indexed, unless it is
    a final delivery (`finals`), in one of `pdelayed` (never delivered, by
    ready time), `pretrying` (in flight, by lease end) or `pready`, keyed
    (priority, time, id) and holding those whose time is at or before
    `pmark`. A read at `now_ms` first moves what came due into `pready`
    (`_promote`), so the most urgent deliverable prioritized message is
    `pready`'s first one with time <= now (all are, unless a master's
    clock is behind an earlier master's mark). Which of these indexes
    holds a message depends on when reads happened: it is not state
    (`to_wire` does not see it), as with the FIFO and `pending`. Messages
    without a priority never touch these indexes: their cost is one test
    of an empty dict."""

    __slots__ = ("name", "messages", "fifo", "fifo_ready", "pending", "retrying", "finals",
                 "max_id", "max_deliveries", "dead_letter", "dead_lettered", "priorities",
                 "pready", "pdelayed", "pretrying", "pmark", "config", "max_size", "limit",
                 "delivers", "dedup_window_ms", "paused", "dedup")

    def __init__(self, name: str) -> None:
        self.name = name
        self.messages: dict[int, Message] = {}  # every live message (a 5-tuple), by id
        # ids of never-delivered messages in (ready_ms, msg_id) order; not in `pending`
        self.fifo: deque[int] = deque()
        # >= the ready_ms of the FIFO's tail (may be higher, never lower); any value when empty
        self.fifo_ready = 0
        self.pending = _Keys()  # keys of never-delivered messages not in `fifo`
        self.retrying = _Keys()  # keys of delivered, unconfirmed messages that come back
        self.finals = _Keys()  # ...that leave the queue when their lease runs out
        self.max_id = 0  # highest msg_id ever assigned; ids never repeat
        self.dead_lettered = 0  # messages that left by the dead-letter rules
        # msg_id -> priority, for live messages whose priority is not the default
        self.priorities: dict[int, int] = {}
        self.pready = _Keys()  # priority << 128 | time << 64 | id, time <= pmark
        self.pdelayed = _Keys()  # time << 64 | id of never-delivered ones, time > pmark
        self.pretrying = _Keys()  # ...of in-flight ones (not final), time > pmark
        self.pmark = 0  # the latest `now_ms` that `_promote` moved keys up to
        # The settings config (5) set (entries.SETTINGS names; state): what
        # the node's XML defaults and SETTINGS' defaults do not decide.
        self.config: dict[str, Any] = {}
        # The settings in force (Store._settle derives them from `config`,
        # the XML defaults and SETTINGS; not state, as they depend on the
        # node's configuration, which apply never reads).
        self.max_deliveries = 0  # 0 = unlimited
        self.dead_letter = ""  # "" = none
        self.max_size = 0  # the most messages a produce may leave it holding
        self.limit = 0  # max_size, or 0 while paused in (one test on the produce path)
        self.delivers = True  # not paused out
        self.dedup_window_ms = 0
        self.paused = "none"
        self.dedup = DedupTable()  # produces with a dedup_id to this queue

    def __len__(self) -> int:
        return len(self.messages)

    def settings(self) -> dict[str, Any]:
        """The settings in force, as config (5) answers them."""
        return _settings_view(self.max_deliveries, self.dead_letter, self.max_size,
                              self.dedup_window_ms, self.paused)

    # -- prioritized messages --------------------------------------------

    def pindex(self, msg_id: int, msg: Message) -> None:
        """Index a prioritized message that is not a final delivery. O(log n)."""
        retry_at_ms = msg[RETRY_AT_MS]
        time_ms = retry_at_ms or msg[READY_MS]
        key = time_ms << _ID_BITS | msg_id
        if time_ms <= self.pmark:
            self.pready.add(self.priorities[msg_id] << _PRIO_SHIFT | key)
        elif retry_at_ms:
            self.pretrying.add(key)
        else:
            self.pdelayed.add(key)

    def punindex(self, msg_id: int, retry_at_ms: int, ready_ms: int) -> None:
        """Remove a prioritized message that is not a final delivery. O(log n)."""
        key = (retry_at_ms or ready_ms) << _ID_BITS | msg_id
        timed = self.pretrying if retry_at_ms else self.pdelayed
        if key in timed:
            timed.remove(key)
        else:
            self.pready.remove(self.priorities[msg_id] << _PRIO_SHIFT | key)

    def _promote(self, now_ms: int) -> None:
        """Move the prioritized messages due at `now_ms` into `pready`.
        Amortised O(log n) per message: each moves once per delivery."""
        if now_ms <= self.pmark:
            return
        limit = (now_ms + 1) << _ID_BITS
        priorities = self.priorities
        pready = self.pready
        for timed in (self.pdelayed, self.pretrying):
            while (key := timed.first()) is not None and key < limit:
                timed.remove(key)
                pready.add(priorities[key & _ID_MASK] << _PRIO_SHIFT | key)
        self.pmark = now_ms

    def _pready_due(self, now_ms: int) -> Iterator[int]:
        """`pready`'s keys due at `now_ms`, most urgent first (after
        `_promote(now_ms)`: all of them, unless now is behind pmark)."""
        for key in self.pready:
            if (key >> _ID_BITS) & _ID_MASK <= now_ms:
                yield key

    def next_due(self, now_ms: int) -> int | None:
        """The msg_id a consume at `now_ms` delivers, or None (also while
        paused out). O(1) without priorities, O(log n) with."""
        if not self.delivers:
            return None
        limit = (now_ms + 1) << _ID_BITS  # every key with time <= now is below it
        fifo = self.fifo
        best: int | None
        if fifo:
            best = fifo[0]
            best |= self.messages[best][READY_MS] << _ID_BITS  # the head's key
            if best >= limit:
                best = None
        else:
            best = None
        key = self.pending.first()
        if key is not None and key < limit and (best is None or key < best):
            best = key
        key = self.retrying.first()
        if key is not None and key < limit and (best is None or key < best):
            best = key
        if self.priorities:
            self._promote(now_ms)
            urgent = next(self._pready_due(now_ms), None)
            if urgent is not None and (best is None or urgent >> _PRIO_SHIFT < DEFAULT_PRIORITY):
                return urgent & _ID_MASK
        return None if best is None else best & _ID_MASK

    def due(self, now_ms: int) -> Iterator[int]:
        """The msg_ids a series of consumes at `now_ms` would deliver, in
        that order: prioritized ones more urgent than the default, the
        indexes of the others merged by key, then the less urgent ones
        (nothing while paused out). The queue must not change while this
        runs. O(log n) per id."""
        if not self.delivers:
            return
        later: Iterator[int] = iter(())
        if self.priorities:
            self._promote(now_ms)
            urgent = self._pready_due(now_ms)
            for key in urgent:
                if key >> _PRIO_SHIFT > DEFAULT_PRIORITY:
                    later = chain((key,), urgent)  # this one, then the rest
                    break
                yield key & _ID_MASK
        yield from self._due_default(now_ms)
        for key in later:
            yield key & _ID_MASK

    def _due_default(self, now_ms: int) -> Iterator[int]:
        """`due` for messages without a priority."""
        limit = (now_ms + 1) << _ID_BITS
        messages = self.messages

        def fifo_keys() -> Iterator[int]:
            for msg_id in self.fifo:
                key = messages[msg_id][READY_MS] << _ID_BITS | msg_id
                if key >= limit:
                    return
                yield key

        def below(key: int) -> bool:
            return key < limit

        for key in heapq.merge(fifo_keys(), takewhile(below, self.pending),
                               takewhile(below, self.retrying)):
            yield key & _ID_MASK

    def next_ready_ms(self) -> int | None:
        """The earliest time at which a message is (or was) deliverable:
        the least key time of the indexes, or None (also while paused out:
        nothing is deliverable until it is resumed). O(1)."""
        if not self.delivers:
            return None
        best: int | None = None
        if self.fifo:
            best = self.messages[self.fifo[0]][READY_MS]
        for keys in (self.pending, self.retrying, self.pdelayed, self.pretrying):
            key = keys.first()
            if key is not None and (best is None or key >> _ID_BITS < best):
                best = key >> _ID_BITS
        if self.pready:
            # All at or before pmark: due, unless the clock is behind the
            # mark; the earliest of them, which takes a scan (O(p)). Only a
            # parked consume asks this, and it finds nothing deliverable,
            # so pready has something only when the clock is behind.
            time_ms = min((key >> _ID_BITS) & _ID_MASK for key in self.pready)
            if best is None or time_ms < best:
                best = time_ms
        return best

    def oldest_ready_ms(self, now_ms: int) -> int | None:
        """Since when the longest-waiting deliverable message has been
        deliverable, or None (also while paused out). O(1) without
        priorities; O(p) for p prioritized messages (the most urgent is
        not the longest waiting)."""
        if not self.delivers:
            return None
        since: int | None = None
        msg_id = next(self._due_default(now_ms), None)
        if msg_id is not None:
            msg = self.messages[msg_id]
            since = msg[RETRY_AT_MS] or msg[READY_MS]
        if self.priorities:
            self._promote(now_ms)
            for key in self._pready_due(now_ms):
                time_ms = (key >> _ID_BITS) & _ID_MASK
                if since is None or time_ms < since:
                    since = time_ms
        return since

    def index(self, msg_id: int, msg: Message) -> None:
        """Index a message that is in `messages` and in no index, by its
        fields: `retrying`, `finals`, or the FIFO/`pending`. O(log n)."""
        retry_at_ms = msg[RETRY_AT_MS]
        if retry_at_ms and len(msg) > _SHORT and msg[FINAL]:
            self.finals.add(retry_at_ms << _ID_BITS | msg_id)
        elif self.priorities and msg_id in self.priorities:
            self.pindex(msg_id, msg)
        elif retry_at_ms:
            self.retrying.add(retry_at_ms << _ID_BITS | msg_id)
        else:
            self.index_pending(msg_id, msg)

    def _fifo_ready_count(self, now_ms: int) -> int:
        """How many FIFO messages are ready at `now_ms`. O(log n) probes of
        O(n/64) each (a deque index walks its 64-slot blocks): about 0.5 ms
        for a million messages, fine for a monitor request."""
        messages = self.messages
        return bisect_right(self.fifo, now_ms, key=lambda i: messages[i][READY_MS])

    def counts(self, now_ms: int) -> tuple[int, int, int]:
        """(ready, delayed, in_flight) at `now_ms`: deliverable now; waiting
        for their delay; delivered, unconfirmed and not yet due again.
        O(log n) plus the FIFO's bisect (see `_fifo_ready_count`)."""
        limit = (now_ms + 1) << _ID_BITS
        pending_ready = self.pending.bisect_left(limit) + self._fifo_ready_count(now_ms)
        retry_due = self.retrying.bisect_left(limit)
        ready = pending_ready + retry_due
        delayed = len(self.pending) + len(self.fifo) - pending_ready
        in_flight = len(self.retrying) - retry_due + len(self.finals)
        if self.priorities:
            self._promote(now_ms)
            ready += len(self.pready)
            delayed += len(self.pdelayed)
            in_flight += len(self.pretrying)
            if now_ms < self.pmark:  # a clock behind the mark: some of pready are not due
                for key in self.pready:
                    if (key >> _ID_BITS) & _ID_MASK > now_ms:
                        ready -= 1
                        if self.messages[key & _ID_MASK][RETRY_AT_MS]:
                            in_flight += 1
                        else:
                            delayed += 1
        return ready, delayed, in_flight

    def wait_status(self, now_ms: int) -> int:
        """queue_server's congestion figure: the seconds waited by the oldest
        ready messages (at most 16, each capped at 255 s). O(1); O(p) for p
        prioritized messages."""
        # The oldest ready ones of both never-delivered indexes, merged by
        # ready time (only the times count, so ties need no id order).
        limit = (now_ms + 1) << _ID_BITS
        ready = []
        for key in self.pending.islice(0, WAIT_STATUS_SAMPLE):
            if key >= limit:
                break
            ready.append(key >> _ID_BITS)
        messages = self.messages
        for n, msg_id in enumerate(self.fifo):
            ready_ms = messages[msg_id][READY_MS]
            if n == WAIT_STATUS_SAMPLE or ready_ms > now_ms:
                break
            ready.append(ready_ms)
        if self.priorities:  # never-delivered prioritized ones that are ready
            self._promote(now_ms)
            ready.extend(heapq.nsmallest(WAIT_STATUS_SAMPLE, (
                (key >> _ID_BITS) & _ID_MASK for key in self._pready_due(now_ms)
                if not messages[key & _ID_MASK][RETRY_AT_MS])))
        ready.sort()
        total = 0
        for ready_ms in ready[:WAIT_STATUS_SAMPLE]:
            waited_s = (now_ms - ready_ms) // 1000
            total += min(waited_s, WAIT_STATUS_CAP_S)
        return total

    def unindex(self, msg_id: int, msg: Message) -> None:
        """Remove a message from whichever index holds it. O(1) for a head
        or the FIFO's tail, O(log n) in a sorted list, O(n) in the middle
        of the FIFO."""
        retry_at_ms = msg[RETRY_AT_MS]
        if retry_at_ms and len(msg) > _SHORT and msg[FINAL]:
            self.finals.remove(retry_at_ms << _ID_BITS | msg_id)
        elif self.priorities and msg_id in self.priorities:
            self.punindex(msg_id, retry_at_ms, msg[READY_MS])
        elif retry_at_ms:
            self.retrying.remove(retry_at_ms << _ID_BITS | msg_id)
        else:
            self.unindex_pending(msg_id, msg[READY_MS])

    def extras(self) -> dict[str, Any]:
        """The queue's state besides its messages and max_id, where it is not
        the default (the snapshot's form; {} for most queues): the settings
        config (5) set, the dead-letter count, the dedup table."""
        out: dict[str, Any] = dict(self.config)
        if self.dead_lettered:
            out["dead_lettered"] = self.dead_lettered
        if self.dedup.ids:
            out["dedup"] = self.dedup.to_wire()
        return out

    def load_extras(self, extras: Mapping[str, Any]) -> None:
        """Set what `extras()` gave; raises ValueError on anything else.
        (The store settles the settings in force afterwards.)"""
        for name, value in extras.items():
            if name == "dead_lettered":
                if type(value) is not int or value < 0:
                    raise ValueError(f"queue {self.name}: bad dead_lettered {value!r}")
                self.dead_lettered = value
                continue
            if name == "dedup":
                self.dedup = DedupTable.from_wire(value, f"queue {self.name}")
                continue
            known = SETTINGS.get(name)
            if known is None:
                raise ValueError(f"queue {self.name}: unknown setting {name!r}")
            self.config[name] = known[0](value)

    def swap_messages(self, held: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
        """Replace every message and index with `held` (what an earlier call
        returned), or with nothing; returns what the queue held. O(1)."""
        before = (self.messages, self.fifo, self.fifo_ready, self.pending, self.retrying,
                  self.finals, self.priorities, self.pready, self.pdelayed, self.pretrying,
                  self.pmark)
        if held is None:
            held = ({}, deque(), 0, _Keys(), _Keys(), _Keys(), {}, _Keys(), _Keys(), _Keys(), 0)
        (self.messages, self.fifo, self.fifo_ready, self.pending, self.retrying, self.finals,
         self.priorities, self.pready, self.pdelayed, self.pretrying, self.pmark) = held
        return before

    def unindex_pending(self, msg_id: int, ready_ms: int) -> None:
        """Remove a never-delivered message from the FIFO or `pending` (or a
        prioritized one from its index). Costs as `unindex`."""
        if self.priorities and msg_id in self.priorities:
            self.punindex(msg_id, 0, ready_ms)
            return
        fifo = self.fifo
        if fifo:
            if fifo[0] == msg_id:
                fifo.popleft()
                return
            if fifo[-1] == msg_id:
                fifo.pop()
                if fifo:  # exact again; an empty FIFO takes any ready time
                    self.fifo_ready = self.messages[fifo[-1]][READY_MS]
                return
        key = ready_ms << _ID_BITS | msg_id
        pending = self.pending
        if pending.first() == key or key in pending:
            pending.remove(key)
        else:
            # In the middle of the FIFO: O(n), as a deque has no faster
            # delete. Only a confirm (or a revert) of a never-delivered
            # message lands here; consumes take heads, so the hot paths do not.
            fifo.remove(msg_id)

    def index_pending(self, msg_id: int, msg: Message) -> None:
        """Index a live never-delivered message again (a revert): at the
        FIFO's head or tail when that keeps its order, else in `pending`,
        which is a valid place for any such message. O(log n)."""
        if self.priorities and msg_id in self.priorities:
            self.pindex(msg_id, msg)
            return
        fifo = self.fifo
        ready_ms = msg[READY_MS]
        key = ready_ms << _ID_BITS | msg_id
        if not fifo:
            fifo.append(msg_id)
            self.fifo_ready = ready_ms
            return
        messages = self.messages
        head = fifo[0]
        if key < messages[head][READY_MS] << _ID_BITS | head:
            fifo.appendleft(msg_id)
            return
        tail = fifo[-1]
        tail_ready = messages[tail][READY_MS]
        if key > tail_ready << _ID_BITS | tail:
            fifo.append(msg_id)
            if ready_ms > self.fifo_ready:
                self.fifo_ready = ready_ms
            return
        self.pending.add(key)

    def _check(self) -> None:
        """Verify this queue's invariants; raises InvariantError."""
        for keys in (self.pending, self.retrying, self.finals, self.pready, self.pdelayed,
                     self.pretrying):
            keys._check()
        sizes = (len(self.fifo), len(self.pending), len(self.retrying), len(self.finals),
                 len(self.pready), len(self.pdelayed), len(self.pretrying))
        if sum(sizes) != len(self.messages):
            raise InvariantError(f"queue {self.name}: index sizes "
                                 f"{'+'.join(map(str, sizes))} != {len(self.messages)} messages")
        indexed = set()
        previous = -1
        for msg_id in self.fifo:
            msg = self.messages.get(msg_id)
            if msg is None or msg[RETRY_AT_MS]:
                raise InvariantError(f"queue {self.name}: stale FIFO id {msg_id}")
            key = msg[READY_MS] << _ID_BITS | msg_id
            if key <= previous or msg_id in self.priorities:
                raise InvariantError(f"queue {self.name}: FIFO out of order at {msg_id}")
            previous = key
            indexed.add(msg_id)
        if self.fifo and self.fifo_ready < self.messages[self.fifo[-1]][READY_MS]:
            raise InvariantError(f"queue {self.name}: fifo_ready {self.fifo_ready} "
                                 f"below the tail's ready time")
        for key in self.pending:
            msg = self.messages.get(key & _ID_MASK)
            if msg is None or msg[RETRY_AT_MS] or key >> _ID_BITS != msg[READY_MS] \
                    or key & _ID_MASK in self.priorities:
                raise InvariantError(f"queue {self.name}: stale pending key {key}")
            indexed.add(key & _ID_MASK)
        for keys, final in ((self.retrying, False), (self.finals, True)):
            for key in keys:
                msg = self.messages.get(key & _ID_MASK)
                if (msg is None or key >> _ID_BITS != msg[RETRY_AT_MS]
                        or final != bool(len(msg) > _SHORT and msg[FINAL])
                        or (not final and key & _ID_MASK in self.priorities)):
                    raise InvariantError(f"queue {self.name}: stale retry key {key}")
                indexed.add(key & _ID_MASK)
        for msg_id, priority in self.priorities.items():
            msg = self.messages.get(msg_id)
            if msg is None or type(priority) is not int or priority == DEFAULT_PRIORITY \
                    or not 0 <= priority < 1 << 31:
                raise InvariantError(f"queue {self.name}: stale priority of {msg_id}")
        for keys, delivered in ((self.pdelayed, False), (self.pretrying, True)):
            for key in keys:
                msg_id = key & _ID_MASK
                msg = self.messages.get(msg_id)
                if msg is None or msg_id not in self.priorities \
                        or bool(msg[RETRY_AT_MS]) != delivered \
                        or key >> _ID_BITS != (msg[RETRY_AT_MS] or msg[READY_MS]) \
                        or key >> _ID_BITS <= self.pmark \
                        or (len(msg) > _SHORT and msg[FINAL]):
                    raise InvariantError(f"queue {self.name}: stale prioritized key {key}")
                indexed.add(msg_id)
        for key in self.pready:
            msg_id = key & _ID_MASK
            msg = self.messages.get(msg_id)
            time_ms = (key >> _ID_BITS) & _ID_MASK
            if msg is None or self.priorities.get(msg_id) != key >> _PRIO_SHIFT \
                    or time_ms != (msg[RETRY_AT_MS] or msg[READY_MS]) or time_ms > self.pmark \
                    or (len(msg) > _SHORT and msg[FINAL]):
                raise InvariantError(f"queue {self.name}: stale ready priority key {key}")
            indexed.add(msg_id)
        if len(indexed) != len(self.messages):  # with the sizes: none in two places
            raise InvariantError(f"queue {self.name}: a message is indexed twice")
        for msg_id, msg in self.messages.items():
            if not 0 < msg_id <= self.max_id:
                raise InvariantError(f"queue {self.name}: id {msg_id} > max_id {self.max_id}")
            if type(msg) is not tuple or len(msg) not in (_SHORT, _DELIVERED, _DEAD_LETTER):
                raise InvariantError(f"queue {self.name}: message {msg_id} is not a 5-, 9- or "
                                     f"12-tuple")
            if msg[RETRY_AT_MS] and not msg[RETRY_MS]:
                raise InvariantError(f"queue {self.name}: at-most-once message {msg_id} retrying")
            if len(msg) > _SHORT and msg[FINAL] and not msg[RETRY_AT_MS]:
                raise InvariantError(f"queue {self.name}: final message {msg_id} not in flight")


def _apply_noop(entry: Noop, undo: list[Any] | None) -> None:
    return None


def _times(delay_s: float | None, ttl_s: float | None, now_ms: int) -> tuple[int, int] | None:
    """(ready_ms, ttl_ms) of a produce at `now_ms` (as
    `Store.decide_produce_values` computes them), or None for a ttl
    before the delay."""
    if delay_s is None:
        ready_ms = now_ms
    elif delay_s < RELATIVE_TIME_LIMIT_S:
        ready_ms = now_ms + round(delay_s * 1000)
    else:
        ready_ms = round(delay_s * 1000)
    if ttl_s is None:
        ttl_ms = ready_ms + DEFAULT_TTL_MS
    elif ttl_s < RELATIVE_TIME_LIMIT_S:
        ttl_ms = now_ms + round(ttl_s * 1000)
    else:
        ttl_ms = round(ttl_s * 1000)
    if ttl_ms < ready_ms:
        return None
    return max(ready_ms, now_ms), ttl_ms


class Store:
    """Every queue of a node, and the two steps that change them.

    Args:
        queue_size: the most messages one queue may hold; a produce into a
            full queue is refused, nothing is dropped.
        virtual_queues: name -> real queue names a produce fans out to.
    """

    def __init__(self, *, queue_size: int,
                 virtual_queues: Mapping[str, Sequence[str]] | None = None,
                 queue_defaults: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.queue_size = queue_size
        self.virtual_queues = {k: tuple(v) for k, v in (virtual_queues or {}).items()}
        # queue name -> settings (SETTINGS names) the node's XML gives it;
        # config (5) wins over them. Not state: they only feed decisions.
        self.queue_defaults = {k: dict(v) for k, v in (queue_defaults or {}).items()}
        # The dedup tables of virtual queues (a real queue holds its own).
        self.vdedup: dict[str, DedupTable] = {}
        self.queues: dict[str, Queue] = {}  # created by their first produce entry
        # The (ready_ms, ttl_ms) int objects of the last message stored: the
        # next message with equal times keeps references to these instead
        # of its own copies. Messages produced in one millisecond (the
        # common case under load) then share them, which saves 64 bytes of
        # a stored message's ~420 (bench/durability_bench.py, memory).
        self._last_times: tuple[int, int] = (-1, -1)
        # Entry type -> what `apply` runs for it, for a caller that applies
        # entries one by one on the hot path (LocalEngine): one Python call
        # per entry instead of two. Same arguments and result as `apply`.
        # (Each function takes the entry type of its key, which a dict's
        # type cannot say: hence Any.)
        self.apply_by_kind: dict[type[Entry], Callable[[Any, list[Any] | None], object]] = {
            Produce: self._apply_produce, Consume: self._apply_consume,
            Confirm: self._apply_confirm, Noop: _apply_noop,
            ConsumeMany: self._apply_consume_many, Nack: self._apply_nack,
            Touch: self._apply_touch, DeadLetter: self._apply_dead_letter,
            Configure: self._apply_configure, ProduceBatch: self._apply_produce_batch,
            Clear: self._apply_clear}
        # Names of the queues whose `finals` is not empty: where the master
        # looks for leases that ran out (`next_final_ms`, `decide_expired`).
        self.final_queues: set[str] = set()
        # What this node's apply did since it started, for its metrics
        # (metrics.py): not state (no snapshot holds them, a revert does
        # not take them back, a restart's replay counts again). Each only
        # grows.
        self.produced = 0  # messages stored by produce entries (one per real queue)
        self.delivered = 0  # messages delivered by consume entries
        self.redelivered = 0  # ...of them, delivered before
        self.confirmed = 0  # messages deleted by confirm entries
        self.nacked = 0  # messages given back by nack entries

    # -- reads -----------------------------------------------------------

    def get(self, name: str) -> Queue | None:
        return self.queues.get(name)

    def _new_queue(self, name: str) -> Queue:
        """Create queue `name` (an entry names it first) with its settings."""
        queue = self.queues[name] = Queue(name)
        self._settle(queue)
        return queue

    def _settle(self, queue: Queue) -> None:
        """Derive the settings in force from what config (5) set, the XML
        defaults of the queue and SETTINGS' defaults. O(1)."""
        config = queue.config
        defaults = self.queue_defaults.get(queue.name, {})

        def pick(name: str) -> Any:
            if name in config:
                return config[name]
            if name in defaults:
                return defaults[name]
            return SETTINGS[name][1]

        queue.max_deliveries = pick("max_deliveries")
        queue.dead_letter = pick("dead_letter")
        queue.max_size = pick("max_size") or self.queue_size
        queue.dedup_window_ms = pick("dedup_window_ms")
        paused = queue.paused = config.get("paused", "none")
        queue.limit = 0 if paused in ("in", "all") else queue.max_size
        queue.delivers = paused not in ("out", "all")

    def view(self, name: str) -> Queue:
        """Queue `name`, or one with its settings that no entry created yet
        (for reads: not added to the store)."""
        queue = self.queues.get(name)
        if queue is None:
            queue = Queue(name)
            self._settle(queue)
        return queue

    def _refusal(self, queue: Queue, virtual: bool) -> str:
        """Why a produce that would pass `queue.limit` is refused."""
        if not queue.limit:
            return f"queue paused: {queue.name}" if virtual else "queue paused"
        return f"queue full: {queue.name}"

    def message_count(self) -> int:
        return sum(len(q) for q in self.queues.values())

    # -- step 1: decide (master only; reads the clock via now_ms) --------

    def decide_produce(self, req: ProduceRequest, now_ms: int) -> Produce | str:
        """Decide a produce: an entry, or the reason it is refused. O(k) for
        k real queues."""
        return self.decide_produce_values(req[0], req[1], req[2], req[3], req[4], now_ms)

    def decide_produce_values(self, queue: str, data: str, delay_s: float | None,
                              ttl_s: float | None, retry_s: float, now_ms: int) -> Produce | str:
        """`decide_produce` from the request's fields, which the service's
        fast path has checked as `parse_request` would (it skips building
        the request tuple). O(k) for k real queues."""
        # Integer seconds (what clients send) are exact in ms without
        # round(); a float goes through round() as before.
        if delay_s is None:
            ready_ms = now_ms
        elif delay_s < RELATIVE_TIME_LIMIT_S:
            ready_ms = now_ms + (delay_s * 1000 if type(delay_s) is int else round(delay_s * 1000))
        else:
            ready_ms = delay_s * 1000 if type(delay_s) is int else round(delay_s * 1000)
        if ttl_s is None:
            ttl_ms = ready_ms + DEFAULT_TTL_MS
        elif ttl_s < RELATIVE_TIME_LIMIT_S:
            ttl_ms = now_ms + (ttl_s * 1000 if type(ttl_s) is int else round(ttl_s * 1000))
        else:
            ttl_ms = ttl_s * 1000 if type(ttl_s) is int else round(ttl_s * 1000)
        if ttl_ms < ready_ms:
            return "time error"
        # A delay in the past means ready now; keeping FIFO order among
        # ready messages needs the clamp.
        if ready_ms < now_ms:
            ready_ms = now_ms
        retry_ms = retry_s * 1000 if type(retry_s) is int else round(retry_s * 1000)
        queues = self.queues
        members = self.virtual_queues.get(queue)
        if members is None:  # a plain queue: the common case
            q = queues.get(queue)
            if q is None:
                q = self.view(queue)
                if not q.limit:
                    return self._refusal(q, False)
                targets = ((queue, 1),)
            elif len(q.messages) >= q.limit:
                return self._refusal(q, False)
            else:
                targets = ((queue, q.max_id + 1),)
            return _new(Produce, (targets, data, ready_ms, ttl_ms, retry_ms))
        listed = self._targets(members, 1)
        if isinstance(listed, str):
            return listed
        return _new(Produce, (listed, data, ready_ms, ttl_ms, retry_ms))

    def _targets(self, members: Sequence[str], count: int) -> tuple[tuple[str, int], ...] | str:
        """(queue, first new msg_id) of each of a virtual queue's members
        for `count` new messages, or why they cannot take them. O(k)."""
        listed = []
        for name in members:
            q = self.view(name)
            if len(q.messages) + count > q.limit:
                return self._refusal(q, True)
            listed.append((name, q.max_id + 1))
        return tuple(listed)

    def decide_produce_batch(self, req: ProduceBatchRequest, now_ms: int
                             ) -> tuple[ProduceBatch | None, list[Any]] | str:
        """Decide a produce with a batch, priorities or dedup ids: (the
        entry, or None when every item is a duplicate; the plan), or the
        reason it is refused (a time error names the item's index in a
        batch). The plan has one element per item, in input order: the
        index of its message in the entry's items (an int), ("dup", ref)
        for a duplicate of an accepted produce (ref as in DedupTable), or
        ("same", index) for a duplicate of an earlier item of the batch.
        O(b) for b items (O(b log n) with priorities)."""
        queue = req.queue
        members = self.virtual_queues.get(queue)
        names = members if members is not None else (queue,)
        for name in names:  # paused: refused before anything else
            q = self.view(name)
            if not q.limit:
                return self._refusal(q, members is not None)
        timed = []
        for index, item in enumerate(req.items):
            times = _times(item.delay_s, item.ttl_s, now_ms)
            if times is None:
                return f"messages[{index}]: time error" if req.batch else "time error"
            timed.append(times)
        window_ms = self.view(names[0]).dedup_window_ms
        table = self.queues[queue].dedup if queue in self.queues else self.vdedup.get(queue)
        seen: dict[str, int] = {}  # dedup_id -> index in `items`, within this batch
        plan: list[Any] = []
        items: list[tuple[str, int, int, int, int, str]] = []
        for item, (ready_ms, ttl_ms) in zip(req.items, timed, strict=True):
            dedup_id = item.dedup_id if window_ms else ""
            if dedup_id:
                ref = None if table is None else table.find(dedup_id, now_ms, window_ms)
                if ref is not None:
                    plan.append(("dup", ref))
                    continue
                earlier = seen.get(dedup_id)
                if earlier is not None:
                    plan.append(("same", earlier))
                    continue
                seen[dedup_id] = len(items)
            retry_s = item.retry_s
            plan.append(len(items))
            items.append((item.data, ready_ms, ttl_ms,
                          retry_s * 1000 if type(retry_s) is int else round(retry_s * 1000),
                          item.priority, dedup_id))
        if not items:
            return None, plan
        if members is None:
            q = self.view(queue)
            if len(q.messages) + len(items) > q.limit:
                return self._refusal(q, False)
            targets: tuple[tuple[str, int], ...] = ((queue, q.max_id + 1),)
        else:
            listed = self._targets(members, len(items))
            if isinstance(listed, str):
                return listed
            targets = listed
        return ProduceBatch(queue, targets, tuple(items), now_ms,
                            max(0, now_ms - window_ms)), plan

    def decide_clear(self, queue: str) -> Clear | str | None:
        """Remove every message of `queue`: an entry, or None when it holds
        none (nothing to change). O(1)."""
        if queue in self.virtual_queues:
            return "virtual queue only takes produce"
        q = self.queues.get(queue)
        if q is None or not q.messages:
            return None
        return Clear(queue)

    def decide_consume(self, req: ConsumeRequest, now_ms: int,
                       epoch: int) -> Consume | ConsumeMany | DeadLetter | str | None:
        """Decide a consume: an entry, None when nothing is deliverable, or a
        reason. `epoch`: the deciding master's (see entries.Consume). A
        DeadLetter instead of a delivery: the next message is over its
        queue's max_deliveries (lowered since it was delivered); the caller
        appends it and decides again. O(1) for one message, O(count log n)
        with `count` or several queues."""
        lease_ms = req.lease_ms
        if req.batch is None and len(req.queues) == 1:
            return self.decide_consume_values(req.queues[0], now_ms, epoch, lease_ms)
        return self.decide_consume_many(req.queues, req.batch or 1, now_ms, epoch, lease_ms)

    def decide_consume_values(self, queue: str, now_ms: int, epoch: int,
                              lease_ms: int = 0) -> Consume | DeadLetter | str | None:
        """`decide_consume` of one message from one queue. O(1)."""
        if queue in self.virtual_queues:
            return "virtual queue only takes produce"
        q = self.queues.get(queue)
        if q is None:
            return None
        msg_id = q.next_due(now_ms)
        if msg_id is None:
            return None
        msg = q.messages[msg_id]
        retry_ms = msg[RETRY_MS]
        if not retry_ms:
            return _new(Consume, (queue, msg_id, 0, 0, FINAL_NONE))
        if not q.max_deliveries and not q.dead_letter and not lease_ms:  # the usual queue
            retry_at_ms = now_ms + retry_ms
            if retry_at_ms >= msg[TTL_MS]:
                return _new(Consume, (queue, msg_id, 0, 0, FINAL_NONE))  # the last delivery
            return _new(Consume, (queue, msg_id, retry_at_ms, epoch, FINAL_NONE))
        delivery = self._delivery(q, msg_id, msg, now_ms, lease_ms)
        if type(delivery) is DeadLetter:
            return delivery
        retry_at_ms, final = delivery  # type: ignore[misc]
        return _new(Consume, (queue, msg_id, retry_at_ms, epoch if retry_at_ms else 0, final))

    def _delivery(self, q: Queue, msg_id: int, msg: Message, now_ms: int,
                  lease_ms: int) -> tuple[int, int] | DeadLetter:
        """(retry_at_ms, final) of delivering an at-least-once message now
        (retry_at_ms 0: the delivery deletes it), or the DeadLetter that
        must come first: it was delivered max_deliveries times already."""
        max_deliveries = q.max_deliveries
        delivered = msg[DELIVERIES] if len(msg) > _SHORT else 0
        if max_deliveries and delivered >= max_deliveries:
            return self._dead_letter(q, msg_id, FINAL_MAX_DELIVERIES, now_ms)
        retry_at_ms = now_ms + (lease_ms or msg[RETRY_MS])
        last = bool(max_deliveries) and delivered + 1 >= max_deliveries
        if retry_at_ms >= msg[TTL_MS]:
            if not q.dead_letter and not last:
                return 0, FINAL_NONE  # queue_server's last delivery: deleted now
            return retry_at_ms, FINAL_MAX_DELIVERIES if last else FINAL_EXPIRED
        return retry_at_ms, FINAL_MAX_DELIVERIES if last else FINAL_NONE

    def decide_consume_many(self, names: Sequence[str], count: int, now_ms: int, epoch: int,
                            lease_ms: int = 0) -> ConsumeMany | DeadLetter | str | None:
        """Up to `count` deliveries from the queues `names`, the first
        listed queue first, each queue in delivery order. O(count log n)."""
        virtual = self.virtual_queues
        for name in names:
            if name in virtual:
                return "virtual queue only takes produce"
        items: list[tuple[str, int, int, int]] = []
        for name in names:
            q = self.queues.get(name)
            if q is None:
                continue
            messages = q.messages
            for msg_id in q.due(now_ms):
                msg = messages[msg_id]
                if not msg[RETRY_MS]:
                    items.append((name, msg_id, 0, FINAL_NONE))
                else:
                    delivery = self._delivery(q, msg_id, msg, now_ms, lease_ms)
                    if type(delivery) is DeadLetter:
                        if items:  # deliver these; the next decision moves it
                            return _new(ConsumeMany, (tuple(items), epoch))
                        return delivery
                    items.append((name, msg_id, *delivery))
                if len(items) == count:
                    return _new(ConsumeMany, (tuple(items), epoch))
        if not items:
            return None
        return _new(ConsumeMany, (tuple(items), epoch))

    def _dead_letter(self, q: Queue, msg_id: int, reason: int, now_ms: int) -> DeadLetter:
        """The entry that moves `msg_id` out of `q` for `reason`."""
        targets: tuple[tuple[str, int], ...] = ()
        if q.dead_letter:
            listed = []
            for name in self.virtual_queues.get(q.dead_letter, (q.dead_letter,)):
                target = self.queues.get(name)
                listed.append((name, 1 if target is None else target.max_id + 1))
            targets = tuple(listed)
        return DeadLetter(q.name, msg_id, reason, targets, now_ms, now_ms + DEFAULT_TTL_MS)

    def _in_flight(self, queue: str, msg_id: int, receipt: Receipt | None,
                   now_ms: int) -> tuple[Queue, Message] | str:
        """The queue and message that a nack or touch acts on, or the
        reason it cannot: `stale receipt`, `not in flight`."""
        if queue in self.virtual_queues:
            return "virtual queue only takes produce"
        q = self.queues.get(queue)
        msg = None if q is None else q.messages.get(msg_id)
        if receipt is not None and (msg is None or not _receipt_matches(msg_id, msg, receipt)):
            return "stale receipt"
        if q is None or msg is None or not msg[RETRY_AT_MS]:
            return "not in flight"
        msg = _long(msg)
        if msg[RETRY_AT_MS] <= now_ms:
            # Its lease ran out: it is deliverable again, or (a final
            # delivery) about to leave the queue when the master's timer runs.
            return "not in flight"
        return q, msg

    def decide_nack(self, queue: str, msg_id: int, receipt: Receipt | None, ready_ms: int,
                    now_ms: int) -> Nack | DeadLetter | str:
        """Give an in-flight message back, deliverable at `ready_ms` (not
        before now); or move it out if that was its last delivery (final,
        at max_deliveries, or `ready_ms` at its ttl). O(log n)."""
        found = self._in_flight(queue, msg_id, receipt, now_ms)
        if isinstance(found, str):
            return found
        q, msg = found
        ready_ms = max(ready_ms, now_ms)
        if msg[FINAL]:
            return self._dead_letter(q, msg_id, msg[FINAL], now_ms)
        if q.max_deliveries and msg[DELIVERIES] >= q.max_deliveries:
            return self._dead_letter(q, msg_id, FINAL_MAX_DELIVERIES, now_ms)
        if ready_ms >= msg[TTL_MS]:
            return self._dead_letter(q, msg_id, FINAL_EXPIRED, now_ms)
        return Nack(queue, msg_id, ready_ms)

    def decide_touch(self, queue: str, msg_id: int, receipt: Receipt | None, lease_ms: int,
                     now_ms: int) -> Touch | str:
        """Extend (or shorten) an in-flight message's lease to now +
        `lease_ms` (0: its retry); a lease reaching its ttl makes this
        delivery its last. O(log n)."""
        found = self._in_flight(queue, msg_id, receipt, now_ms)
        if isinstance(found, str):
            return found
        _q, msg = found
        retry_at_ms = now_ms + (lease_ms or msg[RETRY_MS])
        final = msg[FINAL]
        if not final and retry_at_ms >= msg[TTL_MS]:
            final = FINAL_EXPIRED
        return Touch(queue, msg_id, retry_at_ms, final)

    def next_final_ms(self) -> int | None:
        """When the earliest final lease runs out, or None. O(q) for the q
        queues holding final deliveries (few: last deliveries only)."""
        best: int | None = None
        for name in self.final_queues:
            key = self.queues[name].finals.first()
            if key is not None and (best is None or key < best):
                best = key
        return None if best is None else best >> _ID_BITS

    def decide_expired(self, now_ms: int, limit: int) -> list[DeadLetter]:
        """The moves of up to `limit` messages whose final lease ran out by
        `now_ms`, decided one after another as if each were applied (the
        caller applies them in order). O(limit log n)."""
        out: list[DeadLetter] = []
        bound = (now_ms + 1) << _ID_BITS
        shadow: dict[str, int] = {}  # target queue -> the next msg_id to give
        for name in sorted(self.final_queues):
            q = self.queues[name]
            for key in q.finals:
                if key >= bound or len(out) == limit:
                    break
                msg_id = key & _ID_MASK
                move = self._dead_letter(q, msg_id, q.messages[msg_id][FINAL], now_ms)
                if move.targets:  # ids after those already given in this call
                    targets = []
                    for target, target_id in move.targets:
                        target_id = max(target_id, shadow.get(target, 0))
                        shadow[target] = target_id + 1
                        targets.append((target, target_id))
                    move = move._replace(targets=tuple(targets))
                out.append(move)
        return out

    def decide_configure(self, queue: str, settings: Mapping[str, Any]) -> Configure | str:
        """Change a queue's settings (already checked one by one by the
        request layer); refused for a virtual queue or a dead-letter queue
        that is the queue itself. O(1)."""
        if queue in self.virtual_queues:
            return "virtual queue only takes produce"
        target = settings.get("dead_letter")
        if target:
            if target == queue:
                return "bad value for dead_letter: a queue cannot be its own dead-letter queue"
            if queue in self.virtual_queues.get(target, ()):
                return (f"bad value for dead_letter: virtual queue {target} includes "
                        f"{queue} itself")
        return Configure(queue, tuple(sorted(settings.items())))

    def check_receipt(self, queue: str, msg_id: int, receipt: Receipt) -> bool:
        """Whether `receipt` names the current delivery of the message."""
        q = self.queues.get(queue)
        msg = None if q is None else q.messages.get(msg_id)
        return msg is not None and _receipt_matches(msg_id, msg, receipt)

    def decide_confirm(self, req: ConfirmRequest) -> Confirm | str | None:
        """Decide a confirm: an entry, or None when the id is unknown (not an
        error, as in queue_server). O(1)."""
        return self.decide_confirm_values(req[0], req[1])

    def decide_confirm_values(self, queue: str, msg_id: int) -> Confirm | str | None:
        """`decide_confirm` from the request's queue name and msg_id. O(1)."""
        if queue in self.virtual_queues:
            return "virtual queue only takes produce"
        q = self.queues.get(queue)
        if q is None or msg_id not in q.messages:
            return None
        return _new(Confirm, (queue, msg_id))

    # -- step 2: apply (every node, in log order; no clock) ---------------

    def apply(self, entry: Entry, undo: list[Any] | None = None) -> object:
        """Apply one entry; returns what the client's answer needs.

        Produce -> tuple of (queue, msg_id); Consume -> (msg_id, data);
        Confirm -> True if a message was deleted; Noop -> None.
        With `undo`, appends what `revert(undo)` needs to take the entry
        back (the master keeps this until the entry commits).
        Cost: O(k log n) for a produce into k queues of n messages, O(log n)
        otherwise, except O(n) for a confirm of a never-delivered message in
        the middle of the FIFO. Raises InvariantError if the entry does not
        fit the state (a gap or a fork in the log: never the client's fault).
        """
        # One type() call for the four tests (the hot path); mypy does not
        # narrow `entry` through `kind`, hence the ignores.
        kind = type(entry)
        if kind is Produce:
            return self._apply_produce(entry, undo)  # type: ignore[arg-type]
        if kind is Consume:
            return self._apply_consume(entry, undo)  # type: ignore[arg-type]
        if kind is Confirm:
            return self._apply_confirm(entry, undo)  # type: ignore[arg-type]
        if kind is Noop:
            return None
        apply = self.apply_by_kind.get(kind)
        if apply is None:
            raise InvariantError(f"cannot apply {entry!r}")
        return apply(entry, undo)

    def _apply_produce(self, entry: Produce,
                       undo: list[Any] | None) -> tuple[tuple[str, int], ...]:
        targets, data, ready_ms, ttl_ms, retry_ms = entry
        last = self._last_times
        if ready_ms == last[0] and ttl_ms == last[1]:
            ready_ms, ttl_ms = last
        else:
            self._last_times = (ready_ms, ttl_ms)
        queues = self.queues
        for name, msg_id in targets:
            queue = queues.get(name)
            if queue is None:
                queue = self._new_queue(name)
                created = True
            else:
                created = False
            if msg_id <= queue.max_id:
                raise InvariantError(f"produce {name}/{msg_id} at or below max_id {queue.max_id}")
            if undo is not None:
                undo.append((_UNPRODUCE, name, msg_id, queue.max_id, created))
            queue.max_id = msg_id
            queue.messages[msg_id] = (data, ready_ms, ttl_ms, retry_ms, 0)
            # msg_id is above every id held, so a ready time not below the
            # tail's keeps the FIFO in key order.
            if ready_ms >= queue.fifo_ready or not queue.fifo:
                queue.fifo.append(msg_id)
                queue.fifo_ready = ready_ms
            else:
                queue.pending.add(ready_ms << _ID_BITS | msg_id)
        self.produced += len(targets)
        return targets

    def _apply_consume(self, entry: Consume,
                       undo: list[Any] | None) -> tuple[int, str, int]:
        """-> (msg_id, data, deliveries counting this one)."""
        name, msg_id, retry_at_ms, epoch, final = entry
        queue = self.queues.get(name)
        if queue is None or (msg := queue.messages.get(msg_id)) is None:
            raise InvariantError(f"consume of missing message {name}/{msg_id}")
        self.delivered += 1
        if len(msg) > _SHORT and msg[DELIVERIES]:
            self.redelivered += 1
        priorities = queue.priorities
        prioritized = msg_id in priorities if priorities else False
        if undo is not None:
            undo.append((_RESTORE, name, msg_id, msg,
                         priorities[msg_id] if prioritized else None))
        # Queue.unindex, with the common cases inline (the hot path). A
        # consume takes the earliest message: a head of an index.
        old_retry_at_ms = msg[RETRY_AT_MS]
        if prioritized:
            queue.punindex(msg_id, old_retry_at_ms, msg[READY_MS])
        elif old_retry_at_ms:
            queue.retrying.remove(old_retry_at_ms << _ID_BITS | msg_id)
        else:
            fifo = queue.fifo
            if fifo and fifo[0] == msg_id:
                fifo.popleft()
            else:
                queue.unindex_pending(msg_id, msg[READY_MS])
        if retry_at_ms:
            if len(msg) == _SHORT:  # the first delivery: _with_delivery, inline
                msg = (msg[0], msg[1], msg[2], msg[3], retry_at_ms, 1, 0, epoch, final)
            else:
                msg = _with_delivery(msg, retry_at_ms, epoch, final)
            queue.messages[msg_id] = msg
            if final:
                queue.finals.add(retry_at_ms << _ID_BITS | msg_id)
                self.final_queues.add(name)
            elif prioritized:
                queue.pindex(msg_id, msg)
            else:
                queue.retrying.add(retry_at_ms << _ID_BITS | msg_id)
            return msg_id, msg[DATA], msg[DELIVERIES]
        del queue.messages[msg_id]
        if prioritized:
            del priorities[msg_id]
        return msg_id, msg[DATA], msg[DELIVERIES] + 1 if len(msg) > _SHORT else 1

    def _apply_consume_many(self, entry: ConsumeMany,
                            undo: list[Any] | None) -> list[tuple[str, int, str, int]]:
        """-> [(queue, msg_id, data, deliveries)] in delivery order."""
        out = []
        epoch = entry.epoch
        for name, msg_id, retry_at_ms, final in entry.items:
            delivered = self._apply_consume(
                _new(Consume, (name, msg_id, retry_at_ms, epoch if retry_at_ms else 0, final)),
                undo)
            out.append((name, *delivered))
        return out

    def _message_for(self, name: str, msg_id: int, what: str) -> tuple[Queue, Message]:
        queue = self.queues.get(name)
        if queue is None or (msg := queue.messages.get(msg_id)) is None:
            raise InvariantError(f"{what} of missing message {name}/{msg_id}")
        return queue, msg

    def _track_finals(self, queue: Queue) -> None:
        if queue.finals:
            self.final_queues.add(queue.name)
        else:
            self.final_queues.discard(queue.name)

    def _apply_nack(self, entry: Nack, undo: list[Any] | None) -> int:
        """-> the ready time."""
        name, msg_id, ready_ms = entry
        queue, msg = self._message_for(name, msg_id, "nack")
        if not msg[RETRY_AT_MS]:
            raise InvariantError(f"nack of {name}/{msg_id}, which is not in flight")
        self.nacked += 1
        if undo is not None:
            undo.append((_RESTORE, name, msg_id, msg, queue.priorities.get(msg_id)))
        queue.unindex(msg_id, msg)
        self._track_finals(queue)
        msg = _long(msg)
        msg = (msg[0], ready_ms, msg[2], msg[3], 0, msg[DELIVERIES], msg[NACKS] + 1, msg[EPOCH],
               FINAL_NONE, *msg[_DELIVERED:])
        queue.messages[msg_id] = msg
        queue.index_pending(msg_id, msg)
        return ready_ms

    def _apply_touch(self, entry: Touch, undo: list[Any] | None) -> int:
        """-> the new end of the lease."""
        name, msg_id, retry_at_ms, final = entry
        queue, msg = self._message_for(name, msg_id, "touch")
        if not msg[RETRY_AT_MS]:
            raise InvariantError(f"touch of {name}/{msg_id}, which is not in flight")
        if undo is not None:
            undo.append((_RESTORE, name, msg_id, msg, queue.priorities.get(msg_id)))
        queue.unindex(msg_id, msg)
        msg = _long(msg)
        msg = (*msg[:RETRY_AT_MS], retry_at_ms, *msg[DELIVERIES:FINAL], final, *msg[_DELIVERED:])
        queue.messages[msg_id] = msg
        queue.index(msg_id, msg)
        self._track_finals(queue)
        return retry_at_ms

    def _apply_dead_letter(self, entry: DeadLetter,
                           undo: list[Any] | None) -> tuple[tuple[str, int], ...]:
        """-> the (queue, msg_id) of the new messages."""
        name, msg_id, reason, targets, ready_ms, ttl_ms = entry
        queue, msg = self._message_for(name, msg_id, "dead letter")
        if undo is not None:
            undo.append((_RESTORE, name, msg_id, msg, queue.priorities.get(msg_id)))
            undo.append((_RECOUNT, name, queue.dead_lettered))
        del queue.messages[msg_id]
        queue.unindex(msg_id, msg)
        queue.priorities.pop(msg_id, None)
        self._track_finals(queue)
        queue.dead_lettered += 1
        moved = (msg[DATA], ready_ms, ttl_ms, msg[RETRY_MS], 0, 0, 0, 0, FINAL_NONE,
                 name, msg_id, reason)
        for target_name, new_id in targets:
            target = self._claim_ids(target_name, new_id, 1, undo, "dead letter")
            target.messages[new_id] = moved
            target.index_pending(new_id, moved)
        return targets

    def _claim_ids(self, name: str, first: int, count: int, undo: list[Any] | None,
                   what: str) -> Queue:
        """Queue `name` (created if new) after giving out msg_ids first ..
        first + count - 1 (the caller stores the messages). Raises
        InvariantError if they are not above every id it gave before."""
        queue = self.queues.get(name)
        created = queue is None
        if queue is None:
            queue = self._new_queue(name)
        if first <= queue.max_id:
            raise InvariantError(f"{what} {name}/{first} at or below max_id {queue.max_id}")
        if undo is not None:
            undo.append((_UNPRODUCE_MANY, name, first, count, queue.max_id, created))
        queue.max_id = first + count - 1
        return queue

    def _apply_configure(self, entry: Configure, undo: list[Any] | None) -> dict[str, Any]:
        """-> the queue's settings after the change."""
        name, settings = entry
        queue = self.queues.get(name)
        created = queue is None
        if queue is None:
            queue = self._new_queue(name)
        if undo is not None:
            undo.append((_RESET, name, dict(queue.config), created))
        queue.config.update(settings)
        self._settle(queue)
        return queue.settings()

    def _apply_produce_batch(self, entry: ProduceBatch,
                             undo: list[Any] | None) -> tuple[tuple[str, int], ...]:
        """-> the targets: item k is message first + k of each."""
        owner, targets, items, accepted_ms, cutoff_ms = entry
        count = len(items)
        self.produced += count * len(targets)
        queues = self.queues
        for name, first in targets:
            queue = self._claim_ids(name, first, count, undo, "produce")
            messages, fifo, priorities = queue.messages, queue.fifo, queue.priorities
            for msg_id, (data, ready_ms, ttl_ms, retry_ms, priority, _dedup_id) in enumerate(
                    items, first):
                msg = messages[msg_id] = (data, ready_ms, ttl_ms, retry_ms, 0)
                if priority != DEFAULT_PRIORITY:
                    priorities[msg_id] = priority
                    queue.pindex(msg_id, msg)
                elif ready_ms >= queue.fifo_ready or not fifo:
                    fifo.append(msg_id)
                    queue.fifo_ready = ready_ms
                else:
                    queue.pending.add(ready_ms << _ID_BITS | msg_id)
        virtual = len(targets) != 1 or targets[0][0] != owner
        if virtual:
            vtable = self.vdedup.get(owner)
            if vtable is None:
                if not any(item[5] for item in items):
                    return targets  # no table, and nothing to put in one
                vtable = self.vdedup[owner] = DedupTable()
            table = vtable
        else:
            table = queues[owner].dedup
        changes: list[Any] | None = [] if undo is not None else None
        table.prune(cutoff_ms, changes)
        for k, item in enumerate(items):
            dedup_id = item[5]
            if dedup_id:
                ref: Any = (tuple((name, first + k) for name, first in targets) if virtual
                            else targets[0][1] + k)
                table.add(dedup_id, ref, accepted_ms, changes)
        if virtual and not table.ids:  # pruned to nothing: a virtual table goes
            del self.vdedup[owner]
        if undo is not None:
            undo.append((_UNDEDUP, owner, virtual, changes))
        return targets

    def _apply_clear(self, entry: Clear, undo: list[Any] | None) -> int:
        """-> how many messages were removed."""
        queue = self.queues.get(entry.queue)
        if queue is None:
            return 0
        count = len(queue.messages)
        held = queue.swap_messages()
        if undo is not None:
            undo.append((_UNCLEAR, entry.queue, held))
        self._track_finals(queue)
        return count

    def _apply_confirm(self, entry: Confirm, undo: list[Any] | None) -> bool:
        name, msg_id = entry
        queue = self.queues.get(name)
        if queue is None:
            return False
        msg = queue.messages.pop(msg_id, None)
        if msg is None:
            return False
        self.confirmed += 1
        priorities = queue.priorities
        if priorities and msg_id in priorities:
            if undo is not None:
                undo.append((_RESTORE, name, msg_id, msg, priorities[msg_id]))
            queue.unindex(msg_id, msg)
            del priorities[msg_id]
            self._track_finals(queue)
            return True
        if undo is not None:
            undo.append((_RESTORE, name, msg_id, msg, None))
        # Queue.unindex, with the retrying case inline (the hot path: a
        # consumer confirms what it was delivered).
        if msg[RETRY_AT_MS] and (len(msg) == _SHORT or not msg[FINAL]):
            queue.retrying.remove(msg[RETRY_AT_MS] << _ID_BITS | msg_id)
        else:
            queue.unindex(msg_id, msg)
            self._track_finals(queue)
        return True

    def revert(self, undo: list[Any]) -> None:
        """Take back the entries whose undo records are in `undo` (filled by
        `apply(entry, undo)`), newest first. O(k log n)."""
        queues = self.queues
        for op in reversed(undo):
            tag = op[0]
            if tag is _UNPRODUCE:
                _, name, msg_id, prev_max_id, created = op
                queue = queues[name]
                msg = queue.messages.pop(msg_id)
                queue.unindex(msg_id, msg)  # later entries are reverted: FIFO tail or `pending`
                queue.max_id = prev_max_id
                if created:
                    del queues[name]
            elif tag is _RESTORE:
                _, name, msg_id, msg, priority = op
                queue = queues[name]
                current = queue.messages.get(msg_id)
                if current is not None:
                    queue.unindex(msg_id, current)
                queue.messages[msg_id] = msg
                if priority is not None:
                    queue.priorities[msg_id] = priority
                queue.index(msg_id, msg)
                self._track_finals(queue)
            elif tag is _RECOUNT:
                queues[op[1]].dead_lettered = op[2]
            elif tag is _UNPRODUCE_MANY:
                _, name, first, count, prev_max_id, created = op
                queue = queues[name]
                for msg_id in range(first + count - 1, first - 1, -1):  # newest first
                    msg = queue.messages.pop(msg_id)
                    queue.unindex(msg_id, msg)
                    queue.priorities.pop(msg_id, None)
                queue.max_id = prev_max_id
                if created:
                    del queues[name]
            elif tag is _UNDEDUP:
                _, owner, virtual, changes = op
                if virtual:
                    table = self.vdedup.get(owner) or DedupTable()
                    table.undo(changes)
                    if table.ids:
                        self.vdedup[owner] = table
                    else:
                        self.vdedup.pop(owner, None)
                else:
                    queues[owner].dedup.undo(changes)
            elif tag is _UNCLEAR:
                queue = queues[op[1]]
                queue.swap_messages(op[2])
                self._track_finals(queue)
            else:  # _RESET
                _, name, before, created = op
                if created:
                    del queues[name]
                else:
                    queues[name].config = before
                    self._settle(queues[name])

    # -- whole-state views -------------------------------------------------

    def wire_items(self) -> Iterator[tuple[str, int, Iterator[tuple[Any, ...]], dict[str, Any]]]:
        """The state, lazily, as (name, max_id, rows, extras) per queue in
        name order, then per virtual queue's dedup table (max_id 0, no
        rows, extras {"virtual": true, "dedup": [...]}). A row is (msg_id,
        *message), and the priority last for a prioritized message (rows
        of 7, 11 or 14 values; 6, 10 or 13 without). The store must not
        change until the iteration ends. O(n log n)."""
        for name in sorted(self.queues):
            q = self.queues[name]
            yield name, q.max_id, _rows(q), q.extras()
        for name in sorted(self.vdedup):
            table = self.vdedup[name]
            if table.ids:
                yield name, 0, iter(()), {"virtual": True, "dedup": table.to_wire()}

    def to_wire(self) -> list[Any]:
        """The whole state as a canonical, msgpack-friendly value: two stores
        are equal iff their `to_wire()` values are. O(n)."""
        out: list[Any] = []
        for name, max_id, rows, extras in self.wire_items():
            msgs = [list(row) for row in rows]
            out.append([name, max_id, msgs, extras] if extras else [name, max_id, msgs])
        return out

    def load_wire(self, state: Sequence[Any] | SnapshotLoader) -> None:
        """Replace the state with one produced by `to_wire()`, or with the
        one a `snapshot_loader()` has been fed. O(n log n)."""
        if not isinstance(state, SnapshotLoader):
            loader = SnapshotLoader()
            for item in state:
                loader.queue(item[0], item[1], item[3] if len(item) > 3 else None)
                if item[2]:
                    loader.messages(item[2])
            state = loader
        self.queues = state.finish()
        self.vdedup = state.vdedup
        for queue in self.queues.values():
            self._settle(queue)
        self.final_queues = {name for name, q in self.queues.items() if q.finals}

    def snapshot_loader(self) -> SnapshotLoader:
        """A sink for `storage.format.decode_snapshot(..., sink=)`: it builds
        the queues as the snapshot is decoded, chunk by chunk, so that the
        decoded form and the store never both hold every message; the store
        changes only when `load_wire(loader)` is called."""
        return SnapshotLoader()

    def _check(self) -> None:
        """Verify every queue's invariants; raises InvariantError. O(n)."""
        for name, queue in self.queues.items():
            if name != queue.name:
                raise InvariantError(f"queue {queue.name} filed under {name}")
            queue._check()
            if len(queue.dedup.ids) > DEDUP_MAX_IDS:
                raise InvariantError(f"queue {name}: dedup table over its bound")
        for name, table in self.vdedup.items():
            if name in self.queues or not table.ids:
                raise InvariantError(f"virtual dedup table {name} beside a queue, or empty")


def _rows(queue: Queue) -> Iterator[tuple[Any, ...]]:
    """A queue's messages as snapshot rows (see Store.wire_items)."""
    messages = queue.messages
    priorities = queue.priorities
    for msg_id in sorted(messages):
        priority = priorities.get(msg_id) if priorities else None
        if priority is None:
            yield (msg_id, *messages[msg_id])
        else:
            yield (msg_id, *messages[msg_id], priority)


class SnapshotLoader:
    """Builds a store's queues from a snapshot's (queue, messages...) stream
    (see `Store.snapshot_loader`). Messages of one queue come in msg_id
    order; each is (msg_id, data, ready_ms, ttl_ms, retry_ms, retry_at_ms).
    Never-delivered messages go to the FIFO as `_apply_produce` puts them
    (in id order: to the tail when not earlier than it), the others'
    keys to `pending`.
    """

    __slots__ = ("queues", "vdedup", "_queue", "_pending", "_retrying", "_finals", "_pdelayed",
                 "_pretrying", "_last_ready", "_last_ttl")

    def __init__(self) -> None:
        self.queues: dict[str, Queue] = {}
        self.vdedup: dict[str, DedupTable] = {}  # virtual queues' dedup tables
        self._pdelayed: list[int] = []  # keys of prioritized messages, sorted at the end
        self._pretrying: list[int] = []
        self._queue: Queue | None = None  # the queue messages go to
        self._pending: list[int] = []  # its index keys (not the FIFO's), sorted at the end
        self._retrying: list[int] = []
        self._finals: list[int] = []
        self._last_ready = self._last_ttl = -1  # shared time objects, as in Store

    def queue(self, name: str, max_id: int, extras: Mapping[str, Any] | None = None) -> None:
        """A queue begins; `extras` as `Queue.extras()` gave them. Raises
        ValueError on bad extras."""
        self._close_queue()
        if extras and extras.get("virtual") is True:  # a virtual queue's dedup table
            if set(extras) != {"virtual", "dedup"} or max_id:
                raise ValueError(f"virtual queue {name}: malformed dedup table")
            self.vdedup[name] = DedupTable.from_wire(extras["dedup"], f"virtual queue {name}")
            return  # (no messages may follow: `messages` refuses them)
        q = self._queue = self.queues[name] = Queue(name)
        q.max_id = max_id
        if extras:
            q.load_extras(extras)

    def messages(self, batch: Iterable[Sequence[Any]]) -> None:
        # The sink's protocol: queue() came first (one check per chunk of
        # thousands of messages).
        q = self._queue
        if q is None:
            raise ValueError("snapshot messages outside a queue")
        messages, pending, retrying = q.messages, self._pending, self._retrying
        fifo, fifo_ready = q.fifo, q.fifo_ready
        last_ready, last_ttl = self._last_ready, self._last_ttl
        for row in batch:
            if len(row) != 6:  # delivered before, a dead letter, or prioritized
                msg_id = row[0]
                if len(row) in _PRIORITIZED_ROWS:
                    priority = row[-1]
                    if type(priority) is not int or priority == DEFAULT_PRIORITY \
                            or not 0 <= priority < 1 << 31:
                        raise ValueError(f"queue {q.name}: bad priority {priority!r}")
                    msg = tuple(row[1:-1])
                    messages[msg_id] = msg
                    q.priorities[msg_id] = priority
                    retry_at_ms = msg[RETRY_AT_MS]
                    if retry_at_ms and len(msg) > _SHORT and msg[FINAL]:
                        self._finals.append(retry_at_ms << _ID_BITS | msg_id)
                    elif retry_at_ms:
                        self._pretrying.append(retry_at_ms << _ID_BITS | msg_id)
                    else:
                        self._pdelayed.append(msg[READY_MS] << _ID_BITS | msg_id)
                    continue
                msg = tuple(row[1:])
                messages[msg_id] = msg
                retry_at_ms = msg[RETRY_AT_MS]
                if retry_at_ms:
                    key = retry_at_ms << _ID_BITS | msg_id
                    (self._finals if msg[FINAL] else retrying).append(key)
                elif msg[READY_MS] >= fifo_ready or not fifo:
                    fifo.append(msg_id)
                    fifo_ready = msg[READY_MS]
                else:
                    pending.append(msg[READY_MS] << _ID_BITS | msg_id)
                continue
            msg_id, data, ready_ms, ttl_ms, retry_ms, retry_at_ms = row
            # Share equal times between neighbours, as _apply_produce does.
            if ready_ms == last_ready:
                ready_ms = last_ready
            else:
                last_ready = ready_ms
            if ttl_ms == last_ttl:
                ttl_ms = last_ttl
            else:
                last_ttl = ttl_ms
            messages[msg_id] = (data, ready_ms, ttl_ms, retry_ms, retry_at_ms)
            if retry_at_ms:
                retrying.append(retry_at_ms << _ID_BITS | msg_id)
            elif ready_ms >= fifo_ready or not fifo:
                fifo.append(msg_id)
                fifo_ready = ready_ms
            else:
                pending.append(ready_ms << _ID_BITS | msg_id)
        q.fifo_ready = fifo_ready
        self._last_ready, self._last_ttl = last_ready, last_ttl

    def _close_queue(self) -> None:
        if self._queue is not None:
            self._queue.pending.update(self._pending)
            self._queue.retrying.update(self._retrying)
            self._queue.finals.update(self._finals)
            self._queue.pdelayed.update(self._pdelayed)
            self._queue.pretrying.update(self._pretrying)
            self._pending, self._retrying, self._finals = [], [], []
            self._pdelayed, self._pretrying = [], []
            self._queue = None

    def finish(self) -> dict[str, Queue]:
        self._close_queue()
        return self.queues
