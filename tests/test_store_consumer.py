"""Unit tests of the Store's consumer controls (issue 14; protocol-v2 and
spec14): receipts, nack, touch, a consume's lease, ConsumeMany, max_deliveries
and dead letters, queue settings, show's view, peek order, snapshots with the
new state, and revert of every new entry kind.

The `Driver` drives the store as the master does (decide, then apply), and
after every applied entry it checks, besides `store._check()`:
- the entry survives its wire form (`entry_from_wire(entry_to_wire(e))`);
- apply with an undo list gives the same result, and `revert` restores the
  exact state before it (`to_wire()` equal), after which applying again gives
  the same state;
- a replica that applies the same entries in order holds the same state;
- `final_queues` names exactly the queues with final deliveries.
Decides must not change the state. No I/O, no clock: `now` is an argument.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qserver.state.entries import (
    FINAL_EXPIRED,
    FINAL_MAX_DELIVERIES,
    FINAL_NONE,
    Configure,
    Confirm,
    Consume,
    ConsumeMany,
    DeadLetter,
    Nack,
    Produce,
    Touch,
    entry_from_wire,
    entry_to_wire,
)
from qserver.state.store import (
    DEFAULT_TTL_MS,
    REASON_NAMES,
    Store,
    message_view,
    receipt_text,
)
from qserver.storage import format as fmt
from qserver.wire.requests import ConsumeRequest, ProduceRequest

NOW = 1_700_000_000_000
HOUR = 3_600_000
EPOCH = 7  # the deciding master's epoch in these tests


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
        self.entries.append(entry)
        return result

    # -- the master's steps ----------------------------------------------

    def produce(self, now: int, queue: str = "q", data: str = "m", *, delay=None, ttl=None,
                retry=0) -> int:
        entry = self.decide(self.store.decide_produce,
                            ProduceRequest(queue, data, delay, ttl, retry), now)
        assert type(entry) is Produce, entry
        targets = self.apply(entry)
        return targets[0][1]

    def configure(self, queue: str = "q", **settings_: Any) -> dict:
        entry = self.decide(self.store.decide_configure, queue, settings_)
        assert type(entry) is Configure, entry
        return self.apply(entry)

    def decide_consume(self, now: int, queue: str = "q", lease_ms: int = 0, epoch: int = EPOCH):
        return self.decide(self.store.decide_consume_values, queue, now, epoch, lease_ms)

    def consume(self, now: int, queue: str = "q", lease_ms: int = 0, epoch: int = EPOCH):
        """(msg_id, data, deliveries, receipt or None), or None. A message over
        a lowered max_deliveries is moved out first, as the service does."""
        while True:
            entry = self.decide_consume(now, queue, lease_ms, epoch)
            if type(entry) is DeadLetter:
                self.apply(entry)
                continue
            if entry is None:
                return None
            assert type(entry) is Consume, entry
            msg_id, data, deliveries = self.apply(entry)
            receipt = (entry.epoch, msg_id, deliveries) if entry.retry_at_ms else None
            if receipt is not None:
                assert entry.epoch == epoch
            return msg_id, data, deliveries, receipt

    def consume_many(self, now: int, names, count: int, lease_ms: int = 0,
                     epoch: int = EPOCH) -> list:
        """Up to `count` deliveries as [(queue, msg_id, data, deliveries)],
        moving out messages over max_deliveries as they come."""
        out: list = []
        while len(out) < count:
            entry = self.decide(self.store.decide_consume_many, names, count - len(out), now,
                                epoch, lease_ms)
            if entry is None:
                break
            if type(entry) is DeadLetter:
                self.apply(entry)
                continue
            assert type(entry) is ConsumeMany, entry
            assert entry.epoch == epoch and 1 <= len(entry.items) <= count - len(out)
            out.extend(self.apply(entry))
        return out

    def confirm(self, queue: str, msg_id: int):
        entry = self.decide(self.store.decide_confirm_values, queue, msg_id)
        if entry is None or type(entry) is str:
            return entry
        assert type(entry) is Confirm
        return self.apply(entry)

    def nack(self, now: int, msg_id: int, receipt=None, ready_ms: int | None = None,
             queue: str = "q"):
        """The Nack's ready time, the DeadLetter that moved it out, or a reason."""
        out = self.decide(self.store.decide_nack, queue, msg_id, receipt,
                          now if ready_ms is None else ready_ms, now)
        if type(out) is str:
            return out
        result = self.apply(out)
        return result if type(out) is Nack else out

    def touch(self, now: int, msg_id: int, receipt=None, lease_ms: int = 0, queue: str = "q"):
        out = self.decide(self.store.decide_touch, queue, msg_id, receipt, lease_ms, now)
        if type(out) is str:
            return out
        assert type(out) is Touch
        assert self.apply(out) == out.retry_at_ms
        return out

    def expire(self, now: int, limit: int = 100) -> list:
        moves = self.decide(self.store.decide_expired, now, limit)
        for move in moves:
            assert type(move) is DeadLetter
            self.apply(move)
        return moves

    # -- reads -------------------------------------------------------------

    def msg(self, msg_id: int, queue: str = "q") -> tuple:
        return self.store.queues[queue].messages[msg_id]

    def view(self, msg_id: int, now: int, queue: str = "q") -> dict:
        return message_view(msg_id, self.msg(msg_id, queue), now)

    def ids(self, queue: str = "q") -> list:
        q = self.store.get(queue)
        return [] if q is None else sorted(q.messages)


@pytest.fixture
def d() -> Driver:
    return Driver()


# -- receipts --------------------------------------------------------------------


def test_every_delivery_gets_a_receipt_of_its_own(d):
    d.produce(NOW, retry=5)
    seen = []
    for n, t in enumerate((NOW, NOW + 5000, NOW + 10_000), start=1):
        msg_id, data, deliveries, receipt = d.consume(t)
        assert (msg_id, data, deliveries) == (1, "m", n)
        assert receipt == (EPOCH, 1, n)
        seen.append(receipt_text(*receipt))
    # a later master (a higher epoch) continues the count: still unique
    assert d.consume(NOW + 15_000, epoch=EPOCH + 1)[3] == (EPOCH + 1, 1, 4)
    seen.append(receipt_text(EPOCH + 1, 1, 4))
    assert seen == ["7.1.1", "7.1.2", "7.1.3", "8.1.4"]
    assert len(set(seen)) == len(seen)


def test_a_receipt_is_stale_once_the_message_is_redelivered(d):
    d.produce(NOW, retry=5)
    first = d.consume(NOW)[3]
    assert d.store.check_receipt("q", 1, first)
    second = d.consume(NOW + 5000)[3]
    assert not d.store.check_receipt("q", 1, first)
    assert d.store.check_receipt("q", 1, second)
    assert d.nack(NOW + 6000, 1, first) == "stale receipt"
    assert d.touch(NOW + 6000, 1, first) == "stale receipt"
    # the current receipt still works
    assert type(d.touch(NOW + 6000, 1, second)) is Touch


def test_a_receipt_is_stale_once_confirmed_and_for_unknown_messages(d):
    d.produce(NOW, retry=5)
    receipt = d.consume(NOW)[3]
    assert d.confirm("q", 1) is True
    assert not d.store.check_receipt("q", 1, receipt)
    assert d.nack(NOW, 1, receipt) == "stale receipt"
    assert d.touch(NOW, 1, receipt) == "stale receipt"
    # without a receipt, the same requests are "not in flight"
    assert d.nack(NOW, 1) == "not in flight"
    assert d.touch(NOW, 1) == "not in flight"
    # unknown message or queue: a receipt never matches
    assert d.nack(NOW, 99, (EPOCH, 99, 1)) == "stale receipt"
    assert d.nack(NOW, 1, (EPOCH, 1, 1), queue="nope") == "stale receipt"
    assert not d.store.check_receipt("nope", 1, (EPOCH, 1, 1))


def test_a_receipt_names_its_message_epoch_and_delivery_exactly(d):
    d.produce(NOW, retry=5)
    d.produce(NOW, retry=5)
    assert d.consume(NOW)[3] == (EPOCH, 1, 1)
    for wrong in ((EPOCH + 1, 1, 1), (EPOCH, 2, 1), (EPOCH, 1, 2), (EPOCH, 1, 0), (0, 0, 0)):
        assert not d.store.check_receipt("q", 1, wrong), wrong
        assert d.nack(NOW, 1, wrong) == "stale receipt"
    # message 2 was never delivered: no receipt matches it
    assert not d.store.check_receipt("q", 2, (EPOCH, 2, 0))
    assert d.nack(NOW, 2, (EPOCH, 2, 0)) == "stale receipt"
    assert d.nack(NOW, 2) == "not in flight"


def test_at_most_once_and_last_deliveries_have_no_receipt(d):
    d.produce(NOW, data="once")
    entry = d.decide_consume(NOW)
    assert entry == Consume("q", 1, 0, 0, FINAL_NONE)
    assert d.consume(NOW) == (1, "once", 1, None)
    d.produce(NOW, retry=5, ttl=5)  # the first delivery's retry reaches the ttl
    assert d.decide_consume(NOW) == Consume("q", 2, 0, 0, FINAL_NONE)
    assert d.consume(NOW) == (2, "m", 1, None)
    assert d.ids() == []


def test_a_delivery_written_before_receipts_matches_no_receipt(d):
    # A Consume without epoch (an old log): in flight, confirmable by id only.
    d.produce(NOW, retry=5)
    d.apply(Consume("q", 1, NOW + 5000))
    assert d.msg(1)[7] == 0  # epoch 0: no receipt
    assert not d.store.check_receipt("q", 1, (0, 1, 1))
    assert d.nack(NOW, 1, (0, 1, 1)) == "stale receipt"
    assert d.nack(NOW, 1) == NOW  # by id it works
    assert d.consume(NOW)[2:] == (2, (EPOCH, 1, 2))


def test_a_receipt_still_confirms_after_the_lease_ran_out_until_redelivered(d):
    d.produce(NOW, retry=5)
    receipt = d.consume(NOW)[3]
    late = NOW + 5000
    # the lease ran out: not in flight for nack and touch ...
    assert d.nack(late, 1, receipt) == "not in flight"
    assert d.touch(late, 1, receipt) == "not in flight"
    assert d.nack(late, 1) == "not in flight"
    # ... but the receipt still names the message's last delivery
    assert d.store.check_receipt("q", 1, receipt)
    d.consume(late)
    assert not d.store.check_receipt("q", 1, receipt)


# -- nack ----------------------------------------------------------------------------


def test_nack_makes_the_message_deliverable_at_ready_ms_and_counts(d):
    d.produce(NOW, retry=30)
    receipt = d.consume(NOW)[3]
    entry = d.decide(d.store.decide_nack, "q", 1, receipt, NOW + 3000, NOW + 1000)
    assert entry == Nack("q", 1, NOW + 3000)
    assert d.nack(NOW + 1000, 1, receipt, NOW + 3000) == NOW + 3000
    view = d.view(1, NOW + 1000)
    assert (view["state"], view["nacks"], view["deliveries"]) == ("delayed", 1, 1)
    assert (view["ready_at"], view["retry_at"]) == ((NOW + 3000) / 1000, 0)
    # no longer in flight: the receipt matches, but nothing can be nacked again
    assert d.nack(NOW + 1000, 1, receipt) == "not in flight"
    assert d.touch(NOW + 1000, 1, receipt) == "not in flight"
    assert d.consume(NOW + 2999) is None
    assert d.consume(NOW + 3000)[2:] == (2, (EPOCH, 1, 2))
    assert d.view(1, NOW + 3000)["nacks"] == 1
    assert d.nack(NOW + 3000, 1) == NOW + 3000
    assert d.view(1, NOW + 3000)["nacks"] == 2


def test_nack_in_the_past_is_ready_now_and_waits_its_turn(d):
    d.produce(NOW, data="A", retry=30)
    d.produce(NOW, data="B", retry=30)
    d.produce(NOW + 15, data="C", retry=30)
    assert d.consume(NOW + 10)[:2] == (1, "A")
    assert d.nack(NOW + 20, 1, ready_ms=NOW) == NOW + 20  # not before now
    # B was ready first (NOW), then C (NOW + 15), then A again (NOW + 20)
    assert [m[1] for m in (d.consume(NOW + 20), d.consume(NOW + 20), d.consume(NOW + 20))] == [
        "B", "C", "A"]


def test_nack_of_what_is_not_in_flight(d):
    d.produce(NOW, retry=30)  # 1: never delivered
    d.produce(NOW, data="once")  # 2: at-most-once
    assert d.nack(NOW, 1) == "not in flight"
    assert d.consume(NOW)[0] == 1
    assert d.consume(NOW)[:2] == (2, "once")  # deleted by its delivery
    assert d.nack(NOW, 2) == "not in flight"
    assert d.nack(NOW, 3) == "not in flight"
    assert d.nack(NOW, 1, queue="other") == "not in flight"
    assert d.nack(NOW + 30_000, 1) == "not in flight"  # its lease ran out
    virtual = Driver(virtual_queues={"v": ("a", "b")})
    assert virtual.nack(NOW, 1, queue="v") == "virtual queue only takes produce"
    assert virtual.touch(NOW, 1, queue="v") == "virtual queue only takes produce"


def test_nack_of_a_final_delivery_moves_it_out_at_once(d):
    d.configure(max_deliveries=1, dead_letter="dlq")
    d.produce(NOW, data="job", retry=30)
    entry = d.decide_consume(NOW)
    assert entry == Consume("q", 1, NOW + 30_000, EPOCH, FINAL_MAX_DELIVERIES)
    receipt = d.consume(NOW)[3]
    move = d.nack(NOW + 100, 1, receipt, NOW + 5000)
    assert move == DeadLetter("q", 1, FINAL_MAX_DELIVERIES, (("dlq", 1),), NOW + 100,
                              NOW + 100 + DEFAULT_TTL_MS)
    assert d.ids() == [] and d.ids("dlq") == [1]
    assert d.store.queues["q"].dead_lettered == 1
    assert d.view(1, NOW + 100, "dlq") == {
        "msg_id": 1, "state": "ready", "data": "job", "priority": 1024,
        "ready_at": (NOW + 100) / 1000, "ttl": (NOW + 100 + HOUR) / 1000, "retry": 30.0,
        "retry_at": 0.0, "deliveries": 0, "nacks": 0, "origin_queue": "q", "origin_msg_id": 1,
        "dead_letter_reason": "max_deliveries"}


def test_nack_at_max_deliveries_after_the_limit_was_lowered_moves_it_out(d):
    d.produce(NOW, retry=30)
    d.consume(NOW)
    d.nack(NOW, 1)
    receipt = d.consume(NOW)[3]  # delivered twice, not final: no limit then
    assert d.msg(1)[8] == FINAL_NONE
    d.configure(max_deliveries=2)
    move = d.nack(NOW + 1, 1, receipt)
    assert move == DeadLetter("q", 1, FINAL_MAX_DELIVERIES, (), NOW + 1, NOW + 1 + HOUR)
    assert d.ids() == [] and d.store.queues["q"].dead_lettered == 1


@pytest.mark.parametrize("dead_letter", ["", "dlq"])
def test_nack_at_or_past_the_ttl_moves_it_out(d, dead_letter):
    if dead_letter:
        d.configure(dead_letter=dead_letter)
    d.produce(NOW, retry=5, ttl=60)  # ttl NOW + 60 s
    d.produce(NOW, retry=5, ttl=60)
    d.consume(NOW)
    d.consume(NOW)
    # one ms before the ttl: an ordinary nack
    assert d.nack(NOW + 1000, 1, ready_ms=NOW + 59_999) == NOW + 59_999
    # at the ttl: the message leaves at once
    move = d.nack(NOW + 1000, 2, ready_ms=NOW + 60_000)
    targets = (("dlq", 1),) if dead_letter else ()
    assert move == DeadLetter("q", 2, FINAL_EXPIRED, targets, NOW + 1000, NOW + 1000 + HOUR)
    assert d.ids() == [1]
    assert d.ids("dlq") == ([1] if dead_letter else [])
    assert d.store.queues["q"].dead_lettered == 1


# -- touch ---------------------------------------------------------------------------


def test_touch_moves_the_end_of_the_lease(d):
    d.produce(NOW, retry=30)
    receipt = d.consume(NOW)[3]
    entry = d.touch(NOW + 10_000, 1, receipt, lease_ms=60_000)
    assert entry == Touch("q", 1, NOW + 70_000, FINAL_NONE)
    assert d.view(1, NOW + 10_000)["retry_at"] == (NOW + 70_000) / 1000
    assert d.consume(NOW + 30_000) is None  # the old lease end means nothing now
    assert d.consume(NOW + 69_999) is None
    # default lease: the message's retry, from now; shorter leases too
    assert d.touch(NOW + 20_000, 1, receipt).retry_at_ms == NOW + 50_000
    assert d.touch(NOW + 20_000, 1, receipt, lease_ms=1).retry_at_ms == NOW + 20_001
    assert d.store.check_receipt("q", 1, receipt)  # a touch is no new delivery
    assert d.consume(NOW + 20_001)[2:] == (2, (EPOCH, 1, 2))


def test_touch_that_reaches_the_ttl_makes_the_delivery_final(d):
    d.produce(NOW, retry=5, ttl=60)
    receipt = d.consume(NOW)[3]
    entry = d.touch(NOW + 1000, 1, receipt, lease_ms=58_999)  # NOW + 59,999: not final
    assert entry.final == FINAL_NONE
    entry = d.touch(NOW + 1000, 1, receipt, lease_ms=59_000)  # NOW + 60,000: the ttl
    assert entry == Touch("q", 1, NOW + 60_000, FINAL_EXPIRED)
    q = d.store.queues["q"]
    assert len(q.finals) == 1 and len(q.retrying) == 0
    assert d.store.next_final_ms() == NOW + 60_000
    # a final delivery keeps its reason when touched again, even below the ttl
    assert d.touch(NOW + 2000, 1, receipt, lease_ms=1000).final == FINAL_EXPIRED
    assert d.store.next_final_ms() == NOW + 3000
    assert d.expire(NOW + 2999) == []
    # without a dead-letter queue it is deleted when the lease runs out
    assert d.expire(NOW + 3000) == [DeadLetter("q", 1, FINAL_EXPIRED, (), NOW + 3000,
                                               NOW + 3000 + HOUR)]
    assert d.ids() == [] and q.dead_lettered == 1 and d.store.next_final_ms() is None


def test_touch_of_what_is_not_in_flight(d):
    d.produce(NOW, retry=30)
    assert d.touch(NOW, 1) == "not in flight"
    d.consume(NOW)
    assert d.touch(NOW + 30_000, 1) == "not in flight"  # the lease ran out
    assert d.touch(NOW, 2) == "not in flight"


# -- a consume's lease -------------------------------------------------------------


def test_lease_replaces_the_retry_for_that_delivery_only(d):
    d.produce(NOW, retry=30)
    entry = d.decide_consume(NOW, lease_ms=2000)
    assert entry == Consume("q", 1, NOW + 2000, EPOCH, FINAL_NONE)
    d.consume(NOW, lease_ms=2000)
    assert d.consume(NOW + 1999) is None
    assert d.consume(NOW + 2000)[2] == 2
    assert d.msg(1)[4] == NOW + 2000 + 30_000  # no lease: the retry again


def test_a_lease_reaching_the_ttl_is_the_last_delivery(d):
    d.produce(NOW, retry=5, ttl=60)
    # without a dead-letter queue: deleted by its delivery, as queue_server's last one
    assert d.decide_consume(NOW, lease_ms=60_000) == Consume("q", 1, 0, 0, FINAL_NONE)
    assert d.decide_consume(NOW, lease_ms=59_999) == Consume("q", 1, NOW + 59_999, EPOCH,
                                                             FINAL_NONE)
    # with one: a final delivery that goes there when its lease runs out
    d.configure(dead_letter="dlq")
    assert d.decide_consume(NOW, lease_ms=60_000) == Consume("q", 1, NOW + 60_000, EPOCH,
                                                             FINAL_EXPIRED)
    d.consume(NOW, lease_ms=60_000)
    assert d.store.final_queues == {"q"}
    assert d.expire(NOW + 60_000) == [DeadLetter("q", 1, FINAL_EXPIRED, (("dlq", 1),),
                                                 NOW + 60_000, NOW + 60_000 + HOUR)]
    assert d.view(1, NOW + 60_000, "dlq")["dead_letter_reason"] == "expired"


# -- ConsumeMany -------------------------------------------------------------------


def test_consume_many_takes_up_to_count_in_order(d):
    for i in range(5):
        d.produce(NOW, data=f"m{i}", retry=10 if i % 2 else 0)
    entry = d.decide(d.store.decide_consume_many, ["q"], 3, NOW, EPOCH, 0)
    assert entry == ConsumeMany((("q", 1, 0, 0), ("q", 2, NOW + 10_000, 0), ("q", 3, 0, 0)),
                                EPOCH)
    assert d.apply(entry) == [("q", 1, "m0", 1), ("q", 2, "m1", 1), ("q", 3, "m2", 1)]
    assert d.ids() == [2, 4, 5]
    assert d.consume_many(NOW, ["q"], 1000) == [("q", 4, "m3", 1), ("q", 5, "m4", 1)]
    assert d.decide(d.store.decide_consume_many, ["q"], 10, NOW, EPOCH, 0) is None


def test_consume_many_takes_from_the_queues_in_list_order(d):
    d.produce(NOW, "a", "a1")
    for i in range(3):
        d.produce(NOW - 1000, "b", f"b{i}")  # ready earlier than a1: order is by list
    assert d.consume_many(NOW, ["nope", "a", "b"], 3) == [
        ("a", 1, "a1", 1), ("b", 1, "b0", 1), ("b", 2, "b1", 1)]
    d.produce(NOW, "a", "a2")
    assert d.consume_many(NOW, ["b", "a"], 5) == [("b", 3, "b2", 1), ("a", 2, "a2", 1)]
    assert d.consume_many(NOW, ["a", "b", "c"], 5) == []


def test_consume_many_with_several_queues_and_no_count_is_one_message(d):
    d.produce(NOW, "b", retry=5)
    req = ConsumeRequest(("a", "b"), None, 0, 0, True)
    entry = d.decide(d.store.decide_consume, req, NOW, EPOCH)
    assert entry == ConsumeMany((("b", 1, NOW + 5000, FINAL_NONE),), EPOCH)


def test_consume_many_refuses_a_virtual_queue_in_the_list():
    d = Driver(virtual_queues={"v": ("a",)})
    d.produce(NOW, "a")
    assert d.decide(d.store.decide_consume_many, ["a", "v"], 5, NOW, EPOCH, 0) == (
        "virtual queue only takes produce")


def test_consume_many_stops_before_a_message_over_max_deliveries(d):
    d.produce(NOW, data="x", retry=5)
    d.produce(NOW, data="y", retry=5)
    d.consume(NOW)
    d.consume(NOW)  # both delivered once
    d.configure(max_deliveries=1, dead_letter="dlq")
    d.produce(NOW, data="z")
    # 1 and 2 are due again at NOW + 5000, over the lowered limit: each must
    # move first. "z" (ready at NOW) comes before them: it is delivered, and
    # the decision stops there
    entry = d.decide(d.store.decide_consume_many, ["q"], 10, NOW + 5000, EPOCH, 0)
    assert entry == ConsumeMany((("q", 3, 0, FINAL_NONE),), EPOCH)
    twin = _copy(d)
    twin.apply(entry)
    entry = twin.decide(twin.store.decide_consume_many, ["q"], 10, NOW + 5000, EPOCH, 0)
    assert entry == DeadLetter("q", 1, FINAL_MAX_DELIVERIES, (("dlq", 1),), NOW + 5000,
                               NOW + 5000 + HOUR)
    assert d.consume_many(NOW + 5000, ["q", "dlq"], 10) == [
        ("q", 3, "z", 1), ("dlq", 1, "x", 1), ("dlq", 2, "y", 1)]
    assert d.store.queues["q"].dead_lettered == 2


# A small random history: what a consume with count gives must be what the
# same number of single consumes gives, and peek's order (Queue.due) too.
steps = st.lists(st.one_of(
    st.tuples(st.just("produce"), st.sampled_from("ab"), st.integers(0, 3),
              st.sampled_from([0, 1, 5]), st.sampled_from([None, 8, 30])),
    st.tuples(st.just("consume"), st.sampled_from("ab"), st.sampled_from([0, 2000])),
    st.tuples(st.just("nack"), st.sampled_from("ab"), st.integers(1, 8), st.integers(0, 3)),
    st.tuples(st.just("touch"), st.sampled_from("ab"), st.integers(1, 8), st.integers(1, 9)),
    st.tuples(st.just("confirm"), st.sampled_from("ab"), st.integers(1, 8)),
    st.tuples(st.just("configure"), st.sampled_from("ab"), st.integers(0, 3),
              st.sampled_from(["", "a", "b", "dlq"])),
    st.tuples(st.just("advance"), st.integers(0, 6000)),
), max_size=25)


def _run(d: Driver, history) -> int:
    now = NOW
    for step in history:
        kind = step[0]
        if kind == "produce":
            _, queue, delay, retry, ttl = step
            d.produce(now, queue, f"d{len(d.entries)}", delay=delay, retry=retry, ttl=ttl)
        elif kind == "consume":
            d.consume(now, step[1], lease_ms=step[2])
        elif kind == "nack":
            d.nack(now, step[2], ready_ms=now + step[3] * 1000, queue=step[1])
        elif kind == "touch":
            d.touch(now, step[2], lease_ms=step[3] * 1000, queue=step[1])
        elif kind == "confirm":
            d.confirm(step[1], step[2])
        elif kind == "configure":
            _, queue, max_deliveries, dead_letter = step
            if dead_letter != queue:
                d.configure(queue, max_deliveries=max_deliveries, dead_letter=dead_letter)
        else:
            now += step[1]
            d.expire(now)
    return now


def _copy(d: Driver) -> Driver:
    twin = Driver(**d.kw)
    twin.store.load_wire(d.store.to_wire())
    twin.replica.load_wire(d.store.to_wire())
    twin.check()
    return twin


@settings(max_examples=150, deadline=None)
@given(history=steps, names=st.sampled_from([["a"], ["b"], ["a", "b"], ["b", "dlq", "a"]]),
       count=st.integers(1, 12), lease=st.sampled_from([0, 3000]))
def test_consume_many_delivers_what_single_consumes_would(history, names, count, lease):
    d = Driver()
    now = _run(d, history)
    many, single = _copy(d), _copy(d)
    got = many.consume_many(now, names, count, lease)
    expected = []
    while len(expected) < count:
        for name in names:
            delivered = single.consume(now, name, lease)
            if delivered is not None:
                expected.append((name, *delivered[:3]))
                break
        else:
            break
    assert got == expected
    assert many.store.to_wire() == single.store.to_wire()


@settings(max_examples=150, deadline=None)
@given(history=steps, later=st.integers(0, 40_000))
def test_peek_order_is_the_order_of_consumes(history, later):
    d = Driver()
    now = _run(d, history) + later
    for name in ("a", "b", "dlq"):
        q = d.store.get(name)
        if q is None:
            continue
        peeked = list(q.due(now))
        twin = _copy(d)
        consumed = []
        while (entry := twin.decide_consume(now, name)) is not None:
            if type(entry) is DeadLetter:  # over a lowered max_deliveries: not delivered
                consumed.append(entry.msg_id)
                twin.apply(entry)
                continue
            consumed.append(entry.msg_id)
            twin.apply(entry)
        assert peeked == consumed
        assert (peeked[0] if peeked else None) == q.next_due(now)


# -- max_deliveries and dead letters ------------------------------------------------


def test_the_last_allowed_delivery_is_final_and_its_lease_end_moves_the_message(d):
    d.configure(max_deliveries=3, dead_letter="dlq")
    d.produce(NOW - 5, "dlq", "already there")  # the dead letter's id follows
    d.produce(NOW, data="poison", retry=5)
    for n in (1, 2):
        entry = d.decide_consume(NOW + (n - 1) * 5000)
        assert entry.final == FINAL_NONE
        d.consume(NOW + (n - 1) * 5000)
    entry = d.decide_consume(NOW + 10_000)
    assert entry == Consume("q", 1, NOW + 15_000, EPOCH, FINAL_MAX_DELIVERIES)
    receipt = d.consume(NOW + 10_000)[3]
    assert receipt == (EPOCH, 1, 3)
    q = d.store.queues["q"]
    assert q.counts(NOW + 20_000) == (0, 0, 1)  # in flight until moved, even past its lease
    assert d.view(1, NOW + 20_000)["state"] == "in_flight"
    assert d.consume(NOW + 20_000) is None  # never delivered a fourth time
    assert d.store.next_final_ms() == NOW + 15_000
    assert d.expire(NOW + 14_999) == []
    moves = d.expire(NOW + 20_000)
    assert moves == [DeadLetter("q", 1, FINAL_MAX_DELIVERIES, (("dlq", 2),), NOW + 20_000,
                                NOW + 20_000 + HOUR)]
    assert d.ids() == [] and q.dead_lettered == 1 and q.max_id == 1
    moved = d.msg(2, "dlq")
    assert moved == ("poison", NOW + 20_000, NOW + 20_000 + HOUR, 5000, 0, 0, 0, 0, FINAL_NONE,
                     "q", 1, FINAL_MAX_DELIVERIES)
    assert REASON_NAMES[moved[11]] == "max_deliveries"
    # a dead letter is a message like any other (its ttl is fresh)
    assert d.consume(NOW + 20_000, "dlq")[:2] == (1, "already there")
    assert d.consume(NOW + 20_000, "dlq")[:3] == (2, "poison", 1)
    assert d.view(2, NOW + 20_000, "dlq")["origin_msg_id"] == 1
    assert d.nack(NOW + 20_000, 2, queue="dlq") == NOW + 20_000
    assert len(d.msg(2, "dlq")) == 12 and d.msg(2, "dlq")[6] == 1  # nacks count, origin kept


def test_a_final_delivery_can_still_be_confirmed(d):
    d.configure(max_deliveries=1)
    d.produce(NOW, retry=5)
    receipt = d.consume(NOW)[3]
    assert d.store.final_queues == {"q"}
    assert d.store.check_receipt("q", 1, receipt)
    assert d.confirm("q", 1) is True
    assert d.store.final_queues == set() and d.store.next_final_ms() is None
    assert d.expire(NOW + HOUR) == [] and d.store.queues["q"].dead_lettered == 0


def test_without_a_dead_letter_queue_max_deliveries_deletes(d):
    d.configure(max_deliveries=1)
    d.produce(NOW, retry=5)
    d.consume(NOW)
    assert d.expire(NOW + 5000) == [DeadLetter("q", 1, FINAL_MAX_DELIVERIES, (), NOW + 5000,
                                               NOW + 5000 + HOUR)]
    assert d.ids() == [] and d.store.queues["q"].dead_lettered == 1
    assert list(d.store.queues) == ["q"]  # no queue appeared


def test_ttl_ends_retries_into_the_dead_letter_queue(d):
    d.configure(dead_letter="dlq")
    d.produce(NOW, data="late", retry=5, ttl=12)
    assert d.consume(NOW)[3] == (EPOCH, 1, 1)
    assert d.consume(NOW + 5000)[3] == (EPOCH, 1, 2)
    # NOW + 15 s would pass the ttl: a final delivery (not deleted, as without dead_letter)
    assert d.decide_consume(NOW + 10_000) == Consume("q", 1, NOW + 15_000, EPOCH, FINAL_EXPIRED)
    assert d.consume(NOW + 10_000)[3] == (EPOCH, 1, 3)
    moves = d.expire(NOW + 15_000)
    assert moves == [DeadLetter("q", 1, FINAL_EXPIRED, (("dlq", 1),), NOW + 15_000,
                                NOW + 15_000 + HOUR)]
    assert d.view(1, NOW + 15_000, "dlq")["dead_letter_reason"] == "expired"


def test_without_a_dead_letter_queue_the_ttl_rule_is_queue_servers(d):
    d.produce(NOW, retry=5, ttl=12)
    d.consume(NOW)
    d.consume(NOW + 5000)
    assert d.decide_consume(NOW + 10_000) == Consume("q", 1, 0, 0, FINAL_NONE)
    assert d.consume(NOW + 10_000) == (1, "m", 3, None)
    assert d.ids() == [] and d.store.queues["q"].dead_lettered == 0


def test_a_never_delivered_expired_message_with_a_dead_letter_queue(d):
    d.configure(dead_letter="dlq")
    d.produce(NOW, retry=5, ttl=1)
    # still delivered once (queue_server), and the delivery is final
    assert d.decide_consume(NOW + HOUR) == Consume("q", 1, NOW + HOUR + 5000, EPOCH,
                                                   FINAL_EXPIRED)


def test_dead_letters_fan_out_to_a_virtual_dead_letter_queue():
    d = Driver(virtual_queues={"dead": ("d1", "d2")})
    d.produce(NOW, "d2", "x")
    d.configure("q", max_deliveries=1, dead_letter="dead")
    assert d.store.queues["q"].settings() == {"max_deliveries": 1, "dead_letter": "dead",
        "max_size": 1000, "dedup_window": 300, "paused": "none"}
    d.produce(NOW, data="job", retry=5)
    d.consume(NOW)
    moves = d.expire(NOW + 5000)
    assert moves == [DeadLetter("q", 1, FINAL_MAX_DELIVERIES, (("d1", 1), ("d2", 2)),
                                NOW + 5000, NOW + 5000 + HOUR)]
    assert d.msg(1, "d1")[9:] == d.msg(2, "d2")[9:] == ("q", 1, FINAL_MAX_DELIVERIES)
    assert d.store.queues["q"].dead_lettered == 1


def test_decide_expired_gives_ids_as_if_each_move_were_applied(d):
    for name in ("a", "b"):
        d.configure(name, max_deliveries=1, dead_letter="dlq")
    d.produce(NOW, "dlq", "old")
    for name in ("a", "b"):
        for i in range(3):
            d.produce(NOW, name, f"{name}{i}", retry=5)
            d.consume(NOW + i, name)
    d.produce(NOW, "a", "not yet", retry=5)
    d.consume(NOW + 10, "a")
    assert d.store.next_final_ms() == NOW + 5000
    assert d.decide(d.store.decide_expired, NOW + 5002, 4) == [
        DeadLetter("a", 1, 1, (("dlq", 2),), NOW + 5002, NOW + 5002 + HOUR),
        DeadLetter("a", 2, 1, (("dlq", 3),), NOW + 5002, NOW + 5002 + HOUR),
        DeadLetter("a", 3, 1, (("dlq", 4),), NOW + 5002, NOW + 5002 + HOUR),
        DeadLetter("b", 1, 1, (("dlq", 5),), NOW + 5002, NOW + 5002 + HOUR)]
    moves = d.expire(NOW + 5002)  # limit 100: every final lease that ran out
    assert [(m.queue, m.msg_id, m.targets) for m in moves] == [
        ("a", 1, (("dlq", 2),)), ("a", 2, (("dlq", 3),)), ("a", 3, (("dlq", 4),)),
        ("b", 1, (("dlq", 5),)), ("b", 2, (("dlq", 6),)), ("b", 3, (("dlq", 7),))]
    assert [d.msg(i, "dlq")[0] for i in range(2, 8)] == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert d.ids("a") == [4] and d.store.next_final_ms() == NOW + 5010
    assert d.decide(d.store.decide_expired, NOW + 5009, 10) == []


def test_lowering_max_deliveries_moves_out_what_is_over_it_at_its_next_consume(d):
    d.produce(NOW, data="old", retry=5)
    for t in (NOW, NOW + 5000, NOW + 10_000):
        assert d.consume(t)[:3] == (1, "old", (t - NOW) // 5000 + 1)  # never final: no limit
    d.produce(NOW + 10_000, data="young", retry=5)
    assert d.consume(NOW + 10_000)[:3] == (2, "young", 1)
    d.configure(max_deliveries=2, dead_letter="dlq")
    # both are due at NOW + 15 s; "old" is over the new limit: it moves first
    assert d.decide_consume(NOW + 15_000) == DeadLetter(
        "q", 1, FINAL_MAX_DELIVERIES, (("dlq", 1),), NOW + 15_000, NOW + 15_000 + HOUR)
    # the consume moves it and delivers the next: "young", whose second delivery is its last
    assert d.consume(NOW + 15_000)[:3] == (2, "young", 2)
    assert d.msg(2)[8] == FINAL_MAX_DELIVERIES
    assert d.ids() == [2] and d.ids("dlq") == [1]


def test_configure_creates_the_queue_and_answers_its_settings(d):
    defaults = {"max_size": 1000, "dedup_window": 300, "paused": "none"}
    assert d.configure("new", max_deliveries=5) == {"max_deliveries": 5, "dead_letter": None,
                                                    **defaults}
    assert d.store.get("new").max_id == 0 and d.ids("new") == []
    assert d.configure("new", dead_letter="dlq") == {"max_deliveries": 5, "dead_letter": "dlq",
                                                        "max_size": 1000, "dedup_window": 300,
                                                        "paused": "none"}
    assert d.configure("new", dead_letter="", max_deliveries=0) == {
        "max_deliveries": 0, "dead_letter": None, **defaults}
    # Set explicitly, so kept: they win over the node's XML defaults.
    assert d.store.get("new").extras() == {"max_deliveries": 0, "dead_letter": ""}
    assert d.store.get("dlq") is None  # naming a dead-letter queue creates nothing
    entry = d.decide(d.store.decide_configure, "q", {"max_deliveries": 2, "dead_letter": "x"})
    assert entry == Configure("q", (("dead_letter", "x"), ("max_deliveries", 2)))


def test_configure_refusals():
    d = Driver(virtual_queues={"v": ("a", "b")})
    decide = d.store.decide_configure
    assert d.decide(decide, "v", {"max_deliveries": 1}) == "virtual queue only takes produce"
    assert d.decide(decide, "a", {"dead_letter": "a"}) == (
        "bad value for dead_letter: a queue cannot be its own dead-letter queue")
    assert d.decide(decide, "a", {"dead_letter": "v"}) == (
        "bad value for dead_letter: virtual queue v includes a itself")
    assert type(d.decide(decide, "c", {"dead_letter": "v"})) is Configure
    assert d.store.queues == {}


# -- show's view ---------------------------------------------------------------------


def test_message_view_in_every_state(d):
    d.produce(NOW, data="r", retry=5, ttl=100)
    d.produce(NOW, data="dl", delay=10)
    base = {"priority": 1024, "nacks": 0}
    assert d.view(1, NOW) == dict(base, msg_id=1, state="ready", data="r", ready_at=NOW / 1000,
                                  ttl=(NOW + 100_000) / 1000, retry=5.0, retry_at=0.0,
                                  deliveries=0)
    assert d.view(2, NOW) == dict(base, msg_id=2, state="delayed", data="dl",
                                  ready_at=(NOW + 10_000) / 1000,
                                  ttl=(NOW + 10_000 + HOUR) / 1000, retry=0.0, retry_at=0.0,
                                  deliveries=0)
    assert d.view(2, NOW + 10_000)["state"] == "ready"
    d.consume(NOW)
    assert d.view(1, NOW + 4999) == dict(base, msg_id=1, state="in_flight", data="r",
                                         ready_at=NOW / 1000, ttl=(NOW + 100_000) / 1000,
                                         retry=5.0, retry_at=(NOW + 5000) / 1000, deliveries=1)
    assert d.view(1, NOW + 5000)["state"] == "ready"  # the lease ran out: deliverable
    d.nack(NOW + 1000, 1, ready_ms=NOW + 3000)
    assert d.view(1, NOW + 1000) == dict(base, msg_id=1, state="delayed", data="r",
                                         ready_at=(NOW + 3000) / 1000,
                                         ttl=(NOW + 100_000) / 1000, retry=5.0, retry_at=0.0,
                                         deliveries=1, nacks=1)
    d.configure(max_deliveries=2)
    d.consume(NOW + 3000)  # the second and last delivery: final
    assert d.view(1, NOW + HOUR)["state"] == "in_flight"  # until the master moves it


# -- snapshots ---------------------------------------------------------------------


def _rich_store() -> Driver:
    """A store with every message form: never delivered (5 fields), delivered
    and nacked (9), final (9, in `finals`), a dead letter (12), and queue
    settings and counters (extras)."""
    d = Driver(virtual_queues={"v": ("v1", "v2")})
    d.configure("q", max_deliveries=2, dead_letter="dlq")
    d.configure("settings-only", max_deliveries=9)
    d.produce(NOW, data="fresh", retry=5)
    d.produce(NOW, data="poison", retry=5)
    d.produce(NOW, data="nacked", retry=5)
    d.produce(NOW, data="delayed", delay=60)
    d.produce(NOW, "plain", "p")
    d.consume(NOW)  # 1
    d.consume(NOW)  # 2
    d.consume(NOW)  # 3
    d.nack(NOW, 3, ready_ms=NOW + 1000)
    d.consume(NOW + 5000)  # 1 again: final (max 2)
    d.consume(NOW + 5000)  # 2 again: final
    d.expire(NOW + 10_000, limit=1)  # 1 moves to dlq; 2 stays final
    d.touch(NOW + 5000, 2, lease_ms=100_000)
    assert len(d.msg(1, "dlq")) == 12 and len(d.msg(3)) == 9 and len(d.msg(4)) == 5
    assert d.store.final_queues == {"q"}
    return d


def _assert_same_behaviour(a: Store, b: Store) -> None:
    assert b.to_wire() == a.to_wire()
    b._check()
    assert b.final_queues == a.final_queues
    assert b.next_final_ms() == a.next_final_ms()
    for name, q in a.queues.items():
        assert list(b.queues[name].due(NOW + HOUR)) == list(q.due(NOW + HOUR))
        assert b.queues[name].settings() == q.settings()
        assert b.queues[name].dead_lettered == q.dead_lettered


def test_to_wire_and_load_wire_keep_every_form_and_setting():
    d = _rich_store()
    wire = d.store.to_wire()
    by_name = {item[0]: item for item in wire}
    assert by_name["q"][3] == {"max_deliveries": 2, "dead_letter": "dlq", "dead_lettered": 1}
    assert by_name["settings-only"] == ["settings-only", 0, [], {"max_deliveries": 9}]
    assert len(by_name["plain"]) == 3  # defaults: no extras
    copy = Store(queue_size=1000)
    copy.load_wire(wire)
    _assert_same_behaviour(d.store, copy)


@pytest.mark.parametrize("source", ["to_wire", "iter"])
def test_snapshot_format_round_trip_with_long_messages_and_extras(source):
    d = _rich_store()
    state = d.store.to_wire() if source == "to_wire" else fmt.store_wire_iter(d.store)
    blob = b"".join(fmt.encode_snapshot_chunks(11, 4, state))
    assert blob[4] == 3  # the version written
    trans_id, vote_id, decoded = fmt.decode_snapshot(blob)
    assert (trans_id, vote_id) == (11, 4)
    plain = Store(queue_size=1000)
    plain.load_wire(decoded)
    _assert_same_behaviour(d.store, plain)
    streamed = Store(queue_size=1000)
    loader = streamed.snapshot_loader()
    fmt.decode_snapshot([blob[i:i + 5] for i in range(0, len(blob), 5)], sink=loader)
    streamed.load_wire(loader)
    _assert_same_behaviour(d.store, streamed)


def _as_version_1(blob: bytes) -> bytes:
    """The same snapshot with version byte 1 (and the crc fixed): version 1's
    chunks have the same layout, without extras and long rows."""
    out = bytearray(blob)
    out[4] = 1
    out[-4:] = struct.pack(">I", zlib.crc32(bytes(out[:-4])))
    return bytes(out)


def test_a_version_1_snapshot_still_loads():
    # What a node wrote before issue 14: short rows, an in-flight message
    # without delivery fields.
    old = [["q", 3, [(1, "a", NOW, NOW + HOUR, 5000, NOW + 5000),
                     (3, "b", NOW, NOW + HOUR, 0, 0)]],
           ["r", 1, [(1, "c", NOW + 9000, NOW + HOUR, 0, 0)]]]
    blob = _as_version_1(b"".join(fmt.encode_snapshot_chunks(8, 2, old)))
    trans_id, vote_id, state = fmt.decode_snapshot(blob)
    assert (trans_id, vote_id) == (8, 2)
    d = Driver()
    d.store.load_wire(state)
    d.replica.load_wire(state)
    d.check()
    assert d.msg(1) == ("a", NOW, NOW + HOUR, 5000, NOW + 5000)
    assert d.store.queues["q"].settings() == {"max_deliveries": 0, "dead_letter": None,
        "max_size": 1000, "dedup_window": 300, "paused": "none"}
    # the old in-flight message: no receipt matches it; by id it can be nacked
    assert d.nack(NOW, 1, (0, 1, 1)) == "stale receipt"
    assert type(d.touch(NOW, 1)) is Touch
    assert d.nack(NOW, 1) == NOW
    assert d.msg(1)[5:] == (1, 1, 0, FINAL_NONE)  # counted as delivered once, nacked once
    # nacked to NOW: (NOW, id 1) comes before "b"'s (NOW, id 3): ready time, then id
    assert d.consume(NOW)[:3] == (1, "a", 2)
    assert d.consume(NOW)[:2] == (3, "b")


def test_a_version_1_snapshot_with_new_state_is_refused():
    d = _rich_store()
    blob = _as_version_1(b"".join(fmt.encode_snapshot_chunks(1, 1, d.store.to_wire())))
    with pytest.raises(ValueError):
        fmt.decode_snapshot(blob)
    only_extras = [["q", 0, [], {"max_deliveries": 3}]]
    blob = _as_version_1(b"".join(fmt.encode_snapshot_chunks(1, 1, only_extras)))
    with pytest.raises(ValueError):
        fmt.decode_snapshot(blob)


@pytest.mark.parametrize("extras", [{"colour": 1}, {"max_deliveries": -1},
                                    {"max_deliveries": "3"}, {"dead_letter": 5},
                                    {"dead_lettered": -1}, {"dead_lettered": True}])
def test_bad_queue_extras_in_a_snapshot_are_refused(extras):
    blob = b"".join(fmt.encode_snapshot_chunks(1, 1, [["q", 0, [], extras]]))
    state = fmt.decode_snapshot(blob)[2]
    with pytest.raises(ValueError):
        Store(queue_size=10).load_wire(state)
    with pytest.raises(ValueError):
        fmt.decode_snapshot(blob, sink=Store(queue_size=10).snapshot_loader())


# -- revert of every new entry kind ------------------------------------------------


def test_revert_of_every_new_kind_newest_first_restores_each_state():
    d = Driver(virtual_queues={"dead": ("d1", "d2")})
    d.produce(NOW, data="a", retry=5)
    d.produce(NOW, data="b", retry=5)
    d.produce(NOW, data="c", retry=5)
    store = d.store
    base = store.to_wire()
    steps = [
        Configure("q", (("dead_letter", "dead"), ("max_deliveries", 2))),
        Configure("fresh", (("max_deliveries", 1),)),  # creates a queue
        ConsumeMany((("q", 1, NOW + 5000, FINAL_NONE), ("q", 2, NOW + 5000, FINAL_NONE)), EPOCH),
        Nack("q", 1, NOW + 100),
        Touch("q", 2, NOW + 9000, FINAL_NONE),
        Consume("q", 1, NOW + 7000, EPOCH, FINAL_MAX_DELIVERIES),
        Touch("q", 1, NOW + 8000, FINAL_MAX_DELIVERIES),
        DeadLetter("q", 1, FINAL_MAX_DELIVERIES, (("d1", 1), ("d2", 1)), NOW + 8000,
                   NOW + 8000 + HOUR),  # creates d1 and d2
        ConsumeMany((("q", 3, 0, FINAL_NONE),), EPOCH),  # deletes it (at-most-once form)
        DeadLetter("q", 2, FINAL_EXPIRED, (), NOW + 9000, NOW + 9000 + HOUR),
        Confirm("d1", 1),  # a dead letter confirmed
    ]
    wires, undos, results = [], [], []
    for entry in steps:
        wires.append(store.to_wire())
        undo: list = []
        results.append(store.apply(entry, undo))
        store._check()
        undos.append(undo)
    assert store.queues["q"].dead_lettered == 2 and d.ids("q") == []
    assert d.ids("d2") == [1] and store.get("fresh") is not None
    assert results[2] == [("q", 1, "a", 1), ("q", 2, "b", 1)]
    assert results[3] == NOW + 100 and results[4] == NOW + 9000
    assert results[5] == (1, "a", 2) and results[7] == (("d1", 1), ("d2", 1))
    assert results[1] == {"max_deliveries": 1, "dead_letter": None,
        "max_size": 1000, "dedup_window": 300, "paused": "none"}
    for undo, wire in zip(reversed(undos), reversed(wires)):
        store.revert(undo)
        store._check()
        assert store.to_wire() == wire
        assert store.final_queues == {n for n, q in store.queues.items() if q.finals}
    assert store.to_wire() == base
    assert set(store.queues) == {"q"}


def test_apply_refuses_new_entries_that_do_not_fit_the_state(d):
    from qserver.errors import InvariantError

    d.produce(NOW, retry=5)
    for entry in (Nack("q", 1, NOW), Touch("q", 1, NOW + 1, FINAL_NONE),  # not in flight
                  Nack("q", 9, NOW), Touch("nope", 1, NOW + 1, FINAL_NONE),
                  DeadLetter("q", 9, FINAL_EXPIRED, (), NOW, NOW),
                  ConsumeMany((("q", 9, 0, FINAL_NONE),), EPOCH)):
        with pytest.raises(InvariantError):
            d.store.apply(entry)
        d.check()
    d.produce(NOW, "dlq")
    d.consume(NOW)
    with pytest.raises(InvariantError):  # a dead letter's id at or below max_id
        d.store.apply(DeadLetter("q", 1, FINAL_EXPIRED, (("dlq", 1),), NOW, NOW))


def test_message_view_retry_at_is_0_once_the_lease_ran_out(d):
    # spec14, show: "retry_at 0 when not in flight". A delivery whose lease
    # ran out is deliverable again ("ready"), not in flight.
    d.produce(NOW, retry=5)
    d.consume(NOW)
    view = d.view(1, NOW + 5000)
    assert (view["state"], view["retry_at"]) == ("ready", 0)
