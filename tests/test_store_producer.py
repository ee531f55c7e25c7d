"""Unit tests of the Store's producer and queue controls (issue 15; protocol-v2
"Produce", "Queue settings", action 6; ../spec15.md): priorities, batch
produce, dedup ids and their table, clear, pause, max_size, the XML queue
defaults, revert of every new entry kind, and snapshots of the new state.

The `Driver` drives the store as the master does (decide, then apply; the
approach of tests/test_store_consumer.py), and after every applied entry it
checks, besides `store._check()`:
- the entry survives its wire form (`entry_from_wire(entry_to_wire(e))`);
- apply with an undo list gives the same result, and `revert` restores the
  exact state before it (`to_wire()` equal), after which applying again gives
  the same state;
- a replica that applies the same entries in order holds the same state;
- a `to_wire`/`load_wire` round trip gives the same state;
- `final_queues` names exactly the queues with final deliveries.
Decides must not change the state. No I/O, no clock: `now` is an argument.

Tests whose docstring starts with "Regression" showed a defect that these
tests found in the store (fixed in 04f6b03).
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qserver.state import store as store_module
from qserver.state.entries import (
    FINAL_EXPIRED,
    FINAL_MAX_DELIVERIES,
    FINAL_NONE,
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
from qserver.state.store import DEFAULT_TTL_MS, Store, message_view
from qserver.storage import format as fmt
from qserver.wire.requests import ProduceBatchRequest, ProduceItem, ProduceRequest

NOW = 1_700_000_000_000
HOUR = 3_600_000
EPOCH = 7  # the deciding master's epoch in these tests
DEFAULT = 1024  # the default priority
WINDOW = 300_000  # the default dedup window, in ms


def item(data: str = "m", *, delay=None, ttl=None, retry=0, priority: int = DEFAULT,
         dedup_id: str = "") -> ProduceItem:
    """One message of a batch, as the request layer parses it."""
    return ProduceItem(data, delay, ttl, retry, priority, dedup_id)


def answer(plan: list, targets: tuple, virtual: bool) -> tuple[list, list]:
    """(msg_ids, duplicates) as the service answers a batch from the plan
    and the applied entry's targets (qserver/service.py, _produce_batch)."""
    ids: list[Any] = []
    duplicates = []
    for index, step in enumerate(plan):
        if type(step) is int:
            k = step
        elif step[0] == "same":
            k = step[1]
            duplicates.append(index)
        else:
            ref = step[1]
            ids.append(ref if type(ref) is int else dict(ref))
            duplicates.append(index)
            continue
        ids.append({name: first + k for name, first in targets} if virtual
                   else targets[0][1] + k)
    return ids, duplicates


class Driver:
    """A store driven as the master drives it, checked after every step."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("queue_size", 1000)
        self.kw = kw
        self.store = Store(**kw)
        self.replica = Store(**kw)  # applies the same entries, without undo
        self.entries: list = []

    # -- checks ----------------------------------------------------------

    def check(self) -> None:
        store = self.store
        store._check()
        assert store.final_queues == {n for n, q in store.queues.items() if q.finals}

    def decide(self, fn, *args):
        before = self.store.to_wire()
        out = fn(*args)
        assert self.store.to_wire() == before, "a decide must not change the state"
        return out

    def apply(self, entry):
        assert entry_from_wire(entry_to_wire(entry)) == entry
        packed = msgpack.unpackb(msgpack.packb(entry_to_wire(entry)))
        assert entry_from_wire(packed) == entry
        store = self.store
        before = store.to_wire()
        undo: list = []
        result = store.apply(entry, undo)
        self.check()
        after = store.to_wire()
        store.revert(undo)
        self.check()
        assert store.to_wire() == before, f"revert of {entry} did not restore the state"
        assert store.apply(entry) == result
        self.check()
        assert store.to_wire() == after
        assert self.replica.apply(entry) == result
        assert self.replica.to_wire() == after
        loaded = Store(**self.kw)
        loaded.load_wire(after)
        loaded._check()
        assert loaded.to_wire() == after
        self.entries.append(entry)
        return result

    # -- the master's steps ----------------------------------------------

    def produce(self, now: int, queue: str = "q", data: str = "m", *, delay=None, ttl=None,
                retry=0) -> int | str:
        """A produce without priority or dedup_id (the plain path): its msg_id,
        or the reason it was refused."""
        entry = self.decide(self.store.decide_produce,
                            ProduceRequest(queue, data, delay, ttl, retry), now)
        if type(entry) is str:
            return entry
        assert type(entry) is Produce, entry
        targets = self.apply(entry)
        return targets[0][1]

    def decide_batch(self, now: int, items, queue: str = "q", batch: bool = True):
        req = ProduceBatchRequest(queue, tuple(items), batch)
        return self.decide(self.store.decide_produce_batch, req, now)

    def produce_batch(self, now: int, items, queue: str = "q", batch: bool = True):
        """(msg_ids, duplicates) as the answer gives them, or the reason the
        produce was refused."""
        out = self.decide_batch(now, items, queue, batch)
        if type(out) is str:
            return out
        entry, plan = out
        assert len(plan) == len(items)
        if entry is None:  # duplicates only: nothing to append
            assert all(type(step) is tuple for step in plan)
            targets: tuple = ()
        else:
            assert type(entry) is ProduceBatch and entry.accepted_ms == now
            targets = self.apply(entry)
            assert targets == entry.targets
        return answer(plan, targets, queue in self.store.virtual_queues)

    def produce_one(self, now: int, queue: str = "q", data: str = "m", **kw: Any):
        """A single produce with priority or dedup_id (batch=False): its
        msg_id (or {real queue: msg_id}) and whether it was a duplicate."""
        out = self.produce_batch(now, [item(data, **kw)], queue, batch=False)
        if type(out) is str:
            return out
        ids, duplicates = out
        return ids[0], bool(duplicates)

    def configure(self, queue: str = "q", **settings_: Any) -> dict:
        entry = self.decide(self.store.decide_configure, queue, settings_)
        assert type(entry) is Configure, entry
        return self.apply(entry)

    def consume(self, now: int, queue: str = "q", lease_ms: int = 0, epoch: int = EPOCH):
        """(msg_id, data, deliveries), or None; moves first, as the service."""
        while True:
            entry = self.decide(self.store.decide_consume_values, queue, now, epoch, lease_ms)
            if type(entry) is DeadLetter:
                self.apply(entry)
                continue
            if entry is None:
                return None
            assert type(entry) is Consume, entry
            return self.apply(entry)

    def consume_many(self, now: int, names, count: int, lease_ms: int = 0) -> list:
        out: list = []
        while len(out) < count:
            entry = self.decide(self.store.decide_consume_many, names, count - len(out), now,
                                EPOCH, lease_ms)
            if entry is None:
                break
            if type(entry) is DeadLetter:
                self.apply(entry)
                continue
            assert type(entry) is ConsumeMany, entry
            out.extend(self.apply(entry))
        return out

    def confirm(self, queue: str, msg_id: int):
        entry = self.decide(self.store.decide_confirm_values, queue, msg_id)
        if entry is None or type(entry) is str:
            return entry
        assert type(entry) is Confirm
        return self.apply(entry)

    def nack(self, now: int, msg_id: int, ready_ms: int | None = None, queue: str = "q"):
        out = self.decide(self.store.decide_nack, queue, msg_id, None,
                          now if ready_ms is None else ready_ms, now)
        if type(out) is str:
            return out
        return self.apply(out)

    def touch(self, now: int, msg_id: int, lease_ms: int = 0, queue: str = "q"):
        out = self.decide(self.store.decide_touch, queue, msg_id, None, lease_ms, now)
        if type(out) is str:
            return out
        assert type(out) is Touch
        return self.apply(out)

    def expire(self, now: int, limit: int = 100) -> list:
        moves = self.decide(self.store.decide_expired, now, limit)
        for move in moves:
            assert type(move) is DeadLetter
            self.apply(move)
        return moves

    def clear(self, queue: str = "q"):
        """How many messages were removed (0 without an entry), or a reason."""
        out = self.decide(self.store.decide_clear, queue)
        if out is None:
            return 0
        if type(out) is str:
            return out
        assert out == Clear(queue)
        return self.apply(out)

    # -- reads -------------------------------------------------------------

    def q(self, queue: str = "q"):
        return self.store.queues[queue]

    def msg(self, msg_id: int, queue: str = "q") -> tuple:
        return self.q(queue).messages[msg_id]

    def view(self, msg_id: int, now: int, queue: str = "q") -> dict:
        q = self.q(queue)
        return message_view(msg_id, q.messages[msg_id], now, q.priorities.get(msg_id, DEFAULT))

    def ids(self, queue: str = "q") -> list:
        q = self.store.get(queue)
        return [] if q is None else sorted(q.messages)

    def due(self, now: int, queue: str = "q") -> list:
        return list(self.q(queue).due(now))

    def dedup(self, queue: str = "q") -> list:
        """The queue's dedup table as the snapshot holds it, oldest first."""
        table = self.store.vdedup.get(queue) if queue in self.store.virtual_queues \
            else self.q(queue).dedup
        return [] if table is None else table.to_wire()


@pytest.fixture
def d() -> Driver:
    return Driver()


# -- priorities ----------------------------------------------------------------------


def test_lower_priority_first_then_ready_order(d):
    d.produce(NOW, data="a")  # 1: default
    d.produce_batch(NOW, [item("b", priority=2000)])  # 2
    d.produce_batch(NOW + 1, [item("c", priority=5), item("d", priority=5)])  # 3, 4
    d.produce_batch(NOW + 2, [item("e", priority=0)])  # 5
    d.produce(NOW + 3, data="f")  # 6
    d.produce_batch(NOW + 4, [item("g", priority=DEFAULT)])  # 7: the default path
    d.produce_batch(NOW + 5, [item("h", priority=1023), item("i", priority=1025)])  # 8, 9
    d.produce_batch(NOW + 6, [item("j", priority=2**31 - 1), item("k", priority=0)])  # 10, 11
    expected = ["e", "k", "c", "d", "h", "a", "f", "g", "i", "b", "j"]
    by_data = {d.msg(i)[0]: i for i in d.ids()}
    assert d.due(NOW + 10) == [by_data[x] for x in expected]
    assert [d.consume(NOW + 10)[1] for _ in expected] == expected
    assert d.consume(NOW + 10) is None


def test_among_one_priority_the_longest_ready_goes_first(d):
    d.produce_batch(NOW, [item("later", priority=9, delay=5)])  # ready NOW + 5 s
    d.produce_batch(NOW + 1000, [item("sooner", priority=9)])  # ready NOW + 1 s
    d.produce_batch(NOW + 1000, [item("tie", priority=9)])  # same time: by id
    d.produce_batch(NOW + 6000, [item("last", priority=9)])
    assert [d.consume(NOW + 6000)[1] for _ in range(4)] == ["sooner", "tie", "later", "last"]


def test_a_delayed_prioritized_message_waits_for_its_time(d):
    d.produce_batch(NOW, [item("urgent-later", priority=0, delay=10)])
    d.produce(NOW, data="plain")
    d.produce(NOW, data="plain2")
    assert d.view(1, NOW)["state"] == "delayed" and d.view(1, NOW)["priority"] == 0
    assert d.q().counts(NOW) == (2, 1, 0)
    assert d.q().next_ready_ms() == NOW
    assert d.consume(NOW + 9999)[1] == "plain"
    assert d.q().counts(NOW + 9999) == (1, 1, 0)
    assert d.consume(NOW + 10_000)[1] == "urgent-later"
    assert d.consume(NOW + 10_000)[1] == "plain2"


def test_retries_and_nacks_of_prioritized_messages_come_back_at_their_priority(d):
    d.produce_batch(NOW, [item("u", priority=3, retry=5)])  # 1
    d.produce(NOW, data="p1")  # 2
    d.produce_batch(NOW, [item("lazy", priority=3000, retry=5)])  # 3
    assert d.consume(NOW) == (1, "u", 1)  # in flight until NOW + 5 s
    assert d.view(1, NOW)["state"] == "in_flight"
    assert d.q().counts(NOW) == (2, 0, 1)
    d.produce(NOW + 1000, data="p2")  # 4
    assert d.consume(NOW + 1000)[1] == "p1"
    assert d.consume(NOW + 4999)[1] == "p2"
    assert d.consume(NOW + 5000) == (1, "u", 2)  # back, before the less urgent one
    assert d.nack(NOW + 5000, 1, ready_ms=NOW + 6000) == NOW + 6000
    d.produce(NOW + 5500, data="p3")  # 5
    assert d.consume(NOW + 5999)[1] == "p3"
    d.produce(NOW + 5999, data="p4")  # 6
    assert d.consume(NOW + 6000) == (1, "u", 3)  # nacked: at its priority again
    assert d.view(1, NOW + 6000)["priority"] == 3
    assert d.consume(NOW + 6000)[1] == "p4"
    assert d.consume(NOW + 6000) == (3, "lazy", 1)
    # a touched prioritized delivery keeps its priority too
    assert d.touch(NOW + 7000, 3, lease_ms=1000) == NOW + 8000
    d.produce(NOW + 7000, data="p5")  # 7
    assert d.due(NOW + 11_000) == [1, 7, 3]
    # confirmed: its priority goes with it
    assert d.confirm("q", 1) is True
    assert d.q().priorities == {3: 3000}


def test_a_final_prioritized_delivery_leaves_as_any_other(d):
    d.configure(max_deliveries=2, dead_letter="dlq")
    d.produce_batch(NOW, [item("x", priority=7, retry=5), item("y", priority=2000, retry=5)])
    assert d.consume(NOW) == (1, "x", 1)
    entry = d.decide(d.store.decide_consume_values, "q", NOW + 5000, EPOCH, 0)
    assert entry == Consume("q", 1, NOW + 10_000, EPOCH, FINAL_MAX_DELIVERIES)
    assert d.consume(NOW + 5000) == (1, "x", 2)
    q = d.q()
    assert (NOW + 10_000) << 64 | 1 in q.finals
    assert d.store.final_queues == {"q"}
    assert d.view(1, NOW + 20_000)["state"] == "in_flight"  # until the master moves it
    assert d.touch(NOW + 6000, 1, lease_ms=1000) == NOW + 7000  # still final
    assert d.msg(1)[8] == FINAL_MAX_DELIVERIES
    assert d.consume(NOW + 7000) == (2, "y", 1)  # a final delivery never comes back
    moves = d.expire(NOW + 7000)
    assert moves == [DeadLetter("q", 1, FINAL_MAX_DELIVERIES, (("dlq", 1),), NOW + 7000,
                                NOW + 7000 + DEFAULT_TTL_MS)]
    assert d.q().priorities == {2: 2000}
    # a dead letter gets the default priority: a 13-value row, no priority
    assert d.store.queues["dlq"].priorities == {}
    assert d.view(1, NOW + 7000, "dlq")["priority"] == DEFAULT
    dlq_rows = next(item_[2] for item_ in d.store.to_wire() if item_[0] == "dlq")
    assert [len(row) for row in dlq_rows] == [13]
    # a final prioritized delivery can be confirmed
    d.consume(NOW + 12_000)  # y's second delivery: final
    assert d.store.final_queues == {"q"}
    assert d.confirm("q", 2) is True
    assert d.store.final_queues == set() and d.q().priorities == {}


def test_priority_1024_is_the_default_path(d):
    d.produce_batch(NOW, [item("a", priority=DEFAULT), item("b")])
    d.produce_one(NOW, data="c", priority=DEFAULT)
    q = d.q()
    assert q.priorities == {} and list(q.fifo) == [1, 2, 3]
    assert [len(row) for row in d.store.to_wire()[0][2]] == [6, 6, 6]
    assert d.view(1, NOW)["priority"] == DEFAULT
    d.produce_batch(NOW, [item("d", priority=1)])
    assert [len(row) for row in d.store.to_wire()[0][2]] == [6, 6, 6, 7]
    assert d.store.to_wire()[0][2][3][-1] == 1


# Histories of prioritized and plain produces, consumes, nacks and time:
# peek (`due`), a consume with count, single consumes and a plain sort by
# (priority, due time, id) must agree.
_PRIORITIES = st.sampled_from([0, 5, 1000, 1023, DEFAULT, DEFAULT, 1025, 5000])
_history = st.lists(st.one_of(
    st.tuples(st.just("produce"), _PRIORITIES, st.sampled_from([None, 0, 2, 7]),
              st.sampled_from([0, 0, 3])),
    st.tuples(st.just("consume"), st.integers(1, 3)),
    st.tuples(st.just("nack"), st.integers(0, 20), st.sampled_from([0, 1000, 4000])),
    st.tuples(st.just("advance"), st.sampled_from([1, 500, 1000, 3000]))), max_size=30)


def _play(d: Driver, history) -> int:
    now = NOW
    for step in history:
        if step[0] == "produce":
            _, priority, delay, retry = step
            d.produce_batch(now, [item(f"m{len(d.entries)}", priority=priority, delay=delay,
                                       retry=retry)])
        elif step[0] == "consume":
            for _ in range(step[1]):
                d.consume(now)
        elif step[0] == "nack":
            q = d.store.get("q")
            flying = [] if q is None else sorted(
                i for i, m in q.messages.items() if m[4] > now)
            if flying:
                d.nack(now, flying[step[1] % len(flying)], ready_ms=now + step[2])
        else:
            now += step[1]
    return now


def _copy(d: Driver) -> Driver:
    twin = Driver(**d.kw)
    twin.store.load_wire(d.store.to_wire())
    twin.replica.load_wire(d.store.to_wire())
    twin.check()
    return twin


@settings(max_examples=100, deadline=None)
@given(history=_history, later=st.sampled_from([0, 0, 1000, 4000]))
def test_peek_consume_many_and_single_consumes_agree_with_priorities(history, later):
    d = Driver()
    now = _play(d, history) + later
    q = d.store.get("q")
    if q is None:
        return
    naive = sorted((q.priorities.get(i, DEFAULT), m[4] or m[1], i)
                   for i, m in q.messages.items() if (m[4] or m[1]) <= now
                   and not (len(m) > 5 and m[8]))
    expected = [i for _, _, i in naive]
    assert d.due(now) == expected
    assert q.next_due(now) == (expected[0] if expected else None)
    many = _copy(d)
    assert [i for _, i, _, _ in many.consume_many(now, ["q"], 1000)] == expected
    single = _copy(d)
    got = []
    while (delivered := single.consume(now)) is not None:
        got.append(delivered[0])
    assert got == expected
    assert many.store.to_wire() == single.store.to_wire()


def test_consume_many_across_queues_with_priorities():
    d = Driver()
    d.produce(NOW, "a", "a1")
    d.produce_batch(NOW, [item("a2", priority=2000), item("a3", priority=3)], "a")
    d.produce_batch(NOW, [item("b1", priority=1)], "b")
    got = d.consume_many(NOW, ["a", "b"], 4)
    assert [(name, data) for name, _, data, _ in got] == [
        ("a", "a3"), ("a", "a1"), ("a", "a2"), ("b", "b1")]


def test_a_clock_behind_the_mark_still_gives_the_right_order(d):
    """A new master whose clock is behind the old one's: `pmark` (the latest
    time reads promoted up to) is ahead of its `now`, and what `pready`
    holds may not be due yet."""
    d.produce_batch(NOW, [item("A", priority=1, delay=10)])  # 1: ready NOW + 10 s
    q = d.q()
    assert q.next_due(NOW + 10_000) == 1  # the old master's read at NOW + 10 s
    assert q.pmark == NOW + 10_000
    # the new master's clock says NOW + 2 s
    d.produce_batch(NOW + 2000, [item("B", priority=5, retry=1)])  # 2
    d.produce(NOW + 2000, data="C")  # 3
    d.produce_batch(NOW + 2000, [item("D", priority=1500, delay=4)])  # 4: ready NOW + 6 s
    assert d.due(NOW + 2000) == [2, 3]
    assert q.next_due(NOW + 2000) == 2
    assert q.counts(NOW + 2000) == (2, 2, 0)
    assert d.view(1, NOW + 2000)["state"] == "delayed"
    assert d.consume(NOW + 2000) == (2, "B", 1)  # in flight until NOW + 3 s
    assert q.counts(NOW + 2500) == (1, 2, 1)
    assert d.consume(NOW + 2500) == (3, "C", 1)
    assert d.consume(NOW + 2500) is None  # B's lease runs, A and D are not due
    assert d.consume(NOW + 3000) == (2, "B", 2)  # in flight until NOW + 4 s
    assert d.consume(NOW + 3999) is None
    assert d.due(NOW + 6000) == [2, 4]
    assert d.confirm("q", 2) is True
    assert d.consume(NOW + 5999) is None
    assert d.consume(NOW + 6000) == (4, "D", 1)
    assert d.consume(NOW + 9999) is None
    assert q.counts(NOW + 9999) == (0, 1, 0)
    assert d.consume(NOW + 10_000) == (1, "A", 1)


def test_next_ready_ms_with_a_clock_behind_the_mark(d):
    """Regression: next_ready_ms took pready's most urgent key, not its
    earliest time: with a clock behind pmark a parked consume woke late."""
    d.produce_batch(NOW, [item("A", priority=1, delay=10)])  # ready NOW + 10 s
    d.q().next_due(NOW + 10_000)  # the old master's read: pmark NOW + 10 s
    d.produce_batch(NOW, [item("B", priority=5, delay=3)])  # a new master: ready NOW + 3 s
    assert d.due(NOW + 3000) == [2]
    assert d.q().next_ready_ms() == NOW + 3000  # not A's NOW + 10 s


def test_wait_status_counts_ready_prioritized_messages(d):
    """Regression: wait_status counted only the FIFO and `pending`."""
    d.produce(NOW, data="plain")
    d.produce_batch(NOW, [item("urgent", priority=1)])
    # both have waited 10 s (README: "the seconds waited by the (at most 16)
    # oldest ready messages")
    assert d.q().wait_status(NOW + 10_000) == 20
    d.consume(NOW + 10_000)  # the prioritized one: in flight, no longer waiting
    assert d.q().wait_status(NOW + 10_000) == 10


def test_oldest_ready_age_is_the_longest_ready_message(d):
    """Regression: oldest_ready_ms gave the next delivery's time (the most
    urgent message's), not the longest-ready message's."""
    d.produce(NOW, data="old")
    d.produce_batch(NOW + 9000, [item("urgent", priority=1)])
    # README: "the seconds the longest-ready message has been deliverable"
    assert d.q().oldest_ready_ms(NOW + 10_000) == NOW  # not the urgent one's NOW + 9 s
    d.consume(NOW + 10_000)
    d.consume(NOW + 10_000)
    d.produce_batch(NOW + 10_000, [item("late", priority=1)])
    d.produce(NOW + 20_000, data="later")
    assert d.q().oldest_ready_ms(NOW + 30_000) == NOW + 10_000


# -- batch produce ---------------------------------------------------------------


def test_a_batch_is_one_entry_with_consecutive_ids(d):
    d.produce(NOW)
    d.produce(NOW)
    items = [item("a"), item("b", priority=3, delay=10, retry=2.5), item("c", ttl=60)]
    entry, plan = d.decide_batch(NOW, items)
    assert plan == [0, 1, 2]
    assert entry == ProduceBatch("q", (("q", 3),), (
        ("a", NOW, NOW + HOUR, 0, DEFAULT, ""),
        ("b", NOW + 10_000, NOW + 10_000 + HOUR, 2500, 3, ""),
        ("c", NOW, NOW + 60_000, 0, DEFAULT, "")), NOW, NOW - WINDOW)
    assert d.produce_batch(NOW, items) == ([3, 4, 5], [])
    assert d.q().max_id == 5 and d.ids() == [1, 2, 3, 4, 5]
    assert [d.msg(i)[0] for i in (3, 4, 5)] == ["a", "b", "c"]
    # a batch into a queue that does not exist yet creates it
    assert d.produce_batch(NOW, [item("x"), item("y")], "new") == ([1, 2], [])
    # a past absolute delay is ready now
    assert d.produce_batch(NOW, [item("p", delay=NOW // 1000 - 50)]) == ([6], [])
    assert d.msg(6)[1] == NOW


def test_a_batch_is_all_or_nothing_when_the_queue_is_full(d):
    d.configure(max_size=4)
    d.produce(NOW)
    d.produce_one(NOW, dedup_id="k")  # 2
    before = d.store.to_wire()
    assert d.produce_batch(NOW, [item("a"), item("b"), item("c")]) == "queue full: q"
    assert d.store.to_wire() == before
    assert d.produce_batch(NOW, [item("a"), item("b")]) == ([3, 4], [])
    assert d.produce(NOW) == "queue full: q"
    assert d.produce_batch(NOW, [item("a")]) == "queue full: q"
    # duplicates store nothing: a full queue still answers them
    assert d.produce_batch(NOW, [item("a", dedup_id="k"), item("b", dedup_id="k")]) == (
        [2, 2], [0, 1])
    assert d.produce_one(NOW, dedup_id="k") == (2, True)
    # ...but not with one new message beside them
    assert d.produce_batch(NOW, [item("a", dedup_id="k"), item("b")]) == "queue full: q"
    # room for exactly the new ones, with duplicates beside them
    d.consume(NOW)
    assert d.produce_batch(NOW, [item("a", dedup_id="k"), item("b")]) == ([2, 5], [0])


def test_a_time_error_names_the_items_index(d):
    bad = item("late", delay=10, ttl=5)  # ttl before the delay
    assert d.produce_batch(NOW, [item("a"), item("b"), bad]) == "messages[2]: time error"
    assert d.produce_batch(NOW, [bad, item("a")]) == "messages[0]: time error"
    assert d.produce_batch(NOW, [bad], batch=False) == "time error"
    assert d.store.get("q") is None  # nothing created
    # a ttl equal to the delay is no error
    assert d.produce_batch(NOW, [item("ok", delay=5, ttl=5)]) == ([1], [])


def test_a_batch_into_a_virtual_queue():
    d = Driver(virtual_queues={"v": ("v2", "v1")})
    d.produce(NOW, "v1", "first")  # v1/1: the members' ids differ
    items = [item("a"), item("b", priority=9)]
    entry, plan = d.decide_batch(NOW, items, "v")
    assert entry.queue == "v" and entry.targets == (("v2", 1), ("v1", 2))
    assert d.produce_batch(NOW, items, "v") == ([{"v2": 1, "v1": 2}, {"v2": 2, "v1": 3}], [])
    assert d.q("v1").priorities == {3: 9} and d.q("v2").priorities == {2: 9}
    assert d.produce_one(NOW, "v", "c") == ({"v2": 3, "v1": 4}, False)
    # a member that cannot take them all refuses the whole batch
    d.configure("v1", max_size=6)
    before = d.store.to_wire()
    assert d.produce_batch(NOW, [item("x"), item("y"), item("z")], "v") == "queue full: v1"
    assert d.store.to_wire() == before
    assert d.produce_batch(NOW, [item("x"), item("y")], "v") == (
        [{"v2": 4, "v1": 5}, {"v2": 5, "v1": 6}], [])
    # paused: the first paused member is named, before anything else
    d.configure("v1", paused="in")
    assert d.produce_batch(NOW, [item("x")], "v") == "queue paused: v1"
    d.configure("v2", paused="all")
    assert d.produce_batch(NOW, [item("x", delay=10, ttl=5)], "v") == "queue paused: v2"
    assert d.produce(NOW, "v") == "queue paused: v2"


# -- dedup ---------------------------------------------------------------------------


def test_a_duplicate_within_the_window_stores_nothing(d):
    assert d.produce_one(NOW, data="a", dedup_id="order-1") == (1, False)
    assert d.dedup() == [["order-1", 1, NOW]]
    before = d.store.to_wire()
    entry, plan = d.decide_batch(NOW + 1000, [item("again", dedup_id="order-1")], batch=False)
    assert entry is None and plan == [("dup", 1)]
    assert d.produce_one(NOW + 1000, data="again", dedup_id="order-1") == (1, True)
    assert d.store.to_wire() == before
    # another id, or none, is stored
    assert d.produce_one(NOW + 1000, dedup_id="order-2") == (2, False)
    assert d.produce_one(NOW + 1000, priority=2000) == (3, False)
    # the original's message may be gone: the answer still names it
    d.consume(NOW + 2000)
    assert d.ids() == [2, 3]
    assert d.produce_one(NOW + 3000, dedup_id="order-1") == (1, True)
    # another queue has a table of its own
    assert d.produce_one(NOW + 3000, "r", dedup_id="order-1") == (1, False)


@pytest.mark.parametrize("window", [None, 10_000, 1])
def test_the_windows_edge(d, window):
    if window is not None:
        d.configure(dedup_window_ms=window)
    w = WINDOW if window is None else window
    assert d.produce_one(NOW, dedup_id="k") == (1, False)
    if w > 1:
        assert d.produce_one(NOW + w - 1, dedup_id="k") == (1, True)
    else:
        assert d.produce_one(NOW, dedup_id="k") == (1, True)
    assert d.produce_one(NOW + w, dedup_id="k") == (2, False)
    assert d.dedup() == [["k", 2, NOW + w]]  # accepted again: its new time
    assert d.produce_one(NOW + 2 * w - 1 if w > 1 else NOW + w, dedup_id="k") == (2, True)
    assert d.produce_one(NOW + 2 * w, dedup_id="k") == (3, False)


def test_a_window_of_0_turns_dedup_off(d):
    d.configure(dedup_window_ms=0)
    entry, plan = d.decide_batch(NOW, [item("a", dedup_id="k")], batch=False)
    assert entry.items[0][5] == "" and plan == [0]
    assert d.produce_one(NOW, dedup_id="k") == (1, False)
    assert d.produce_one(NOW, dedup_id="k") == (2, False)
    assert d.produce_batch(NOW, [item(dedup_id="k"), item(dedup_id="k")]) == ([3, 4], [])
    assert d.dedup() == []
    assert d.q().settings()["dedup_window"] == 0


def test_a_dedup_id_repeated_in_one_batch(d):
    items = [item("x", dedup_id="a"), item("y", dedup_id="b"), item("z", dedup_id="a"),
             item("w"), item("v", dedup_id="b")]
    entry, plan = d.decide_batch(NOW, items)
    assert plan == [0, 1, ("same", 0), 2, ("same", 1)]
    assert [it[0] for it in entry.items] == ["x", "y", "w"]
    assert d.produce_batch(NOW, items) == ([1, 2, 1, 3, 2], [2, 4])
    assert d.dedup() == [["a", 1, NOW], ["b", 2, NOW]]
    # the next batch: earlier ids are duplicates of the table's entries
    assert d.produce_batch(NOW + 5, [item(dedup_id="c"), item(dedup_id="a"),
                                     item(dedup_id="c")]) == ([4, 1, 4], [1, 2])


def test_a_virtual_queue_has_a_table_of_its_own():
    d = Driver(virtual_queues={"v": ("v2", "v1")})
    d.produce(NOW, "v1")
    assert d.produce_one(NOW, "v", dedup_id="k") == ({"v2": 1, "v1": 2}, False)
    assert d.store.vdedup["v"].ids == {"k": ((("v2", 1), ("v1", 2)), NOW)}
    assert d.dedup("v") == [["k", [["v2", 1], ["v1", 2]], NOW]]
    assert d.produce_one(NOW + 1, "v", dedup_id="k") == ({"v2": 1, "v1": 2}, True)
    assert d.produce_batch(NOW + 1, [item(dedup_id="k"), item(dedup_id="j")], "v") == (
        [{"v2": 1, "v1": 2}, {"v2": 2, "v1": 3}], [0])
    # the real queues' own tables are apart
    assert d.produce_one(NOW + 1, "v1", dedup_id="k") == (4, False)
    assert d.dedup("v1") == [["k", 4, NOW + 1]] and d.dedup("v2") == []
    # a virtual produce without dedup ids makes no table
    e = Driver(virtual_queues={"v": ("v2", "v1")})
    e.produce_batch(NOW, [item(priority=3)], "v")
    assert e.store.vdedup == {}
    assert [row[0] for row in e.store.to_wire()] == ["v1", "v2"]


def test_a_virtual_queue_uses_its_first_real_queues_window():
    d = Driver(virtual_queues={"v": ("v2", "v1")})
    d.configure("v2", dedup_window_ms=5000)
    d.configure("v1", dedup_window_ms=600_000)
    assert d.produce_one(NOW, "v", dedup_id="k") == ({"v2": 1, "v1": 1}, False)
    assert d.produce_one(NOW + 4999, "v", dedup_id="k")[1] is True
    assert d.produce_one(NOW + 5000, "v", dedup_id="k") == ({"v2": 2, "v1": 2}, False)
    d.configure("v2", dedup_window_ms=0)  # off: the id is not even recorded
    entry, plan = d.decide_batch(NOW + 5001, [item(dedup_id="k")], "v", batch=False)
    assert plan == [0] and entry.items[0][5] == ""


def _prune_setup() -> Driver:
    d = Driver()
    d.configure(dedup_window_ms=10_000)
    d.produce_one(NOW, dedup_id="a")  # 1
    d.produce_one(NOW + 5000, dedup_id="b")  # 2
    return d


def test_the_table_is_pruned_by_the_entries_cutoffs():
    d = _prune_setup()
    # a plain produce (no priority, no dedup id) prunes nothing
    d.produce(NOW + 50_000)  # 3
    assert [row[0] for row in d.dedup()] == ["a", "b"]
    # a batch without dedup ids prunes what its cutoff passed
    d.produce_batch(NOW + 12_000, [item(priority=3)])  # 4; cutoff NOW + 2 s
    assert d.dedup() == [["b", 2, NOW + 5000]]
    # the cutoff is the entry's, never a clock: accepted far ahead, cutoff early
    d.apply(ProduceBatch("q", (("q", 5),), (("x", NOW, NOW + HOUR, 0, DEFAULT, "c"),),
                         NOW + 10**9, NOW + 4999))
    assert [row[0] for row in d.dedup()] == ["b", "c"]
    d.apply(ProduceBatch("q", (("q", 6),), (("x", NOW, NOW + HOUR, 0, DEFAULT, ""),),
                         NOW + 1, NOW + 5000))  # at or before the cutoff: pruned
    assert d.dedup() == [["c", 5, NOW + 10**9]]


def test_pruning_stops_at_the_first_id_not_old_enough():
    d = _prune_setup()
    # an id accepted again after its window keeps its place in the table
    d.apply(ProduceBatch("q", (("q", 3),), (("x", NOW, NOW + HOUR, 0, DEFAULT, "z"),),
                         NOW, NOW - 10_000))  # accepted at NOW (a slower clock)
    assert [row[0] for row in d.dedup()] == ["a", "b", "z"]
    d.produce_batch(NOW + 12_000, [item()])  # cutoff NOW + 2 s: a goes, b stops it
    assert [row[0] for row in d.dedup()] == ["b", "z"]
    # z is past its window: not a duplicate, though still in the table
    assert d.produce_one(NOW + 12_000, dedup_id="z") == (5, False)
    assert d.dedup() == [["b", 2, NOW + 5000], ["z", 5, NOW + 12_000]]


def test_the_bound_of_a_table_drops_the_oldest_first(d, monkeypatch):
    monkeypatch.setattr(store_module, "DEDUP_MAX_IDS", 3)
    for n, dedup_id in enumerate("abcd", start=1):
        assert d.produce_one(NOW + n, dedup_id=dedup_id) == (n, False)
    assert [row[0] for row in d.dedup()] == ["b", "c", "d"]  # a went, inside its window
    assert d.produce_one(NOW + 10, dedup_id="a") == (5, False)  # no longer recognised
    assert [row[0] for row in d.dedup()] == ["c", "d", "a"]
    assert d.produce_one(NOW + 10, dedup_id="c") == (3, True)
    # in a batch, each new id pushes out the oldest; a duplicate takes no room
    assert d.produce_batch(NOW + 20, [item(dedup_id="x"), item(dedup_id="d"),
                                      item(dedup_id="y")]) == ([6, 4, 7], [1])
    assert [row[0] for row in d.dedup()] == ["a", "x", "y"]
    assert d.produce_batch(NOW + 30, [item(dedup_id="a"), item(dedup_id="z")]) == (
        [5, 8], [0])
    assert d.dedup() == [["x", 6, NOW + 20], ["y", 7, NOW + 20], ["z", 8, NOW + 30]]
    # a batch of as many new ids as the bound replaces the whole table
    assert d.produce_batch(NOW + 40, [item(dedup_id=x) for x in "klm"]) == ([9, 10, 11], [])
    assert [row[0] for row in d.dedup()] == ["k", "l", "m"]


def test_revert_of_a_batch_that_evicts_its_own_ids(monkeypatch):
    """Regression: DedupTable.undo took back the adds before the evictions:
    an id that one entry added and then evicted (more new ids than the
    bound) raised KeyError in revert."""
    monkeypatch.setattr(store_module, "DEDUP_MAX_IDS", 2)
    store = Store(queue_size=10)
    entry, _ = store.decide_produce_batch(ProduceBatchRequest(
        "q", tuple(item(dedup_id=x) for x in "xyz"), True), NOW)
    undo: list = []
    store.apply(entry, undo)
    store._check()
    assert store.queues["q"].dedup.to_wire() == [["y", 2, NOW], ["z", 3, NOW]]
    store.revert(undo)
    store._check()
    assert store.to_wire() == []
    # and over a full table: the evicted old ids come back in their order
    store.apply(store.decide_produce_batch(ProduceBatchRequest(
        "q", (item(dedup_id="a"), item(dedup_id="b")), True), NOW)[0])
    before = store.to_wire()
    entry, _ = store.decide_produce_batch(ProduceBatchRequest(
        "q", tuple(item(dedup_id=x) for x in "xyz"), True), NOW + 1)
    undo = []
    store.apply(entry, undo)
    store.revert(undo)
    store._check()
    assert store.to_wire() == before


# -- clear ---------------------------------------------------------------------------


def test_clear_removes_every_message_and_keeps_the_rest(d):
    d.configure(dead_letter="dlq", max_size=50, dedup_window_ms=60_000, paused="none")
    d.produce(NOW, data="plain")  # 1
    d.produce_one(NOW, data="prio", priority=2, dedup_id="k")  # 2
    d.produce(NOW, data="flying", retry=5)  # 3
    d.produce(NOW, data="final", retry=5, ttl=3)  # 4: its first lease reaches the ttl
    d.produce(NOW, data="delayed", delay=30)  # 5
    d.produce_one(NOW, data="prio-retry", priority=3000, retry=5)  # 6
    assert [d.consume(NOW)[1] for _ in range(5)] == ["prio", "plain", "flying", "final",
                                                      "prio-retry"]
    assert d.msg(4)[8] == FINAL_EXPIRED and d.store.final_queues == {"q"}
    settings_ = d.q().settings()
    table = d.dedup()
    assert d.clear() == 4
    q = d.q()
    assert q.messages == {} and q.priorities == {} and q.max_id == 6
    assert q.settings() == settings_ and d.dedup() == table
    assert d.store.final_queues == set() and d.store.next_final_ms() is None
    assert q.counts(NOW) == (0, 0, 0) and d.due(NOW + HOUR) == []
    # ids never repeat; the dedup table still answers the first produce's id
    assert d.produce(NOW) == 7
    assert d.produce_one(NOW, dedup_id="k") == (2, True)
    assert d.expire(NOW + HOUR) == []
    # nothing to clear: no entry; unknown queue: 0; a virtual queue: refused
    d.consume(NOW)
    assert d.decide(d.store.decide_clear, "q") is None and d.clear() == 0
    assert d.clear("nope") == 0 and d.store.get("nope") is None
    v = Driver(virtual_queues={"v": ("a", "b")})
    v.produce(NOW, "v")
    assert v.clear("v") == "virtual queue only takes produce"
    assert v.clear("a") == 1 and v.ids("b") == [1]


def test_clear_of_one_queue_leaves_the_others_finals(d):
    d.configure("r", dead_letter="dlq")
    d.produce(NOW, "r", retry=5, ttl=3)
    d.consume(NOW, "r")
    d.produce(NOW, retry=5)
    assert d.store.final_queues == {"r"}
    assert d.clear() == 1
    assert d.store.final_queues == {"r"}
    assert d.clear("r") == 1
    assert d.store.final_queues == set()


# -- pause and max_size -----------------------------------------------------------


def test_paused_in_refuses_produces_only(d):
    d.produce(NOW, data="a")
    assert d.configure(paused="in")["paused"] == "in"
    assert d.produce(NOW) == "queue paused"
    assert d.produce_batch(NOW, [item()]) == "queue paused"
    assert d.produce_one(NOW, dedup_id="x") == "queue paused"
    assert d.produce_batch(NOW, [item(delay=10, ttl=5)]) == "queue paused"  # before times
    assert d.consume(NOW) == (1, "a", 1)
    assert d.q().limit == 0


def test_paused_out_delivers_nothing_and_still_takes_produces(d):
    d.produce(NOW, data="a", retry=5)
    d.produce_batch(NOW, [item("b", priority=1)])
    d.configure(paused="out")
    assert d.consume(NOW) is None
    assert d.consume_many(NOW, ["q"], 5) == []
    assert d.due(NOW) == [] and d.q().next_due(NOW) is None
    assert d.q().next_ready_ms() is None and d.q().oldest_ready_ms(NOW) is None
    assert d.q().counts(NOW) == (2, 0, 0)  # monitor still counts them
    assert d.produce(NOW, data="c") == 3
    d.configure(paused="all")
    assert d.produce(NOW) == "queue paused"
    assert d.consume(NOW) is None
    d.configure(paused="none")
    assert [d.consume(NOW)[1] for _ in range(3)] == ["b", "a", "c"]
    assert d.q().next_ready_ms() == NOW + 5000


def test_pause_creates_the_queue_and_dead_letters_are_not_refused(d):
    assert d.configure("dlq", paused="all") == {
        "max_deliveries": 0, "dead_letter": None, "max_size": 1000, "dedup_window": 300,
        "paused": "all"}
    d.configure(max_deliveries=1, dead_letter="dlq")
    d.produce(NOW, retry=5)
    d.consume(NOW)
    assert [m.targets for m in d.expire(NOW + 5000)] == [(("dlq", 1),)]
    assert d.ids("dlq") == [1]
    assert d.consume(NOW + 5000, "dlq") is None
    # confirm, nack and touch work as usual in a paused queue
    d.configure(paused="all")
    d.configure(max_deliveries=0)
    d.configure(paused="none")
    d.produce(NOW, retry=5)
    d.consume(NOW)
    d.configure(paused="all")
    assert d.touch(NOW, 2, lease_ms=1000) == NOW + 1000
    assert d.nack(NOW, 2) == NOW
    assert d.confirm("q", 2) is True


def test_max_size_bounds_one_queue():
    d = Driver(queue_size=5)
    assert d.configure(max_size=2)["max_size"] == 2
    assert d.produce(NOW) == 1 and d.produce_one(NOW, priority=3) == (2, False)
    assert d.produce(NOW) == "queue full: q"
    assert d.produce_one(NOW, priority=3) == "queue full: q"
    assert d.configure(max_size=0)["max_size"] == 5  # 0: the node's queue_size
    assert [d.produce(NOW) for _ in range(4)] == [3, 4, 5, "queue full: q"]
    assert d.configure(max_size=7)["max_size"] == 7  # above queue_size too
    assert d.produce_batch(NOW, [item(), item()]) == ([6, 7], [])
    assert d.produce(NOW) == "queue full: q"
    # lowered below what it holds: refused until consumes make room
    d.configure(max_size=3)
    for _ in range(4):
        d.consume(NOW)
    assert d.produce(NOW) == "queue full: q"
    d.consume(NOW)
    assert d.produce(NOW) == 8
    assert d.store.get("r") is None and d.store.view("r").settings()["max_size"] == 5


def test_xml_queue_defaults_and_config_over_them():
    defaults = {"q": {"max_size": 2, "max_deliveries": 3, "dead_letter": "dlq",
                      "dedup_window_ms": 1000}}
    d = Driver(queue_size=10, queue_defaults=defaults)
    expected = {"max_deliveries": 3, "dead_letter": "dlq", "max_size": 2, "dedup_window": 1,
                "paused": "none"}
    assert d.store.view("q").settings() == expected  # before any entry
    assert d.produce_one(NOW, dedup_id="k") == (1, False)
    assert d.q().settings() == expected
    assert d.produce_one(NOW + 999, dedup_id="k") == (1, True)
    assert d.produce_one(NOW + 1000, dedup_id="k") == (2, False)
    assert d.produce(NOW) == "queue full: q"
    assert d.store.view("other").settings()["max_size"] == 10
    # not state: no extras in the snapshot form
    assert d.store.to_wire()[0][0] == "q" and len(d.store.to_wire()[0]) == 4
    assert set(d.store.to_wire()[0][3]) == {"dedup"}
    # config (5) wins over them
    assert d.configure(max_size=4, dedup_window_ms=0, dead_letter="")["max_size"] == 4
    assert d.q().settings() == {"max_deliveries": 3, "dead_letter": None, "max_size": 4,
                                "dedup_window": 0, "paused": "none"}
    assert d.produce_one(NOW + 1000, dedup_id="k") == (3, False)
    assert d.configure(max_size=0)["max_size"] == 10  # spec15: 0 = the node's queue_size
    # a node with other defaults loading this state keeps its own defaults
    other = Store(queue_size=10, queue_defaults={"q": {"max_deliveries": 9}})
    other.load_wire(d.store.to_wire())
    assert other.queues["q"].settings() == {"max_deliveries": 9, "dead_letter": None,
                                            "max_size": 10, "dedup_window": 0,
                                            "paused": "none"}
    # a produce decided for a queue no entry created yet obeys its defaults
    e = Driver(queue_size=10, queue_defaults={"q": {"max_size": 1}})
    assert e.produce_batch(NOW, [item(), item()]) == "queue full: q"
    assert e.produce_batch(NOW, [item()]) == ([1], [])


# -- revert of every new entry kind --------------------------------------------------


def test_revert_of_every_new_kind_newest_first_restores_each_state():
    store = Store(queue_size=100, virtual_queues={"v": ("v1", "v2")})
    base_entries = [
        Produce((("q", 1),), "plain", NOW, NOW + HOUR, 5000),
    ]
    for entry in base_entries:
        store.apply(entry)
    base = store.to_wire()
    steps = [
        Configure("q", (("dedup_window_ms", 5000), ("max_size", 50), ("paused", "out"))),
        ProduceBatch("q", (("q", 2),), (("a", NOW, NOW + HOUR, 5000, 3, "da"),
                                        ("b", NOW, NOW + HOUR, 0, DEFAULT, "db"),
                                        ("c", NOW + 9000, NOW + HOUR, 0, 2000, "")),
                     NOW, NOW - 5000),
        ProduceBatch("fresh", (("fresh", 1),), (("f", NOW, NOW + HOUR, 0, 7, "x"),),
                     NOW, NOW - WINDOW),  # creates a queue
        ProduceBatch("v", (("v1", 1), ("v2", 1)), (("va", NOW, NOW + HOUR, 0, 5, "vx"),
                                                  ("vb", NOW, NOW + HOUR, 0, DEFAULT, "")),
                     NOW, NOW - WINDOW),  # creates v1, v2 and v's table
        Configure("q", (("paused", "none"),)),
        Consume("q", 2, NOW + 5000, EPOCH, FINAL_NONE),  # a prioritized delivery
        ConsumeMany((("q", 1, NOW + 5000, FINAL_NONE),), EPOCH),
        Nack("q", 2, NOW + 100),
        ProduceBatch("q", (("q", 5),), (("d", NOW, NOW + HOUR, 0, 1, "da"),),
                     NOW + 6000, NOW + 1000),  # prunes da and db, takes da again
        ProduceBatch("v", (("v1", 3), ("v2", 3)), (("vc", NOW, NOW + HOUR, 0, DEFAULT, "vy"),),
                     NOW + 6000, NOW + 6000 - WINDOW),
        Consume("q", 5, 0, 0, FINAL_NONE),  # a prioritized message deleted by its delivery
        Clear("q"),
        ProduceBatch("q", (("q", 6),), (("e", NOW, NOW + HOUR, 0, 9, ""),),
                     NOW + 7000, NOW + 2000),
        Clear("v1"),
        Configure("v1", (("paused", "all"), ("max_size", 0))),
    ]
    wires, undos, results = [], [], []
    for entry in steps:
        wires.append(store.to_wire())
        undo: list = []
        results.append(store.apply(entry, undo))
        store._check()
        undos.append(undo)
    assert results[11] == 4 and results[13] == 3  # the clears' counts
    assert store.queues["q"].max_id == 6 and list(store.queues["q"].messages) == [6]
    assert [row[0] for row in store.queues["q"].dedup.to_wire()] == ["da"]
    assert store.vdedup["v"].to_wire() == [["vx", [["v1", 1], ["v2", 1]], NOW],
                                          ["vy", [["v1", 3], ["v2", 3]], NOW + 6000]]
    for undo, wire in zip(reversed(undos), reversed(wires)):
        store.revert(undo)
        store._check()
        assert store.to_wire() == wire
        assert store.final_queues == {n for n, q in store.queues.items() if q.finals}
    assert store.to_wire() == base
    assert set(store.queues) == {"q"} and store.vdedup == {}


def test_apply_refuses_a_batch_that_does_not_fit_the_state(d):
    from qserver.errors import InvariantError

    d.produce(NOW)
    with pytest.raises(InvariantError):  # first id at or below max_id
        d.store.apply(ProduceBatch("q", (("q", 1),), (("x", NOW, NOW + HOUR, 0, 3, ""),),
                                   NOW, NOW))
    d.check()
    assert d.ids() == [1]


# -- snapshots ---------------------------------------------------------------------


def _rich_store() -> Driver:
    """Prioritized messages in every index (never delivered: 7-value rows,
    delivered: 11, final, nacked), dedup tables of real and virtual queues,
    and the new settings."""
    d = Driver(virtual_queues={"v": ("v1", "v2")})
    d.configure(dead_letter="dlq", max_deliveries=3, max_size=40, dedup_window_ms=60_000)
    d.configure("paused", paused="out")
    d.produce(NOW, data="plain", retry=5)  # 1
    d.produce_batch(NOW, [item("urgent", priority=0, retry=5, dedup_id="u"),  # 2
                          item("lazy", priority=5000, retry=5),  # 3
                          item("later", priority=7, delay=60, dedup_id="l"),  # 4
                          item("final", priority=9, retry=5, ttl=3),  # 5
                          item("nacked", priority=8, retry=5)])  # 6
    assert [d.consume(NOW)[1] for _ in range(4)] == ["urgent", "nacked", "final", "plain"]
    d.nack(NOW, 6, ready_ms=NOW + 2000)
    assert d.msg(5)[8] == FINAL_EXPIRED
    d.produce_one(NOW, "v", dedup_id="vk", priority=4)
    d.produce_batch(NOW, [item("p1", priority=2), item("p2")], "paused")
    d.store.queues["q"].next_due(NOW + 3000)  # a read moves some into pready
    return d


def _assert_same_behaviour(a: Store, b: Store) -> None:
    assert b.to_wire() == a.to_wire()
    b._check()
    assert b.final_queues == a.final_queues
    assert b.next_final_ms() == a.next_final_ms()
    assert {n: t.ids for n, t in b.vdedup.items()} == {n: t.ids for n, t in a.vdedup.items()}
    for name, q in a.queues.items():
        other = b.queues[name]
        for now in (NOW, NOW + 3000, NOW + 60_000, NOW + HOUR):
            assert list(other.due(now)) == list(q.due(now))
            assert other.counts(now) == q.counts(now)
        assert other.settings() == q.settings()
        assert other.priorities == q.priorities
        assert other.dedup.ids == q.dedup.ids


def test_to_wire_and_load_wire_keep_priorities_and_dedup_tables():
    d = _rich_store()
    wire = d.store.to_wire()
    by_name = {item_[0]: item_ for item_ in wire}
    assert [len(row) for row in by_name["q"][2]] == [10, 11, 7, 7, 11, 11]
    assert [row[-1] for row in by_name["q"][2][1:]] == [0, 5000, 7, 9, 8]
    assert by_name["q"][3]["dedup"] == [["u", 2, NOW], ["l", 4, NOW]]
    assert by_name["paused"][3] == {"paused": "out"}
    assert by_name["v"] == ["v", 0, [], {"virtual": True,
                                         "dedup": [["vk", [["v1", 1], ["v2", 1]], NOW]]}]
    copy = Store(queue_size=1000, virtual_queues={"v": ("v1", "v2")})
    copy.load_wire(wire)
    _assert_same_behaviour(d.store, copy)
    # the copy decides as the original does
    req = ProduceBatchRequest("v", (item(dedup_id="vk"),), False)
    assert copy.decide_produce_batch(req, NOW + 1) == (None, [("dup", (("v1", 1), ("v2", 1)))])
    assert d.store.decide_produce_batch(req, NOW + 1) == copy.decide_produce_batch(req, NOW + 1)


@pytest.mark.parametrize("source", ["to_wire", "iter"])
def test_snapshot_format_round_trip_with_priorities_and_dedup_tables(source):
    d = _rich_store()
    state = d.store.to_wire() if source == "to_wire" else fmt.store_wire_iter(d.store)
    blob = b"".join(fmt.encode_snapshot_chunks(11, 4, state))
    assert blob[4] == 3  # the version written
    trans_id, vote_id, decoded = fmt.decode_snapshot(blob)
    assert (trans_id, vote_id) == (11, 4)
    plain = Store(queue_size=1000, virtual_queues={"v": ("v1", "v2")})
    plain.load_wire(decoded)
    _assert_same_behaviour(d.store, plain)
    streamed = Store(queue_size=1000, virtual_queues={"v": ("v1", "v2")})
    loader = streamed.snapshot_loader()
    fmt.decode_snapshot([blob[i:i + 5] for i in range(0, len(blob), 5)], sink=loader)
    streamed.load_wire(loader)
    _assert_same_behaviour(d.store, streamed)


def test_a_prioritized_dead_letter_row_loads():
    # 14 values: a dead letter's 13 and a priority (the loader takes every
    # prioritized row length)
    row = [1, "x", NOW, NOW + HOUR, 0, 0, 0, 0, 0, 0, "o", 3, FINAL_EXPIRED, 5]
    store = Store(queue_size=10)
    store.load_wire([["q", 1, [row]]])
    store._check()
    assert store.queues["q"].priorities == {1: 5}
    assert store.to_wire() == [["q", 1, [row]]]


@pytest.mark.parametrize("priority", [DEFAULT, -1, 2**31, "5", True, 2.0])
def test_a_bad_priority_in_a_snapshot_is_refused(priority):
    state = [["q", 1, [(1, "x", NOW, NOW + HOUR, 0, 0, priority)]]]
    with pytest.raises(ValueError):
        Store(queue_size=10).load_wire(state)
    blob = b"".join(fmt.encode_snapshot_chunks(1, 1, state))
    with pytest.raises(ValueError):
        fmt.decode_snapshot(blob, sink=Store(queue_size=10).snapshot_loader())


@pytest.mark.parametrize("extras", [
    {"dedup": "x"}, {"dedup": [[1, 1, NOW]]}, {"dedup": [["d", 1]]},
    {"dedup": [["d", 1.5, NOW]]}, {"dedup": [["d", 1, "now"]]},
    {"virtual": True, "dedup": [], "colour": 1}, {"paused": "sideways"},
    {"max_size": -1}, {"dedup_window_ms": 7 * 24 * 3600 * 1000 + 1}])
def test_bad_new_extras_in_a_snapshot_are_refused(extras):
    blob = b"".join(fmt.encode_snapshot_chunks(1, 1, [["q", 0, [], extras]]))
    state = fmt.decode_snapshot(blob)[2]
    with pytest.raises(ValueError):
        Store(queue_size=10).load_wire(state)
    with pytest.raises(ValueError):
        fmt.decode_snapshot(blob, sink=Store(queue_size=10).snapshot_loader())


@pytest.mark.parametrize("ref", [[["v1"]], [5], [], [["v1", "1"]], [[1, 1]]])
def test_a_malformed_virtual_ref_in_a_snapshot_is_refused(ref):
    """Regression: DedupTable.from_wire raised IndexError / TypeError, which
    a received snapshot's install does not catch as unusable."""
    with pytest.raises(ValueError):
        Store(queue_size=10).load_wire([["v", 0, [], {"virtual": True,
                                                      "dedup": [["d", ref, NOW]]}]])


def test_a_virtual_table_pruned_to_nothing_goes():
    """Regression: such a table stayed, empty, and Store._check() refused it."""
    d = Driver(virtual_queues={"v": ("v1", "v2")})
    d.configure("v1", dedup_window_ms=1000)
    d.produce_one(NOW, "v", dedup_id="k")
    d.produce_one(NOW + 5000, "v", priority=3)  # prunes k, adds nothing
    assert d.store.vdedup == {}
