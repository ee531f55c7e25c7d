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

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from sortedcontainers import SortedList

from ..errors import InvariantError
from ..wire.requests import (
    RELATIVE_TIME_LIMIT_S,
    ConfirmRequest,
    ConsumeRequest,
    ProduceRequest,
)
from .entries import Confirm, Consume, Entry, Noop, Produce

__all__ = ["Message", "Queue", "Store", "SnapshotLoader", "DEFAULT_TTL_MS", "WAIT_STATUS_SAMPLE"]

_ID_BITS = 64
_ID_MASK = (1 << _ID_BITS) - 1

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

# wait_status sums the waiting time of at most this many of the oldest ready
# messages (queue_server's sample size): a cheap congestion signal.
WAIT_STATUS_SAMPLE = 16
# ...each counted for at most this many seconds, as queue_server did.
WAIT_STATUS_CAP_S = 255


# A message is a plain tuple (data, ready_ms, ttl_ms, retry_ms, retry_at_ms),
# read through these indexes, rather than an object: tuples of atomic values
# are untracked by the cyclic garbage collector, so a million stored
# messages cost its full passes nothing (with objects, those passes cost
# more than the rest of a produce; bench/). Exact tuples only: CPython does
# not untrack tuple subclasses such as NamedTuple. A consume replaces the
# tuple instead of mutating it.
#   data: the client's string; ready_ms: when first deliverable;
#   ttl_ms: a delivery whose next retry reaches it is the last;
#   retry_ms: 0 = at-most-once; retry_at_ms: 0 while pending, else its key
#   time in `retrying`.
Message = tuple[str, int, int, int, int]
# (Final: mypy then knows each index, and so each field's type.)
DATA: Final = 0
READY_MS: Final = 1
TTL_MS: Final = 2
RETRY_MS: Final = 3
RETRY_AT_MS: Final = 4


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


class Queue:
    """A real queue: messages by id, plus the FIFO, pending and retry indexes."""

    __slots__ = ("name", "messages", "fifo", "fifo_ready", "pending", "retrying", "max_id")

    def __init__(self, name: str) -> None:
        self.name = name
        self.messages: dict[int, Message] = {}  # every live message (a 5-tuple), by id
        # ids of never-delivered messages in (ready_ms, msg_id) order; not in `pending`
        self.fifo: deque[int] = deque()
        # >= the ready_ms of the FIFO's tail (may be higher, never lower); any value when empty
        self.fifo_ready = 0
        self.pending = _Keys()  # keys of never-delivered messages not in `fifo`
        self.retrying = _Keys()  # keys of delivered, unconfirmed messages
        self.max_id = 0  # highest msg_id ever assigned; ids never repeat

    def __len__(self) -> int:
        return len(self.messages)

    def next_due(self, now_ms: int) -> int | None:
        """The msg_id a consume at `now_ms` delivers, or None. O(1)."""
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
        return None if best is None else best & _ID_MASK

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
        return (pending_ready + retry_due,
                len(self.pending) + len(self.fifo) - pending_ready,
                len(self.retrying) - retry_due)

    def wait_status(self, now_ms: int) -> int:
        """queue_server's congestion figure: the seconds waited by the oldest
        ready messages (at most 16, each capped at 255 s). O(1)."""
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
        if retry_at_ms:
            self.retrying.remove(retry_at_ms << _ID_BITS | msg_id)
        else:
            self.unindex_pending(msg_id, msg[READY_MS])

    def unindex_pending(self, msg_id: int, ready_ms: int) -> None:
        """Remove a never-delivered message from the FIFO or `pending`.
        Costs as `unindex`."""
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
        self.pending._check()
        self.retrying._check()
        sizes = (len(self.fifo), len(self.pending), len(self.retrying))
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
            if key <= previous:
                raise InvariantError(f"queue {self.name}: FIFO out of order at {msg_id}")
            previous = key
            indexed.add(msg_id)
        if self.fifo and self.fifo_ready < self.messages[self.fifo[-1]][READY_MS]:
            raise InvariantError(f"queue {self.name}: fifo_ready {self.fifo_ready} "
                                 f"below the tail's ready time")
        for key in self.pending:
            msg = self.messages.get(key & _ID_MASK)
            if msg is None or msg[RETRY_AT_MS] or key >> _ID_BITS != msg[READY_MS]:
                raise InvariantError(f"queue {self.name}: stale pending key {key}")
            indexed.add(key & _ID_MASK)
        for key in self.retrying:
            msg = self.messages.get(key & _ID_MASK)
            if msg is None or key >> _ID_BITS != msg[RETRY_AT_MS]:
                raise InvariantError(f"queue {self.name}: stale retry key {key}")
            indexed.add(key & _ID_MASK)
        if len(indexed) != len(self.messages):  # with the sizes: none in two places
            raise InvariantError(f"queue {self.name}: a message is indexed twice")
        for msg_id, msg in self.messages.items():
            if not 0 < msg_id <= self.max_id:
                raise InvariantError(f"queue {self.name}: id {msg_id} > max_id {self.max_id}")
            if type(msg) is not tuple or len(msg) != 5:
                raise InvariantError(f"queue {self.name}: message {msg_id} is not a 5-tuple")
            if msg[RETRY_AT_MS] and not msg[RETRY_MS]:
                raise InvariantError(f"queue {self.name}: at-most-once message {msg_id} retrying")


def _apply_noop(entry: Noop, undo: list[Any] | None) -> None:
    return None


class Store:
    """Every queue of a node, and the two steps that change them.

    Args:
        queue_size: the most messages one queue may hold; a produce into a
            full queue is refused, nothing is dropped.
        virtual_queues: name -> real queue names a produce fans out to.
    """

    def __init__(self, *, queue_size: int,
                 virtual_queues: Mapping[str, Sequence[str]] | None = None) -> None:
        self.queue_size = queue_size
        self.virtual_queues = {k: tuple(v) for k, v in (virtual_queues or {}).items()}
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
            Confirm: self._apply_confirm, Noop: _apply_noop}

    # -- reads -----------------------------------------------------------

    def get(self, name: str) -> Queue | None:
        return self.queues.get(name)

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
                targets = ((queue, 1),)
            elif len(q.messages) >= self.queue_size:
                return f"queue full: {queue}"
            else:
                targets = ((queue, q.max_id + 1),)
            return _new(Produce, (targets, data, ready_ms, ttl_ms, retry_ms))
        listed = []
        for name in members:
            q = queues.get(name)
            if q is None:
                listed.append((name, 1))
            elif len(q.messages) >= self.queue_size:
                return f"queue full: {name}"
            else:
                listed.append((name, q.max_id + 1))
        return _new(Produce, (tuple(listed), data, ready_ms, ttl_ms, retry_ms))

    def decide_consume(self, req: ConsumeRequest, now_ms: int) -> Consume | str | None:
        """Decide a consume: an entry, None when nothing is ready, or a
        reason. O(1)."""
        return self.decide_consume_values(req[0], now_ms)

    def decide_consume_values(self, queue: str, now_ms: int) -> Consume | str | None:
        """`decide_consume` from the request's queue name. O(1)."""
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
        retry_at_ms = 0
        if retry_ms:
            retry_at_ms = now_ms + retry_ms
            if retry_at_ms >= msg[TTL_MS]:
                retry_at_ms = 0  # the last delivery before the ttl
        return _new(Consume, (queue, msg_id, retry_at_ms))

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
        raise InvariantError(f"cannot apply {entry!r}")

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
                queue = queues[name] = Queue(name)
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
        return targets

    def _apply_consume(self, entry: Consume, undo: list[Any] | None) -> tuple[int, str]:
        name, msg_id, retry_at_ms = entry
        queue = self.queues.get(name)
        if queue is None or (msg := queue.messages.get(msg_id)) is None:
            raise InvariantError(f"consume of missing message {name}/{msg_id}")
        if undo is not None:
            undo.append((_RESTORE, name, msg_id, msg))
        data, ready_ms, ttl_ms, retry_ms, old_retry_at_ms = msg
        # Queue.unindex, with the common cases inline (the hot path). A
        # consume takes the earliest message: a head of an index.
        if old_retry_at_ms:
            queue.retrying.remove(old_retry_at_ms << _ID_BITS | msg_id)
        else:
            fifo = queue.fifo
            if fifo and fifo[0] == msg_id:
                fifo.popleft()
            else:
                queue.unindex_pending(msg_id, ready_ms)
        if retry_at_ms:
            queue.messages[msg_id] = (data, ready_ms, ttl_ms, retry_ms, retry_at_ms)
            queue.retrying.add(retry_at_ms << _ID_BITS | msg_id)
        else:
            del queue.messages[msg_id]
        return msg_id, data

    def _apply_confirm(self, entry: Confirm, undo: list[Any] | None) -> bool:
        name, msg_id = entry
        queue = self.queues.get(name)
        if queue is None:
            return False
        msg = queue.messages.pop(msg_id, None)
        if msg is None:
            return False
        if undo is not None:
            undo.append((_RESTORE, name, msg_id, msg))
        # Queue.unindex, with the retrying case inline (the hot path: a
        # consumer confirms what it was delivered).
        if msg[RETRY_AT_MS]:
            queue.retrying.remove(msg[RETRY_AT_MS] << _ID_BITS | msg_id)
        else:
            queue.unindex_pending(msg_id, msg[READY_MS])
        return True

    def revert(self, undo: list[Any]) -> None:
        """Take back the entries whose undo records are in `undo` (filled by
        `apply(entry, undo)`), newest first. O(k log n)."""
        queues = self.queues
        for op in reversed(undo):
            if op[0] is _UNPRODUCE:
                _, name, msg_id, prev_max_id, created = op
                queue = queues[name]
                msg = queue.messages.pop(msg_id)
                queue.unindex(msg_id, msg)  # later entries are reverted: FIFO tail or `pending`
                queue.max_id = prev_max_id
                if created:
                    del queues[name]
            else:
                _, name, msg_id, msg = op
                queue = queues[name]
                current = queue.messages.get(msg_id)
                if current is not None:
                    queue.unindex(msg_id, current)
                queue.messages[msg_id] = msg
                if msg[RETRY_AT_MS]:
                    queue.retrying.add(msg[RETRY_AT_MS] << _ID_BITS | msg_id)
                else:
                    queue.index_pending(msg_id, msg)

    # -- whole-state views -------------------------------------------------

    def to_wire(self) -> list[Any]:
        """The whole state as a canonical, msgpack-friendly value: two stores
        are equal iff their `to_wire()` values are. O(n)."""
        out: list[Any] = []
        for name in sorted(self.queues):
            q = self.queues[name]
            msgs = [[i, *m] for i, m in sorted(q.messages.items())]
            out.append([name, q.max_id, msgs])
        return out

    def load_wire(self, state: Sequence[Any] | SnapshotLoader) -> None:
        """Replace the state with one produced by `to_wire()`, or with the
        one a `snapshot_loader()` has been fed. O(n log n)."""
        if isinstance(state, SnapshotLoader):
            self.queues = state.finish()
            return
        loader = SnapshotLoader()
        for name, max_id, msgs in state:
            loader.queue(name, max_id)
            loader.messages(msgs)
        self.queues = loader.finish()

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


class SnapshotLoader:
    """Builds a store's queues from a snapshot's (queue, messages...) stream
    (see `Store.snapshot_loader`). Messages of one queue come in msg_id
    order; each is (msg_id, data, ready_ms, ttl_ms, retry_ms, retry_at_ms).
    Never-delivered messages go to the FIFO as `_apply_produce` puts them
    (in id order: to the tail when not earlier than it), the others'
    keys to `pending`.
    """

    __slots__ = ("queues", "_queue", "_pending", "_retrying", "_last_ready", "_last_ttl")

    def __init__(self) -> None:
        self.queues: dict[str, Queue] = {}
        self._queue: Queue | None = None  # the queue messages go to
        self._pending: list[int] = []  # its index keys (not the FIFO's), sorted at the end
        self._retrying: list[int] = []
        self._last_ready = self._last_ttl = -1  # shared time objects, as in Store

    def queue(self, name: str, max_id: int) -> None:
        self._close_queue()
        q = self._queue = self.queues[name] = Queue(name)
        q.max_id = max_id

    def messages(self, batch: Iterable[Sequence[Any]]) -> None:
        # The sink's protocol: queue() came first, so there is a queue; no
        # check here (a snapshot's millions of messages come through).
        q: Queue = self._queue  # type: ignore[assignment]
        messages, pending, retrying = q.messages, self._pending, self._retrying
        fifo, fifo_ready = q.fifo, q.fifo_ready
        last_ready, last_ttl = self._last_ready, self._last_ttl
        for msg_id, data, ready_ms, ttl_ms, retry_ms, retry_at_ms in batch:
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
            self._pending, self._retrying = [], []
            self._queue = None

    def finish(self) -> dict[str, Queue]:
        self._close_queue()
        return self.queues
