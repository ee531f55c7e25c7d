"""The Store against a plain model, under random produce (plain, and
batches with priorities and dedup ids), consume (with lease, count, several
queues), confirm (with and without a receipt), nack, touch, config
(max_deliveries, dead_letter, max_size, dedup_window, paused), clear,
failovers (some to a master whose clock is behind) and time.

The model is deliberately naive: a dict of messages per queue, linear
scans and sorts, the rules of design.md section 1, of issue 14
(../spec14.md, protocol-v2.md, the README's Receipts and Dead letters) and
of issue 15 (../spec15.md: priorities, batches, dedup, pause, clear,
max_size) written out directly, with no indexes, no tuple layouts and no
fast paths. Consumes take the lowest priority first, then the earliest due
time, then the lowest id. A dedup table is a dict in the order ids were
first accepted, pruned from its oldest end by each batch's cutoff and
bounded by DEDUP_BOUND (the store's DEDUP_MAX_IDS, made small here so that
the bound is reached).
Each rule drives the store as the service does (decide on the "master",
compare the decision with the model's, apply it), so the decisions are
checked as well as the state:

- a consume that meets a message already delivered max_deliveries times
  (the limit was lowered since) gets a dead-letter move first, then decides
  again; a batch stops before such a message (the next consume moves it);
- confirm with a receipt is refused (`stale receipt`, nothing changes)
  unless the receipt names the message's current delivery;
- the master's timer (`advance` with `tick`) moves out every final delivery
  whose lease ran out, in batches of `decide_expired`'s `limit`;
- a produce with `messages`, a priority or a dedup_id goes through
  `decide_produce_batch`: the model predicts its refusal (paused, a time
  error naming the index, full), its plan (new, a duplicate of the table, a
  duplicate of an earlier item) and so the answer's msg_ids and duplicates,
  and the entry (items, cutoff) itself.

After every rule the store must pass `_check()`, match the model (every
message and its fields, show's view of it, the queue's settings and
counters, what consumes would deliver next and in which order, the counts
monitor gives, the next final lease, when the next message is due), a
fresh Store fed every entry applied so far (through the log's wire form)
must reach the same `to_wire()`, and a `to_wire`/`load_wire` round trip must
be equal. `to_wire()` holds the priorities, the settings set and the dedup
tables (the virtual queue's too), so comparing it with the model's checks
them all.

Every entry is applied with an undo list, as the master does before the
entry commits; a `revert` rule takes back the newest few entries, newest
first (a deposed master rolling back its uncommitted tail), and the store
must be exactly as it was before them.

`run_steps` tests run the machine through chosen rules, for paths random
runs reach rarely.

Deterministic by default (CI): `derandomize`. QSERVER_STATEFUL_EXAMPLES=N
runs N random examples instead, to look further.
"""

from __future__ import annotations

import copy
import os

import pytest
from hypothesis import HealthCheck, currently_in_test_context, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from qserver.state import store as store_module
from qserver.state.entries import (
    Clear,
    Configure,
    Confirm,
    Consume,
    ConsumeMany,
    DeadLetter,
    Nack,
    Produce,
    ProduceBatch,
    Touch,
    entry_from_wire,
    entry_to_wire,
)
from qserver.state.store import Store, message_view, receipt_text
from qserver.wire.requests import (
    ConfirmRequest,
    ConsumeRequest,
    ProduceBatchRequest,
    ProduceItem,
    ProduceRequest,
)

QUEUE_SIZE = 5
REAL = ("alpha", "beta", "gamma")
VIRTUAL = {"fan": ("beta", "alpha")}  # deliberately not in sorted order
DLQ = "dlq"  # a real queue that only config and dead letters create
UNKNOWN = "ghost"  # never produced into, configured, or dead-lettered into
HOUR_MS = 3_600_000  # the default ttl, and a dead letter's fresh ttl
START_MS = 1_700_000_000_000
EPOCH = 7  # the first master's epoch; a failover takes a higher one

# The wire codes of the reasons a message leaves (entries.FINAL_*); the
# model keeps the names that show answers.
REASON_CODES = {None: 0, "max_deliveries": 1, "expired": 2}
DEFAULT_PRIORITY = 1024  # beanstalkd's
DEFAULT_WINDOW_MS = 300_000  # a queue's dedup window unless set
# The store's DEDUP_MAX_IDS during these tests: small enough that tables
# fill from the alphabet of DEDUP_IDS, and below the largest batch (5), so
# that one batch may push out ids it added itself.
DEDUP_BOUND = 3
DEDUP_IDS = ("d1", "d2", "d3", "d4", "d5")


@pytest.fixture(autouse=True)
def small_dedup_bound(monkeypatch):
    monkeypatch.setattr(store_module, "DEDUP_MAX_IDS", DEDUP_BOUND)


def event(text: str) -> None:
    """Count a path taken (--hypothesis-show-statistics); also outside a
    hypothesis run (`run_steps`)."""
    if currently_in_test_context():
        hypothesis_event(text)


def to_ms(value_s, now_ms: int) -> int:
    """Client seconds to absolute ms: below 1e9 is relative to now."""
    if value_s < 1_000_000_000:
        return now_ms + round(value_s * 1000)
    return round(value_s * 1000)


class ModelMessage:
    def __init__(self, data, ready, ttl, retry, origin=None, priority=DEFAULT_PRIORITY):
        self.data = data
        self.priority = priority  # lower first; a dead letter gets the default
        self.ready = ready  # when deliverable while not in flight
        self.ttl = ttl
        self.retry = retry
        self.lease_end = None  # None: not in flight; else when its delivery's lease runs out
        self.deliveries = 0
        self.nacks = 0
        self.receipt = None  # (epoch, msg_id, deliveries) of the current delivery, if any
        self.final = None  # None, or why it leaves when its lease runs out
        self.origin = origin  # a dead letter's (queue, msg_id, reason)

    def clone(self):
        return copy.copy(self)  # every field holds an immutable value

    def due(self):
        """When a consume may take it, or None: a final delivery never
        comes back."""
        if self.lease_end is None:
            return self.ready
        return None if self.final else self.lease_end


class ModelQueue:
    def __init__(self):
        self.msgs: dict[int, ModelMessage] = {}
        self.max_id = 0
        self.max_deliveries = 0  # 0 = unlimited
        self.dead_letter = None
        self.dead_lettered = 0
        self.config = {}  # the settings config (5) set explicitly (snapshot extras)
        # dedup_id -> (ref, accepted at), in the order first accepted
        self.dedup: dict[str, tuple] = {}

    def window(self):
        return self.config.get("dedup_window_ms", DEFAULT_WINDOW_MS)

    def paused(self):
        return self.config.get("paused", "none")

    def bound(self):
        """The most messages a produce may leave it holding."""
        return self.config.get("max_size") or QUEUE_SIZE

    def deliverable(self, now):
        """The ids consumes at `now` take, in that order (lowest priority
        first, then earliest due time, then lowest id; nothing while paused
        out): each is delivered, or moved out when it is over a lowered
        max_deliveries (peek leaves those out)."""
        if self.paused() in ("out", "all"):
            return []
        due = [(m.priority, m.due(), i) for i, m in self.msgs.items()
               if m.due() is not None and m.due() <= now]
        return [i for _, _, i in sorted(due)]

    def clone(self):
        twin = copy.copy(self)
        twin.msgs = {i: m.clone() for i, m in self.msgs.items()}
        twin.config = dict(self.config)
        twin.dedup = dict(self.dedup)
        return twin

    def over_limit(self, m):
        """Delivered max_deliveries times already (the limit was lowered
        since): a consume moves it out instead of delivering it."""
        return bool(m.retry and self.max_deliveries and m.deliveries >= self.max_deliveries)

    def settings(self):
        window_s = self.window() / 1000
        return {"max_deliveries": self.max_deliveries, "dead_letter": self.dead_letter,
                "max_size": self.bound(),
                "dedup_window": int(window_s) if window_s.is_integer() else window_s,
                "paused": self.paused()}


def prune(table, cutoff):
    """Drop a dedup table's oldest ids while accepted at or before `cutoff`."""
    while table:
        oldest = next(iter(table))
        if table[oldest][1] > cutoff:
            return
        del table[oldest]


def times(delay, ttl, now):
    """(ready, ttl) in ms of a produce at `now`, or None: a time error."""
    ready = now if delay is None else to_ms(delay, now)
    ttl_ms = ready + HOUR_MS if ttl is None else to_ms(ttl, now)
    if ttl_ms < ready:
        return None
    return max(ready, now), ttl_ms


class Model:
    def __init__(self):
        self.queues: dict[str, ModelQueue] = {}
        self.handed_out: dict[tuple[str, int], list] = {}  # receipts answered, per message
        self.vdedup: dict[str, dict] = {}  # a virtual queue's dedup table, as ModelQueue's

    def clone(self):
        """A copy that shares nothing mutable (what a revert restores)."""
        twin = Model()
        twin.queues = {name: q.clone() for name, q in self.queues.items()}
        twin.handed_out = {key: list(r) for key, r in self.handed_out.items()}
        twin.vdedup = {name: dict(t) for name, t in self.vdedup.items()}
        return twin

    def view(self, name):
        """Queue `name`, or a fresh one with the default settings."""
        return self.queues.get(name) or ModelQueue()

    def refusal(self, queue, count):
        """Why `count` new messages into `queue` (real or virtual) are
        refused, or None: the first real queue, in the configured order,
        that is paused in (or all) or would hold more than its bound."""
        virtual = queue in VIRTUAL
        for name in VIRTUAL.get(queue, (queue,)):
            q = self.view(name)
            if q.paused() in ("in", "all"):
                return f"queue paused: {name}" if virtual else "queue paused"
            if len(q.msgs) + count > q.bound():
                return f"queue full: {name}"
        return None

    def _add(self, name, msg):
        q = self.queues.setdefault(name, ModelQueue())
        q.max_id += 1
        q.msgs[q.max_id] = msg
        return name, q.max_id

    def produce(self, queue, data, delay, ttl, retry, now):
        """A produce without priority or dedup_id: the (queue, msg_id) of
        each message, or the reason it is refused."""
        found = times(delay, ttl, now)
        if found is None:
            return "time error"
        ready, ttl_ms = found
        # A queue may hold more than its bound (dead letters are never
        # refused, the bound may be lowered); producers are still refused.
        refused = self.refusal(queue, 1)
        if refused:
            return refused
        return tuple(self._add(name, ModelMessage(data, ready, ttl_ms, round(retry * 1000)))
                     for name in VIRTUAL.get(queue, (queue,)))

    def produce_batch(self, queue, items, batch, now):
        """A produce through decide_produce_batch; items are ProduceItems.
        -> the reason it is refused, or (plan, (targets, entry items,
        cutoff) or None when every item is a duplicate, the answer's
        msg_ids, notes for the statistics)."""
        names = VIRTUAL.get(queue, (queue,))
        virtual = queue in VIRTUAL
        for name in names:  # paused: before anything else
            if self.view(name).paused() in ("in", "all"):
                return f"queue paused: {name}" if virtual else "queue paused"
        timed = []
        for index, it in enumerate(items):
            found = times(it.delay_s, it.ttl_s, now)
            if found is None:
                return f"messages[{index}]: time error" if batch else "time error"
            timed.append(found)
        window = self.view(names[0]).window()
        table = self.vdedup.get(queue) if virtual else self.view(queue).dedup
        table = table or {}
        notes = set()
        plan, new, seen = [], [], {}
        for it, (ready, ttl_ms) in zip(items, timed, strict=True):
            dedup_id = it.dedup_id if window else ""
            if dedup_id:
                if dedup_id in table:
                    ref, at = table[dedup_id]
                    if now < at + window:
                        plan.append(("dup", ref))
                        notes.add("a duplicate of the table" + (
                            ", 1 ms before the window's edge" if now == at + window - 1
                            else ""))
                        continue
                    notes.add("an id again at the window's edge" if now == at + window
                              else "an id again past its window")
                if dedup_id in seen:
                    plan.append(("same", seen[dedup_id]))
                    notes.add("an id twice in one batch")
                    continue
                seen[dedup_id] = len(new)
            elif it.dedup_id:
                notes.add("dedup off (window 0)")
            plan.append(len(new))
            new.append((it.data, ready, ttl_ms, round(it.retry_s * 1000), it.priority, dedup_id))
        if not new:
            return plan, None, [self._answer_ref(step[1]) for step in plan], notes | {
                "duplicates only"}
        refused = self.refusal(queue, len(new))
        if refused:
            return refused
        targets = tuple((name, self.view(name).max_id + 1) for name in names)
        for data, ready, ttl_ms, retry_ms, priority, _ in new:
            for name in names:
                self._add(name, ModelMessage(data, ready, ttl_ms, retry_ms, priority=priority))
        cutoff = max(0, now - window)
        ids = [tuple((name, first + k) for name, first in targets) if virtual
               else targets[0][1] + k for k in range(len(new))]
        if virtual:
            table = self.vdedup.get(queue)
            if table is None and any(item[5] for item in new):
                table = self.vdedup[queue] = {}
        else:
            table = self.queues[queue].dedup
        if table is not None:
            before = len(table)
            prune(table, cutoff)
            if len(table) < before:
                notes.add("pruned")
            for k, item in enumerate(new):
                if item[5]:
                    if item[5] not in table and len(table) >= DEDUP_BOUND:
                        del table[next(iter(table))]
                        notes.add("an id pushed out by the bound")
                    table[item[5]] = (ids[k], now)
            if virtual and not table:
                del self.vdedup[queue]
        answer = []
        for step in plan:
            if type(step) is int:
                answer.append(self._answer_ref(ids[step]))
            elif step[0] == "same":
                answer.append(self._answer_ref(ids[step[1]]))
            else:
                answer.append(self._answer_ref(step[1]))
        return plan, (targets, tuple(new), cutoff), answer, notes

    @staticmethod
    def _answer_ref(ref):
        """A msg_id as an answer names it: an int, or {real queue: msg_id}."""
        return ref if type(ref) is int else dict(ref)

    def clear(self, queue):
        """How many messages were removed, or 'virtual'. The settings,
        max_id and dedup table stay."""
        if queue in VIRTUAL:
            return "virtual"
        q = self.queues.get(queue)
        if q is None:
            return 0
        count = len(q.msgs)
        q.msgs = {}
        return count

    # -- leaving the queue ---------------------------------------------

    def move_out(self, queue, msg_id, reason, now):
        """The message leaves `queue` for `reason`: into the queue's
        dead-letter queue (each real queue of a virtual one) as a new
        message ready now with a fresh ttl, or deleted. Either way the
        queue's dead_lettered grows. -> the (queue, msg_id) of the copies."""
        q = self.queues[queue]
        m = q.msgs.pop(msg_id)
        q.dead_lettered += 1
        if q.dead_letter is None:
            return ()
        return tuple(
            self._add(name, ModelMessage(m.data, now, now + HOUR_MS, m.retry,
                                         origin=(queue, msg_id, reason)))
            for name in VIRTUAL.get(q.dead_letter, (q.dead_letter,)))

    def expired_finals(self, now):
        return {(name, i) for name, q in self.queues.items() for i, m in q.msgs.items()
                if m.final and m.lease_end <= now}

    # -- consume -------------------------------------------------------

    def _deliver(self, name, msg_id, lease, now, epoch):
        """Deliver one message; -> (queue, msg_id, data, deliveries,
        lease_end or 0 when deleted by this delivery, final reason)."""
        q = self.queues[name]
        m = q.msgs[msg_id]
        n = m.deliveries + 1
        if m.retry == 0:  # at-most-once: gone once delivered
            del q.msgs[msg_id]
            return name, msg_id, m.data, n, 0, None
        end = now + (lease or m.retry)
        last = q.max_deliveries and n >= q.max_deliveries
        reaches_ttl = end >= m.ttl
        if reaches_ttl and not last and q.dead_letter is None:
            del q.msgs[msg_id]  # queue_server's last delivery: deleted, no receipt
            return name, msg_id, m.data, n, 0, None
        m.lease_end, m.deliveries, m.receipt = end, n, (epoch, msg_id, n)
        m.final = "max_deliveries" if last else "expired" if reaches_ttl else None
        return name, msg_id, m.data, n, end, m.final

    def consume(self, names, count, lease, now, epoch):
        """One consume decision: 'virtual', None (nothing deliverable), a
        move ('move', queue, msg_id, reason, targets) that must come first
        (the caller decides again), or ('deliver', [items]): up to `count`
        messages, the first listed queue first, each queue in delivery
        order; a batch ends before a message that must be moved."""
        if any(name in VIRTUAL for name in names):
            return "virtual"
        items = []
        for name in names:
            q = self.queues.get(name)
            if q is None:
                continue
            for msg_id in q.deliverable(now):
                if q.over_limit(q.msgs[msg_id]):
                    if items:
                        return "deliver", items
                    targets = self.move_out(name, msg_id, "max_deliveries", now)
                    return "move", name, msg_id, "max_deliveries", targets
                items.append(self._deliver(name, msg_id, lease, now, epoch))
                if len(items) == count:
                    return "deliver", items
        return ("deliver", items) if items else None

    # -- receipts, confirm, nack, touch --------------------------------

    def message(self, queue, msg_id):
        q = self.queues.get(queue)
        return None if q is None else q.msgs.get(msg_id)

    def receipt_is_current(self, queue, msg_id, receipt):
        m = self.message(queue, msg_id)
        return m is not None and m.receipt is not None and m.receipt == receipt

    def confirm(self, queue, msg_id, receipt):
        """True (deleted), None (unknown id, not an error), 'stale
        receipt' (nothing changes) or 'virtual'."""
        if queue in VIRTUAL:
            return "virtual"
        if receipt is not None and not self.receipt_is_current(queue, msg_id, receipt):
            return "stale receipt"
        m = self.message(queue, msg_id)
        if m is None:
            return None
        del self.queues[queue].msgs[msg_id]
        return True

    def _in_flight(self, queue, msg_id, receipt, now):
        """The message a nack or touch acts on, or why not: delivered,
        unconfirmed and its lease still running (a final delivery whose
        lease ran out is not in flight either: it waits to be moved out)."""
        if queue in VIRTUAL:
            return "virtual"
        if receipt is not None and not self.receipt_is_current(queue, msg_id, receipt):
            return "stale receipt"
        m = self.message(queue, msg_id)
        if m is None or m.lease_end is None or m.lease_end <= now:
            return "not in flight"
        return m

    def nack(self, queue, msg_id, receipt, ready, now):
        """('ready', ready_ms), ('move', reason, targets), or an error."""
        m = self._in_flight(queue, msg_id, receipt, now)
        if isinstance(m, str):
            return m
        ready = max(ready, now)
        q = self.queues[queue]
        if m.final:  # its last delivery: it leaves as its lease running out would
            reason = m.final
        elif q.max_deliveries and m.deliveries >= q.max_deliveries:
            reason = "max_deliveries"
        elif ready >= m.ttl:
            reason = "expired"
        else:
            # Its receipt stays current until the next delivery: a late
            # confirm before anyone took it again succeeds.
            m.lease_end, m.ready, m.nacks = None, ready, m.nacks + 1
            return "ready", ready
        return "move", reason, self.move_out(queue, msg_id, reason, now)

    def touch(self, queue, msg_id, receipt, lease, now):
        """(lease_end, final reason) or an error."""
        m = self._in_flight(queue, msg_id, receipt, now)
        if isinstance(m, str):
            return m
        m.lease_end = now + (lease or m.retry)
        if m.final is None and m.lease_end >= m.ttl:
            m.final = "expired"
        return m.lease_end, m.final

    def configure(self, queue, changes):
        """The settings after the change, or an error."""
        if queue in VIRTUAL:
            return "virtual"
        target = changes.get("dead_letter")
        if target and (target == queue or queue in VIRTUAL.get(target, ())):
            return "bad value for dead_letter"
        q = self.queues.setdefault(queue, ModelQueue())
        q.config.update(changes)
        if "max_deliveries" in changes:
            q.max_deliveries = changes["max_deliveries"]
        if "dead_letter" in changes:
            q.dead_letter = changes["dead_letter"] or None
        return q.settings()

    def dedup_edges(self, now):
        """The times after `now` at which a dedup id stops being a duplicate,
        and one ms before (the window's edge, for `advance`)."""
        out = []
        tables = [(q.window(), q.dedup) for q in self.queues.values()]
        tables += [(self.view(VIRTUAL[name][0]).window(), t) for name, t in self.vdedup.items()]
        for window, table in tables:
            for _, at in table.values():
                out += [t for t in (at + window - 1, at + window) if t > now]
        return out

    # -- views ---------------------------------------------------------

    def wire(self):
        """The state in `Store.to_wire()`'s layout: per queue [name,
        max_id, messages] plus the settings set, the counter and the dedup
        table ([dedup_id, ref, accepted at] oldest first); per message [id,
        data, ready, ttl, retry, lease end or 0], then, once delivered,
        deliveries, nacks, the receipt's epoch and the final reason, then a
        dead letter's origin queue, id and reason, then the priority unless
        it is the default; then per virtual queue with a dedup table [name,
        0, [], {"virtual": true, "dedup": table}]."""
        out = []
        for name in sorted(self.queues):
            q = self.queues[name]
            msgs = []
            for i, m in sorted(q.msgs.items()):
                row = [i, m.data, m.ready, m.ttl, m.retry, m.lease_end or 0]
                if m.deliveries or m.origin:
                    row += [m.deliveries, m.nacks, m.receipt[0] if m.receipt else 0,
                            REASON_CODES[m.final]]
                if m.origin:
                    row += [m.origin[0], m.origin[1], REASON_CODES[m.origin[2]]]
                if m.priority != DEFAULT_PRIORITY:
                    row.append(m.priority)
                msgs.append(row)
            extras = dict(q.config)
            if q.dead_lettered:
                extras["dead_lettered"] = q.dead_lettered
            if q.dedup:
                extras["dedup"] = dedup_wire(q.dedup)
            out.append([name, q.max_id, msgs, extras] if extras else [name, q.max_id, msgs])
        for name in sorted(self.vdedup):
            out.append([name, 0, [], {"virtual": True, "dedup": dedup_wire(self.vdedup[name])}])
        return out

    def show(self, msg_id, m, now):
        """What show (11) answers for a message."""
        if m.lease_end is None:
            state = "ready" if m.ready <= now else "delayed"
        else:
            state = "in_flight" if m.final or m.lease_end > now else "ready"
        view = {"msg_id": msg_id, "state": state, "data": m.data, "priority": m.priority,
                "ready_at": m.ready / 1000, "ttl": m.ttl / 1000, "retry": m.retry / 1000,
                "retry_at": m.lease_end / 1000 if state == "in_flight" else 0,
                "deliveries": m.deliveries,
                "nacks": m.nacks}
        if m.origin:
            view.update(origin_queue=m.origin[0], origin_msg_id=m.origin[1],
                        dead_letter_reason=m.origin[2])
        return view

    def counts(self, queue, now):
        """(ready, delayed, in_flight) as monitor gives them; a final
        delivery counts as in flight until it is moved out."""
        msgs = self.queues[queue].msgs.values()
        ready = sum(1 for m in msgs if m.due() is not None and m.due() <= now)
        delayed = sum(1 for m in msgs if m.lease_end is None and m.ready > now)
        in_flight = sum(1 for m in msgs if m.lease_end is not None
                        and (m.final or m.lease_end > now))
        return ready, delayed, in_flight

    def wait_status(self, queue, now):
        waiting = sorted(m.ready for m in self.queues[queue].msgs.values()
                         if m.lease_end is None and m.ready <= now)[:16]
        return sum(min((now - t) // 1000, 255) for t in waiting)

    def next_final_ms(self):
        ends = [m.lease_end for q in self.queues.values() for m in q.msgs.values() if m.final]
        return min(ends) if ends else None

    def next_ready_ms(self, queue):
        """The earliest due time of its messages (due now or not), or None;
        None while paused out."""
        q = self.queues[queue]
        if q.paused() in ("out", "all"):
            return None
        due = [m.due() for m in q.msgs.values() if m.due() is not None]
        return min(due) if due else None


def dedup_wire(table):
    return [[dedup_id, [list(t) for t in ref] if type(ref) is tuple else ref, at]
            for dedup_id, (ref, at) in table.items()]


# Times as clients send them: None, relative seconds (some fractional), or
# absolute unix seconds around now (some in the past).
# Delays are short, ttls mostly longer, so that most produces succeed but
# "time error", expired messages and last deliveries all happen.
def time_spec(longest_s: int):
    rel_seconds = st.one_of(st.integers(0, longest_s),
                            st.integers(0, 4 * longest_s).map(lambda q: q / 4))
    return st.one_of(
        st.none(),
        st.tuples(st.just("rel"), rel_seconds),
        st.tuples(st.just("abs"), st.integers(-40, longest_s)),
    )


delay_spec = time_spec(20)
# ...and often short, so that leases reach ttls (last and final deliveries).
ttl_spec = st.one_of(st.none(), st.tuples(st.just("rel"), st.integers(2, 60)), time_spec(120))
# Short retries, so that redeliveries happen within a run of steps.
retry_spec = st.one_of(st.just(0), st.integers(1, 4), st.sampled_from([0.5, 1.25, 2.75]),
                       st.integers(1, 2))
# A consume's or touch's lease in ms (0: the message's retry); some reach a
# ttl, the last even the default one.
lease_spec = st.sampled_from([0, 0, 0, 250, 1000, 3000, 20_000, 90_000, HOUR_MS + 1000])
# A nack's delay as the client sends it: relative seconds (some past a
# ttl, even the default one) or absolute unix seconds (some in the past).
nack_delay_spec = st.one_of(
    st.tuples(st.just("rel"), st.sampled_from([0, 0, 0.25, 1, 3, 200, 4000])),
    st.tuples(st.just("abs"), st.integers(-5, 30)))
# Which message a confirm, nack or touch names: one whose lease is
# running, one whose lease ran out (the latest first: after an advance to
# the next deadline, one that ran out just now), one delivered and not
# confirmed, any live one (in any queue), or an id around a queue's max_id
# (gone or never given; also in virtual and unknown queues).
target_spec = st.tuples(st.sampled_from(["running", "running", "ran_out", "in_flight", "live",
                                         "unknown"]),
                        st.integers(0, 10**6),
                        st.sampled_from(REAL + (DLQ,) + tuple(VIRTUAL) + (UNKNOWN,)))
# The receipt sent with it: none, the current one, one handed out before
# for that message, a string that is no receipt, or a forged neighbour.
receipt_spec = st.sampled_from(["none", "none", "current", "current", "current", "old", "garbage",
                               "forged"])

CONSUMED = REAL * 3 + (DLQ, DLQ) + tuple(VIRTUAL) + (UNKNOWN,)
DEAD_LETTER_NAMES = ("", DLQ, DLQ, DLQ, "alpha", "beta", "gamma", "fan", "fan")
# Dedup windows: short ones (so that advancing time crosses their edges),
# 0 (off) and the default.
WINDOWS = (0, 1000, 1000, 2500, 2500, DEFAULT_WINDOW_MS)
# What a config (5) `set` holds: one setting or two (never empty: that is
# a read, which decides nothing). Mostly `none` for paused: a paused queue
# refuses produces until it is resumed.
changes_spec = st.one_of(
    st.fixed_dictionaries({"max_deliveries": st.integers(0, 3)}),
    st.fixed_dictionaries({"dead_letter": st.sampled_from(DEAD_LETTER_NAMES)}),
    st.fixed_dictionaries({"max_deliveries": st.integers(0, 3),
                           "dead_letter": st.sampled_from(DEAD_LETTER_NAMES)}),
    st.fixed_dictionaries({"paused": st.sampled_from(["none", "none", "none", "in", "out",
                                                      "all"])}),
    st.fixed_dictionaries({"max_size": st.sampled_from([0, 0, 2, 3, 8])}),
    st.fixed_dictionaries({"dedup_window_ms": st.sampled_from(WINDOWS)}),
    st.fixed_dictionaries({"dedup_window_ms": st.sampled_from(WINDOWS),
                           "paused": st.sampled_from(["none", "out"])}))
message_spec = st.tuples(delay_spec, ttl_spec, retry_spec)
# Priorities: mostly the default, some on both sides of it and next to it.
priority_spec = st.sampled_from([DEFAULT_PRIORITY] * 4 + [0, 7, 1023, 1025, 4000])
# "near": the id of the queue's table whose window ends nearest to now (after
# an advance to the next deadline, one at its window's edge).
dedup_spec = st.one_of(st.just(""), st.sampled_from(DEDUP_IDS + ("near", "near")))


class StoreMachine(RuleBasedStateMachine):
    # Most runs start with some queues configured (through Configure
    # entries, as a client's config would), so that dead letters are common.
    # Some with a short dedup window, so that its edge is crossed.
    @initialize(start=st.lists(st.tuples(st.sampled_from(REAL), st.fixed_dictionaries({
        "max_deliveries": st.sampled_from([0, 1, 2, 2, 3]),
        "dead_letter": st.sampled_from(DEAD_LETTER_NAMES)},
        optional={"dedup_window_ms": st.sampled_from(WINDOWS[1:5])})), max_size=3))
    def setup(self, start):
        self.store = Store(queue_size=QUEUE_SIZE, virtual_queues=VIRTUAL)
        self.model = Model()
        self.entries = []  # what a replica's log holds: applied and not reverted
        # A store fed `entries` one by one as they are applied, through the
        # log's wire form (replaying them all after every step costs the
        # same checks quadratic time); rebuilt from scratch after a revert.
        self.replica = Store(queue_size=QUEUE_SIZE, virtual_queues=VIRTUAL)
        self.replayed = 0  # how many of `entries` the replica has applied
        self.history = []  # per entry in `entries`: (undo ops, what to restore on revert)
        self.now = START_MS + 123
        self.epoch = EPOCH
        self.counter = 0
        self.gone: set = set()  # (queue, id) deleted or moved out: never delivered again
        for queue, changes in start:
            self.configure(queue, changes)

    def _resolve(self, spec):
        if spec is None:
            return None
        kind, value = spec
        if kind == "rel":
            return value
        return self.now // 1000 + value

    def _snapshot(self):
        """What a revert of the next entry must restore (taken before the
        model predicts that entry)."""
        return self.model.clone(), set(self.gone), self.store.to_wire()

    def _apply(self, entry, snapshot):
        undo = []
        result = self.store.apply(entry, undo)
        self.entries.append(entry)
        self.history.append((undo, snapshot))
        return result

    def _decide(self, decide):
        """A decision reads the state and changes nothing. -> (what it
        decided, and when that is an entry, the snapshot that a revert of
        it restores: taken now, before the model predicts it)."""
        before = self.store.to_wire()
        out = decide()
        assert self.store.to_wire() == before
        return out, self._snapshot() if isinstance(out, tuple) else None

    def _apply_move(self, move, queue, msg_id, reason, targets, snapshot):
        assert move == DeadLetter(queue=queue, msg_id=msg_id, reason=REASON_CODES[reason],
                                  targets=targets, ready_ms=self.now,
                                  ttl_ms=self.now + HOUR_MS), (move, targets)
        assert self._apply(move, snapshot) == targets
        self.gone.add((queue, msg_id))
        event(f"dead letter: {reason}, "
              + (f"moved into {len(targets)} queue(s)" if targets else "deleted"))

    def _handed_out(self, queue, msg_id, retry_at, epoch, deliveries):
        """The receipt the client hears for a delivery (as the service
        builds it), checked against the model's and remembered."""
        if not retry_at:
            return None
        m = self.model.message(queue, msg_id)
        assert m.receipt == (epoch, msg_id, deliveries)
        text = receipt_text(epoch, msg_id, deliveries)
        assert text == f"{epoch}.{msg_id}.{deliveries}"
        self.model.handed_out.setdefault((queue, msg_id), []).append(m.receipt)
        return text

    @rule(queue=st.sampled_from(REAL + tuple(VIRTUAL)),
          messages=st.lists(message_spec, min_size=1, max_size=3))
    def produce(self, queue, messages):
        for delay, ttl, retry in messages:
            self._produce_one(queue, delay, ttl, retry)

    def _produce_one(self, queue, delay, ttl, retry):
        self.counter += 1
        data = f"m{self.counter}"
        delay_s, ttl_s = self._resolve(delay), self._resolve(ttl)
        req = ProduceRequest(queue=queue, data=data, delay_s=delay_s, ttl_s=ttl_s, retry_s=retry)
        out, snapshot = self._decide(lambda: self.store.decide_produce(req, self.now))
        expected = self.model.produce(queue, data, delay_s, ttl_s, retry, self.now)
        if isinstance(expected, str):
            event(f"produce: {expected.split(':')[0]}")
            assert out == expected, (out, expected)
        else:
            event(f"produce: into {len(expected)} queue(s)")
            assert type(out) is Produce, out
            assert out.targets == expected
            assert self._apply(out, snapshot) == expected

    # A produce with priority or dedup_id (batch=False: one item, the single
    # form's answer) or with `messages` (1-5 items).
    @rule(queue=st.sampled_from(REAL * 2 + tuple(VIRTUAL)),
          items=st.lists(st.tuples(message_spec, priority_spec, dedup_spec), min_size=1,
                         max_size=5),
          batch=st.sampled_from([True, True, False]))
    def produce_batch(self, queue, items, batch):
        if not batch:
            items = items[:1]
        parsed = []
        for (delay, ttl, retry), priority, dedup_id in items:
            if dedup_id == "near":
                dedup_id = self._near_id(queue)
            self.counter += 1
            parsed.append(ProduceItem(data=f"m{self.counter}", delay_s=self._resolve(delay),
                                      ttl_s=self._resolve(ttl), retry_s=retry,
                                      priority=priority, dedup_id=dedup_id))
        req = ProduceBatchRequest(queue=queue, items=tuple(parsed), batch=batch)
        out, snapshot = self._decide(lambda: self.store.decide_produce_batch(req, self.now))
        expected = self.model.produce_batch(queue, parsed, batch, self.now)
        kind = "batch" if batch else "single"
        if isinstance(expected, str):
            event(f"{kind} produce: {expected.split(':')[0]}")
            assert out == expected, (out, expected)
            return
        plan, decided, answer, notes = expected
        for note in notes:
            event(f"dedup: {note}")
        assert type(out) is tuple and out[1] == plan, (out, plan)
        entry = out[0]
        if decided is None:
            assert entry is None
            targets = ()
        else:
            targets, new, cutoff = decided
            assert entry == ProduceBatch(queue=queue, targets=targets, items=new,
                                         accepted_ms=self.now, cutoff_ms=cutoff), (entry, decided)
            assert self._apply(entry, snapshot) == targets
            event(f"{kind} produce: {len(new)} stored of {len(items)}"
                  + (", prioritized" if any(i[4] != DEFAULT_PRIORITY for i in new) else ""))
        # The answer as the service builds it from the plan and the targets.
        ids = []
        for step in plan:
            if type(step) is int or step[0] == "same":
                k = step if type(step) is int else step[1]
                ids.append({name: first + k for name, first in targets} if queue in VIRTUAL
                           else targets[0][1] + k)
            else:
                ids.append(step[1] if type(step[1]) is int else dict(step[1]))
        assert ids == answer, (ids, answer)

    def _table(self, queue):
        """The model's dedup table of `queue` and the window that applies."""
        model = self.model
        if queue in VIRTUAL:
            return model.vdedup.get(queue, {}), model.view(VIRTUAL[queue][0]).window()
        return model.view(queue).dedup, model.view(queue).window()

    def _near_id(self, queue):
        table, window = self._table(queue)
        if not table:
            return DEDUP_IDS[0]
        return min(table, key=lambda d: abs(self.now - table[d][1] - window))

    # The window's edge, exactly: time moves to the end of the window of the
    # id of the queue's table that ends first (or to 1 ms before), and a
    # produce repeats that id: a duplicate 1 ms before, a new message at it.
    @rule(queue=st.sampled_from(REAL + tuple(VIRTUAL)), before=st.sampled_from([0, 1]),
          priority=priority_spec, batch=st.booleans())
    def produce_at_a_windows_edge(self, queue, before, priority, batch):
        table, window = self._table(queue)
        ends = sorted((at + window - before, d) for d, (_, at) in table.items()
                      if at + window - before > self.now)
        if not window or not ends:
            return
        self.now, dedup_id = ends[0]
        self.produce_batch(queue, [((None, None, 1), priority, dedup_id)], batch)

    @rule(queue=st.sampled_from(REAL * 2 + (DLQ,) + tuple(VIRTUAL) + (UNKNOWN,)))
    def clear(self, queue):
        out, snapshot = self._decide(lambda: self.store.decide_clear(queue))
        gone = [(queue, i) for i in self.model.queues[queue].msgs] \
            if queue in self.model.queues else []
        expected = self.model.clear(queue)
        if expected == "virtual":
            assert out == "virtual queue only takes produce"
        elif expected == 0:
            event("clear: nothing to remove")
            assert out is None
        else:
            event("clear: removes " + ("1 message" if expected == 1 else "several"))
            assert out == Clear(queue=queue)
            assert self._apply(out, snapshot) == expected
            self.gone.update(gone)
        if queue == UNKNOWN:
            assert self.store.get(UNKNOWN) is None

    def _consume(self, names, count, lease, many):
        """One consume request as the service runs it: moves first, then
        the delivery. -> the number of messages delivered."""
        req = ConsumeRequest(names, count, 0, lease, many)
        while True:
            out, snapshot = self._decide(
                lambda: self.store.decide_consume(req, self.now, self.epoch))
            dead_letters = {(name, i) for name, q in self.model.queues.items()
                            for i, m in q.msgs.items() if m.origin}
            expected = self.model.consume(names, 1 if count is None else count, lease,
                                          self.now, self.epoch)
            if expected is None:
                event("consume: nothing deliverable")
                assert out is None
                return 0
            if expected == "virtual":
                assert type(out) is str and out
                return 0
            if expected[0] == "move":
                event("consume: moves a message over a lowered max_deliveries first")
                self._apply_move(out, *expected[1:], snapshot)
                continue
            items = expected[1]
            if count is None and len(names) == 1:
                (queue, msg_id, _data, _n, end, final), = items
                assert out == Consume(queue=queue, msg_id=msg_id, retry_at_ms=end,
                                      epoch=self.epoch if end else 0,
                                      final=REASON_CODES[final]), (out, items)
                results = [(queue, *self._apply(out, snapshot))]
            else:
                listed = tuple((q, i, end, REASON_CODES[final])
                               for q, i, _, _, end, final in items)
                assert out == ConsumeMany(items=listed, epoch=self.epoch), (out, items)
                results = self._apply(out, snapshot)
            assert results == [(q, i, data, n) for q, i, data, n, _, _ in items]
            for queue, msg_id, _data, deliveries, end, final in items:
                key = (queue, msg_id)
                assert key not in self.gone, "a message deleted or moved out delivered again"
                receipt = self._handed_out(queue, msg_id, end, self.epoch, deliveries)
                if receipt is None:
                    self.gone.add(key)
                    assert msg_id not in self.store.get(queue).messages
                if key in dead_letters:
                    event("consume: a dead letter delivered")
                event("consume: " + ("deleted by its delivery" if receipt is None
                                     else f"final ({final})" if final
                                     else "redelivery" if deliveries > 1 else "first delivery"))
            return len(items)

    # Real queues weighted up: a redelivery needs two consumes of one queue;
    # "due": a queue that has something to take, when one has.
    @rule(queue=st.sampled_from(CONSUMED + ("due",) * 6), times=st.integers(1, 4),
          lease=lease_spec)
    def consume(self, queue, times, lease):
        if queue == "due":
            due = [name for name, q in sorted(self.model.queues.items())
                   if q.deliverable(self.now)]
            queue = due[times % len(due)] if due else REAL[times % len(REAL)]
        for _ in range(times):
            self._consume((queue,), None, lease, False)
        if queue == UNKNOWN:
            assert self.store.get(UNKNOWN) is None

    # "due" as in `consume`: the first queue that has something to take.
    @rule(names=st.lists(st.sampled_from((*REAL, DLQ, UNKNOWN, *VIRTUAL, "due", "due")),
                         min_size=1, max_size=3, unique=True),
          count=st.one_of(st.none(), st.integers(1, 4)), lease=lease_spec)
    def consume_many(self, names, count, lease):
        if "due" in names:
            due = [name for name, q in sorted(self.model.queues.items())
                   if q.deliverable(self.now) and name not in names]
            names = [due[0] if name == "due" else name for name in names] if due else \
                [name for name in names if name != "due"] or [REAL[0]]
        if count is None and len(names) == 1:
            count = 1  # a one-queue consume without count is the rule above
        delivered = self._consume(tuple(names), count, lease, True)
        left = [(q, i) for name in names if (q := self.model.queues.get(name))
                for i in q.deliverable(self.now)]
        cut = delivered and any(q.over_limit(q.msgs[i]) for q, i in left)
        event("consume many: " + ("ends before a message to move out" if cut
                                  else f"{delivered} of {count} from {len(names)} queue(s)"))

    def _target(self, which):
        """The (queue, msg_id) a confirm, nack or touch names."""
        how, pick, queue = which
        live = [(name, i, m) for name, q in sorted(self.model.queues.items())
                for i, m in sorted(q.msgs.items())]
        delivered = [f for f in live if f[2].lease_end is not None]
        running = [f for f in delivered if f[2].lease_end > self.now]
        ran_out = sorted((f for f in delivered if f[2].lease_end <= self.now),
                         key=lambda f: -f[2].lease_end)
        if how == "ran_out" and ran_out:
            return ran_out[pick % 2 % len(ran_out)][:2]
        # Each kind falls back on the next when there is none.
        found = {"running": running or delivered or live, "ran_out": delivered or live,
                 "in_flight": delivered or live, "live": live}.get(how)
        if found:
            return found[pick % len(found)][:2]
        q = self.model.queues.get(queue)
        return queue, max(1, (q.max_id if q else 0) + pick % 3 - 1)

    def _receipt(self, queue, msg_id, how, pick):
        """The parsed receipt sent with it ((0, 0, 0): a string that is
        not a receipt of ours), or None."""
        m = self.model.message(queue, msg_id)
        current = m.receipt if m else None
        old = self.model.handed_out.get((queue, msg_id))
        if how == "none":
            return None
        if how == "current" and current:
            return current
        if how == "old" and old:
            return old[pick % len(old)]
        if how == "forged" and current:
            epoch, i, n = current
            return (epoch, i, n + 1) if pick % 2 else (epoch + 1, i, n)
        return (0, 0, 0)

    def _kind_of_receipt(self, queue, msg_id, receipt):
        if receipt is None:
            return "no receipt"
        return "current receipt" if self.model.receipt_is_current(queue, msg_id, receipt) \
            else "stale receipt"

    @rule(which=target_spec, receipt=receipt_spec)
    def confirm(self, which, receipt):
        queue, msg_id = self._target(which)
        parsed = self._receipt(queue, msg_id, receipt, which[1])
        kind = self._kind_of_receipt(queue, msg_id, parsed)

        def decide():
            # The service's order: a receipt is checked before the confirm.
            if (parsed is not None and queue not in self.store.virtual_queues
                    and not self.store.check_receipt(queue, msg_id, parsed)):
                return "stale receipt"
            return self.store.decide_confirm(ConfirmRequest(queue, msg_id, parsed))

        out, snapshot = self._decide(decide)
        expected = self.model.confirm(queue, msg_id, parsed)
        if expected is None:
            event(f"confirm: unknown id, {kind}")
            assert out is None
        elif expected == "virtual":
            assert type(out) is str and out
        elif expected == "stale receipt":
            event("confirm: stale receipt refused")
            assert out == "stale receipt"
        else:
            event(f"confirm: deleted, {kind}")
            assert out == Confirm(queue=queue, msg_id=msg_id)
            assert self._apply(out, snapshot) is True
            self.gone.add((queue, msg_id))

    @rule(which=target_spec, receipt=receipt_spec,
          delay=nack_delay_spec)
    def nack(self, which, receipt, delay):
        queue, msg_id = self._target(which)
        parsed = self._receipt(queue, msg_id, receipt, which[1])
        kind = self._kind_of_receipt(queue, msg_id, parsed)
        ready = to_ms(self._resolve(delay), self.now)
        out, snapshot = self._decide(
            lambda: self.store.decide_nack(queue, msg_id, parsed, ready, self.now))
        expected = self.model.nack(queue, msg_id, parsed, ready, self.now)
        if expected == "virtual":
            assert type(out) is str and out
        elif isinstance(expected, str):
            event(f"nack: {expected}")
            assert out == expected, (out, expected)
        elif expected[0] == "move":
            event(f"nack: moves it out ({expected[1]}), {kind}")
            self._apply_move(out, queue, msg_id, *expected[1:], snapshot)
        else:
            event(f"nack: {'later' if expected[1] > self.now else 'now'}, {kind}")
            assert out == Nack(queue=queue, msg_id=msg_id, ready_ms=expected[1]), out
            assert self._apply(out, snapshot) == expected[1]

    @rule(which=target_spec, receipt=receipt_spec,
          lease=lease_spec)
    def touch(self, which, receipt, lease):
        queue, msg_id = self._target(which)
        parsed = self._receipt(queue, msg_id, receipt, which[1])
        kind = self._kind_of_receipt(queue, msg_id, parsed)
        out, snapshot = self._decide(
            lambda: self.store.decide_touch(queue, msg_id, parsed, lease, self.now))
        was_final = (m := self.model.message(queue, msg_id)) is not None and m.final
        expected = self.model.touch(queue, msg_id, parsed, lease, self.now)
        if expected == "virtual":
            assert type(out) is str and out
        elif isinstance(expected, str):
            event(f"touch: {expected}")
            assert out == expected, (out, expected)
        else:
            end, final = expected
            event(f"touch: {kind}" + (", now final" if final and not was_final else ""))
            assert out == Touch(queue=queue, msg_id=msg_id, retry_at_ms=end,
                                final=REASON_CODES[final]), out
            assert self._apply(out, snapshot) == end

    # `lower`: instead, set the max_deliveries of a queue holding a message
    # that was delivered and may come back (when there is one) to what that
    # message already has (+ `lower`), so that its next delivery becomes a
    # move out (or its last).
    @rule(queue=st.sampled_from(REAL * 2 + (DLQ, DLQ) + tuple(VIRTUAL)), changes=changes_spec,
          lower=st.sampled_from([None, None, 0, 0, 1]))
    def configure(self, queue, changes, lower=None):
        comes_back = [(name, m.deliveries) for name, q in sorted(self.model.queues.items())
                      for m in q.msgs.values() if m.deliveries and not m.final]
        if lower is not None and comes_back:
            queue, deliveries = comes_back[len(changes) % len(comes_back)]
            changes = {"max_deliveries": deliveries + lower}
        q = self.model.queues.get(queue)
        lowered = (q is not None and changes.get("max_deliveries", 0) > 0 and any(
            m.deliveries >= changes["max_deliveries"] for m in q.msgs.values()))
        out, snapshot = self._decide(lambda: self.store.decide_configure(queue, changes))
        expected = self.model.configure(queue, changes)
        if isinstance(expected, str):
            event(f"configure: refused ({expected})")
            assert type(out) is str and out.startswith(expected.replace("virtual", "virtual "))
            return
        event("configure: max_deliveries at or below a message's deliveries" if lowered
              else "configure: " + ", ".join(f"{k} {v}" if k == "paused" else k
                                             for k, v in sorted(changes.items())))
        assert out == Configure(queue=queue, settings=tuple(sorted(changes.items())))
        assert self._apply(out, snapshot) == expected

    # Mostly steps of whole 250 ms, which land exactly on retry deadlines
    # (retries are multiples of 250 ms); some odd steps; some exactly to the
    # next time something changes (a delay or a lease ends: the boundaries);
    # rarely a jump of an hour (past the default ttl), which would otherwise
    # expire everything.
    # `tick`: the master's timer runs and moves out the final deliveries
    # whose lease ran out (`limit` at a time); without it they wait, as they
    # do between a master's loss and the next master's first tick.
    # The next deadline may be a dedup id's window's edge (or 1 ms before).
    # `failover` -1: a new master whose clock is 1.5 s behind the old one's.
    @rule(ms=st.tuples(st.integers(0, 19), st.integers(0, 40), st.integers(0, 20_000)).map(
        lambda t: HOUR_MS if t[0] == 0 else None if t[0] < 4 else t[1] * 250 if t[0] < 14
        else t[2]),
        tick=st.sampled_from([True, True, True, False]), limit=st.integers(1, 3),
        failover=st.sampled_from([0, 0, 0, 0, 1, 2, -1]))
    def advance(self, ms, tick, limit, failover):
        if ms is None:
            later = [t for q in self.model.queues.values() for m in q.msgs.values()
                     for t in (m.ready, m.lease_end) if t is not None and t > self.now]
            later += self.model.dedup_edges(self.now)
            ms = min(later) - self.now if later else 250
            event("advance: to the next deadline")
        self.now += ms
        # Another master takes over: its deliveries carry a higher epoch;
        # the old one's receipts stay current until their message is
        # delivered again.
        if failover < 0:
            self.now -= 1500
            failover = 1
            event("advance: a new master with a slower clock")
        self.epoch += failover
        if not tick:
            return
        while True:
            due = self.model.expired_finals(self.now)
            moves, _ = self._decide(lambda: self.store.decide_expired(self.now, limit))
            assert len(moves) == min(limit, len(due)), (moves, due)
            if not moves:
                return
            event(f"expire: {len(moves)} of {len(due)} final leases")
            # decide_expired's order among them is its own; each must be
            # one that ran out, moved for the reason its delivery gave it.
            for move in moves:
                key = (move.queue, move.msg_id)
                assert key in due, (move, due)
                due.discard(key)
                snapshot = self._snapshot()
                reason = self.model.message(*key).final
                targets = self.model.move_out(move.queue, move.msg_id, reason, self.now)
                self._apply_move(move, move.queue, move.msg_id, reason, targets, snapshot)

    # Rarer than the other rules (count 0 is a no-op), so that runs still
    # build up state long enough for redeliveries.
    @rule(count=st.integers(-6, 3))
    def revert(self, count):
        count = min(count, len(self.history))
        if count <= 0:
            return
        event(f"revert: {count} entries")
        for _ in range(count):  # one revert call per entry, newest first
            undo, (model, gone, wire) = self.history.pop()
            self.entries.pop()
            self.store.revert(undo)
            self.store._check()
            assert self.store.to_wire() == wire
        self.model, self.gone = model, gone
        self.replica = Store(queue_size=QUEUE_SIZE, virtual_queues=VIRTUAL)
        self.replayed = 0

    @invariant()
    def store_is_sound_and_matches_model(self):
        store, model, now = self.store, self.model, self.now
        store._check()
        assert store.to_wire() == model.wire()
        assert sorted(store.queues) == sorted(model.queues)
        for name, mq in model.queues.items():
            q = store.get(name)
            assert q.settings() == mq.settings()
            assert q.dead_lettered == mq.dead_lettered
            for msg_id, m in mq.msgs.items():
                assert message_view(msg_id, q.messages[msg_id], now, q.priorities.get(
                    msg_id, DEFAULT_PRIORITY)) == model.show(msg_id, m, now)
                if m.receipt is not None:
                    assert store.check_receipt(name, msg_id, m.receipt)
            # What consumes would deliver next, in order (peek), and the
            # figures monitor gives.
            # (peek shows these without the ones over a lowered max_deliveries.)
            order = mq.deliverable(now)  # what consumes take next, to deliver or to move out
            assert q.next_due(now) == (order[0] if order else None)
            assert list(q.due(now)) == order
            # (the longest-ready one: not the most urgent, with priorities)
            oldest = min(mq.msgs[i].due() for i in order) if order else None
            assert q.oldest_ready_ms(now) == oldest
            assert q.counts(now) == model.counts(name, now)
            assert q.wait_status(now) == model.wait_status(name, now)
            # When a parked consume must wake (also with a clock behind the
            # times an earlier master read at).
            assert q.next_ready_ms() == model.next_ready_ms(name)
        for (name, msg_id), receipts in model.handed_out.items():
            for receipt in receipts:
                assert store.check_receipt(name, msg_id, receipt) == \
                    model.receipt_is_current(name, msg_id, receipt)
        assert store.next_final_ms() == model.next_final_ms()
        for name in tuple(VIRTUAL) + (UNKNOWN,):
            assert store.get(name) is None

    @invariant()
    def replay_gives_the_same_state(self):
        replica = self.replica
        for entry in self.entries[self.replayed:]:  # as a replica reads them from its log
            on_wire = entry_from_wire(entry_to_wire(entry))
            assert on_wire == entry
            replica.apply(on_wire)
        self.replayed = len(self.entries)
        replica._check()
        wire = self.store.to_wire()
        assert replica.to_wire() == wire
        assert replica.next_final_ms() == self.store.next_final_ms()
        loaded = Store(queue_size=QUEUE_SIZE, virtual_queues=VIRTUAL)
        loaded.load_wire(wire)
        loaded._check()
        assert loaded.to_wire() == wire
        assert loaded.next_final_ms() == self.store.next_final_ms()


_EXPLORE = int(os.environ.get("QSERVER_STATEFUL_EXAMPLES", "0"))
StoreMachine.TestCase.settings = settings(
    max_examples=_EXPLORE or 300,
    stateful_step_count=100,
    derandomize=not _EXPLORE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase



def run_steps(start, steps):
    """Run the machine through chosen rules (name, kwargs), with every
    check after each, as hypothesis does: for paths that random runs reach
    too rarely to rely on."""
    machine = StoreMachine()
    machine.setup(start=start)
    for name, kwargs in steps:
        getattr(machine, name)(**kwargs)
        machine.store_is_sound_and_matches_model()
        machine.replay_gives_the_same_state()
    return machine


def test_a_batch_ends_before_a_message_to_move_out():
    """A consume with count stops before a message over a lowered
    max_deliveries (the next consume moves it out, then delivers on)."""
    machine = run_steps([], [
        ("produce", {"queue": "alpha", "messages": [(None, None, 1)]}),
        ("consume", {"queue": "alpha", "times": 1, "lease": 0}),
        ("produce", {"queue": "alpha", "messages": [(None, None, 1), (None, None, 0)]}),
        ("configure", {"queue": "alpha", "changes": {"max_deliveries": 1}}),
        ("advance", {"ms": 1000, "tick": True, "limit": 1, "failover": 0}),
        ("consume_many", {"names": ["alpha"], "count": 3, "lease": 0}),
        ("consume_many", {"names": ["beta", "alpha"], "count": 3, "lease": 0}),
    ])
    assert machine.model.queues["alpha"].dead_lettered == 1


def test_a_final_delivery_whose_lease_ran_out_is_not_in_flight():
    """spec14 (nack, touch): `not in flight` when the lease ran out; the
    README: both need the message "delivered, unconfirmed, its lease
    running". Between the end of a final lease and the master's move (its
    timer, or a new master's first tick) nothing may extend it."""
    store = Store(queue_size=QUEUE_SIZE)
    store.apply(store.decide_configure("q", {"max_deliveries": 1}))
    store.apply(store.decide_produce(ProduceRequest("q", "x", None, None, 1), START_MS))
    delivery = store.decide_consume(ConsumeRequest(("q",), None, 0, 0, False), START_MS, EPOCH)
    store.apply(delivery)  # final: its 1 s lease is its last
    later = START_MS + 5_000  # the lease ran out; the master has not moved it yet
    receipt = (EPOCH, 1, 1)
    assert store.decide_touch("q", 1, receipt, 60_000, later) == "not in flight"
    assert store.decide_nack("q", 1, receipt, later, later) == "not in flight"


def _items(*specs):
    """produce_batch's items: (priority, dedup_id) each, ready now, ttl and
    retry by default."""
    return [((None, None, 0), priority, dedup_id) for priority, dedup_id in specs]


def test_the_windows_edge_through_the_machine():
    """spec15: accepted at t with window W: a duplicate at t + W - 1, not at
    t + W (then accepted again, with the new time)."""
    machine = run_steps([("alpha", {"max_deliveries": 0, "dead_letter": "",
                                    "dedup_window_ms": 1000})], [
        ("produce_batch", {"queue": "alpha", "items": _items((DEFAULT_PRIORITY, "d1")),
                           "batch": False}),
        ("advance", {"ms": 999, "tick": False, "limit": 1, "failover": 0}),
        ("produce_batch", {"queue": "alpha", "items": _items((DEFAULT_PRIORITY, "d1")),
                           "batch": True}),
        ("advance", {"ms": 1, "tick": False, "limit": 1, "failover": 0}),
        ("produce_batch", {"queue": "alpha", "items": _items((5, "d1"), (5, "d1")),
                           "batch": True}),
    ])
    q = machine.model.queues["alpha"]
    assert q.max_id == 2 and q.dedup == {"d1": (2, machine.now)}


def test_the_bound_drops_the_oldest_through_the_machine():
    machine = run_steps([], [
        ("produce_batch", {"queue": "fan", "items": _items((0, "d1"), (DEFAULT_PRIORITY, "d2"),
                                                           (4000, "d3")), "batch": True}),
        ("advance", {"ms": 250, "tick": True, "limit": 1, "failover": 0}),
        ("produce_batch", {"queue": "fan", "items": _items((DEFAULT_PRIORITY, "d4")),
                           "batch": False}),
        ("produce_batch", {"queue": "fan", "items": _items((DEFAULT_PRIORITY, "d1"),
                                                           (DEFAULT_PRIORITY, "d3")),
                           "batch": True}),
    ])
    assert list(machine.model.vdedup["fan"]) == ["d3", "d4", "d1"]  # d1 and d2 went
    assert [q.max_id for _, q in sorted(machine.model.queues.items())] == [5, 5]


def test_priorities_pause_and_clear_with_a_slower_clock_through_the_machine():
    machine = run_steps([], [
        ("produce_batch", {"queue": "beta", "items": _items((1025, ""), (7, ""), (0, "d2")),
                           "batch": True}),
        ("produce", {"queue": "beta", "messages": [(None, None, 1)]}),
        ("configure", {"queue": "beta", "changes": {"paused": "out"}}),
        ("consume", {"queue": "beta", "times": 1, "lease": 0}),
        ("advance", {"ms": 3000, "tick": True, "limit": 1, "failover": 0}),
        ("configure", {"queue": "beta", "changes": {"paused": "none"}}),
        ("consume_many", {"names": ["beta"], "count": 2, "lease": 0}),
        ("advance", {"ms": 0, "tick": True, "limit": 1, "failover": -1}),
        ("produce_batch", {"queue": "beta", "items": _items((1023, "")), "batch": False}),
        ("consume", {"queue": "beta", "times": 2, "lease": 0}),
        ("configure", {"queue": "beta", "changes": {"paused": "in"}}),
        ("produce_batch", {"queue": "beta", "items": _items((0, "d2")), "batch": False}),
        ("clear", {"queue": "beta"}),
        ("configure", {"queue": "beta",
                       "changes": {"paused": "none", "dedup_window_ms": 2500}}),
        ("produce_batch", {"queue": "beta", "items": _items((0, "d2")), "batch": False}),
        ("configure", {"queue": "beta", "changes": {"max_size": 2}}),
        ("produce_batch", {"queue": "beta", "items": _items((0, ""), (0, "")), "batch": True}),
    ])
    q = machine.model.queues["beta"]
    # d2 after the clear, 1.5 s after it was first accepted: still a duplicate
    assert q.max_id == 7 and sorted(q.msgs) == [6, 7]
    assert q.dedup == {"d2": (3, START_MS + 123)}
