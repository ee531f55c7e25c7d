"""Unit tests of the Store against queue_server's semantics (design.md s.1).

Every test drives the store the way the master does: `decide_*(request,
now_ms)` first, then `apply(entry)` when the decision is an entry, and calls
`store._check()` after every step. The helpers below return what a client
would learn: a reason string, None (nothing to do), or the apply result.
"""

from __future__ import annotations

import pytest

from qserver.errors import InvariantError
from qserver.state.entries import Confirm, Consume, Noop, Produce
from qserver.state.store import DEFAULT_TTL_MS, Store
from qserver.wire.requests import ConfirmRequest, ConsumeRequest, ProduceRequest

# An arbitrary wall-clock instant (ms) that is not a whole second, so that
# absolute times sent in seconds fall before "now".
NOW = 1_700_000_000_123
NOW_S = NOW // 1000
HOUR_MS = 3_600_000


class Driver:
    """A store plus every entry applied to it, driven as the master does."""

    def __init__(self, **store_kw) -> None:
        store_kw.setdefault("queue_size", 1000)
        self.store_kw = store_kw
        self.store = Store(**store_kw)
        self.entries: list = []

    def apply(self, entry):
        result = self.store.apply(entry)
        self.entries.append(entry)
        self.store._check()
        return result

    def decide_produce(self, now, queue="q", data="m", delay=None, ttl=None, retry=0):
        req = ProduceRequest(queue=queue, data=data, delay_s=delay, ttl_s=ttl, retry_s=retry)
        before = self.store.to_wire()
        out = self.store.decide_produce(req, now)
        assert self.store.to_wire() == before, "decide must not change state"
        self.store._check()
        return out

    def produce(self, now, queue="q", data="m", delay=None, ttl=None, retry=0):
        """(queue, msg_id) pairs of the new message(s), or the refusal."""
        out = self.decide_produce(now, queue, data, delay, ttl, retry)
        if type(out) is str:
            return out
        assert type(out) is Produce
        return self.apply(out)

    def produce_id(self, now, queue="q", **kw) -> int:
        targets = self.produce(now, queue, **kw)
        assert type(targets) is tuple and len(targets) == 1, targets
        assert targets[0][0] == queue
        return targets[0][1]

    def decide_consume(self, now, queue="q"):
        before = self.store.to_wire()
        out = self.store.decide_consume(ConsumeRequest((queue,), None, 0, 0, False), now, 1)
        assert self.store.to_wire() == before, "decide must not change state"
        self.store._check()
        return out

    def consume(self, now, queue="q"):
        """(msg_id, data), None when nothing is ready, or a reason."""
        out = self.decide_consume(now, queue)
        if out is None or type(out) is str:
            return out
        assert type(out) is Consume
        return self.apply(out)[:2]  # (msg_id, data, deliveries)

    def confirm(self, queue, msg_id):
        """True when a message was deleted, None for an unknown one, or a reason."""
        before = self.store.to_wire()
        out = self.store.decide_confirm(ConfirmRequest(queue=queue, msg_id=msg_id))
        assert self.store.to_wire() == before, "decide must not change state"
        self.store._check()
        if out is None or type(out) is str:
            return out
        assert type(out) is Confirm
        return self.apply(out)

    def message(self, queue, msg_id):
        return self.store.get(queue).messages[msg_id]

    def drain(self, now, queue="q") -> list:
        """Every delivery at `now`, in order."""
        got = []
        while (d := self.consume(now, queue)) is not None:
            got.append(d)
            assert len(got) < 10_000
        return got


@pytest.fixture
def d() -> Driver:
    return Driver()


# -- msg_id ----------------------------------------------------------------


def test_ids_start_at_one_and_increase_per_queue(d):
    assert d.produce_id(NOW, "a") == 1
    assert d.produce_id(NOW, "a") == 2
    assert d.produce_id(NOW, "b") == 1
    assert d.produce_id(NOW + 5, "a") == 3
    assert d.produce_id(NOW + 5, "b") == 2
    assert d.store.get("a").max_id == 3
    assert d.store.get("b").max_id == 2


def test_ids_never_reused_after_deletes(d):
    ids = [d.produce_id(NOW, data=f"m{i}") for i in range(3)]
    assert ids == [1, 2, 3]
    assert d.consume(NOW) == (1, "m0")  # retry 0: deleted
    assert d.confirm("q", 3) is True  # deleted before delivery
    assert d.consume(NOW) == (2, "m1")
    assert len(d.store.get("q")) == 0
    # The queue is empty but remembers its counter: no id comes back.
    assert d.store.get("q").max_id == 3
    assert d.produce_id(NOW + 1) == 4
    assert d.consume(NOW + 1) == (4, "m")


# -- delay and ttl -----------------------------------------------------------


def test_absolute_delay_in_seconds_becomes_ms(d):
    entry = d.decide_produce(NOW, delay=NOW_S + 30)
    assert entry.ready_ms == (NOW_S + 30) * 1000
    d.apply(entry)
    assert d.consume((NOW_S + 30) * 1000 - 1) is None
    assert d.consume((NOW_S + 30) * 1000) == (1, "m")


def test_relative_delay_below_1e9_is_seconds_from_now(d):
    entry = d.decide_produce(NOW, delay=30)
    assert entry.ready_ms == NOW + 30_000
    d.apply(entry)
    assert d.consume(NOW + 29_999) is None
    assert d.consume(NOW + 30_000) == (1, "m")


def test_relative_delay_fraction_of_a_second(d):
    assert d.decide_produce(NOW, delay=1.5).ready_ms == NOW + 1500
    assert d.decide_produce(NOW, delay=0.25, ttl=0.75).ttl_ms == NOW + 750


def test_relative_absolute_boundary_is_1e9(d):
    # Just below 1e9: relative, about 31.7 years from now.
    assert d.decide_produce(NOW, delay=999_999_999).ready_ms == NOW + 999_999_999_000
    # 1e9 itself is an absolute time (in 2001): in the past, so ready now.
    assert d.decide_produce(NOW, delay=1_000_000_000).ready_ms == NOW


def test_missing_delay_or_zero_is_now(d):
    assert d.decide_produce(NOW).ready_ms == NOW
    assert d.decide_produce(NOW, delay=0).ready_ms == NOW
    d.produce(NOW)
    assert d.consume(NOW) == (1, "m")


def test_delay_in_the_past_is_ready_now_and_keeps_fifo(d):
    d.produce_id(NOW, data="first")
    # An absolute delay long ago must not jump ahead of what is already ready.
    entry = d.decide_produce(NOW + 1000, data="second", delay=NOW_S - 100)
    assert entry.ready_ms == NOW + 1000
    d.apply(entry)
    d.produce_id(NOW + 2000, data="third", delay=NOW_S - 5000)
    assert [m for _, m in d.drain(NOW + 2000)] == ["first", "second", "third"]


def test_missing_ttl_is_ready_plus_an_hour(d):
    assert d.decide_produce(NOW).ttl_ms == NOW + HOUR_MS
    assert d.decide_produce(NOW, delay=30).ttl_ms == NOW + 30_000 + HOUR_MS
    assert d.decide_produce(NOW, delay=NOW_S + 50).ttl_ms == (NOW_S + 50) * 1000 + HOUR_MS
    assert DEFAULT_TTL_MS == HOUR_MS


def test_missing_ttl_counts_from_the_delay_as_sent_even_in_the_past(d):
    # design.md: "a missing ttl means delay + 3600". The delay the client
    # sent, not the clamped ready time: a job due two hours ago without a ttl
    # is already past its default lifetime (delivered once, no retries).
    entry = d.decide_produce(NOW, delay=NOW_S - 7200, retry=5)
    assert entry.ready_ms == NOW
    assert entry.ttl_ms == (NOW_S - 7200) * 1000 + HOUR_MS
    d.apply(entry)
    assert d.decide_consume(NOW).retry_at_ms == 0
    assert d.consume(NOW) == (1, "m")
    assert d.consume(NOW + 5000) is None


def test_ttl_absolute_and_relative(d):
    assert d.decide_produce(NOW, ttl=NOW_S + 10).ttl_ms == (NOW_S + 10) * 1000
    assert d.decide_produce(NOW, ttl=10).ttl_ms == NOW + 10_000


@pytest.mark.parametrize("delay, ttl", [
    (30, 29),  # both relative
    (NOW_S + 30, NOW_S + 29),  # both absolute
    (30, NOW_S + 29),  # mixed
    (NOW_S + 30, 29.5),  # NOW+29.5 s is before NOW_S+30 s (NOW+29.877 s)
])
def test_ttl_before_delay_is_time_error(d, delay, ttl):
    assert d.produce(NOW, delay=delay, ttl=ttl) == "time error"
    assert d.store.get("q") is None  # nothing created
    assert d.entries == []


def test_ttl_equal_to_delay_is_accepted_and_delivered_once(d):
    entry = d.decide_produce(NOW, delay=30, ttl=30, retry=5)
    assert type(entry) is Produce and entry.ttl_ms == entry.ready_ms == NOW + 30_000
    d.apply(entry)
    assert d.consume(NOW + 29_999) is None
    assert d.consume(NOW + 30_000) == (1, "m")
    assert len(d.store.get("q")) == 0  # its first delivery was its last
    assert d.consume(NOW + 10 * HOUR_MS) is None


@pytest.mark.parametrize("delay_ms", [1, 999, 1000, 59_999, 86_400_000])
def test_never_delivered_before_its_delay(d, delay_ms):
    d.produce(NOW, delay=delay_ms / 1000, retry=1)
    for t in (NOW, NOW + delay_ms // 2, NOW + delay_ms - 1):
        assert d.consume(t) is None
    assert d.consume(NOW + delay_ms) == (1, "m")


# -- delivery semantics ------------------------------------------------------


def test_retry_zero_deletes_on_consume_never_twice(d):
    d.produce(NOW, retry=0)
    entry = d.decide_consume(NOW)
    # At-most-once: no lease, no receipt (epoch 0), not a final delivery.
    assert entry == Consume(queue="q", msg_id=1, retry_at_ms=0, epoch=0, final=0)
    assert d.apply(entry) == (1, "m", 1)  # (msg_id, data, deliveries)
    assert len(d.store.get("q")) == 0
    for t in (NOW, NOW + 1000, NOW + HOUR_MS, NOW + 100 * HOUR_MS):
        assert d.consume(t) is None
    assert d.confirm("q", 1) is None  # already gone


def test_retry_comes_back_exactly_retry_seconds_after_consume(d):
    d.produce(NOW, retry=7)
    t1 = NOW + 500
    entry = d.decide_consume(t1)
    assert entry.retry_at_ms == t1 + 7000
    assert entry.epoch == 1  # the deciding master's: the receipt's first part
    assert d.apply(entry) == (1, "m", 1)
    assert d.consume(t1) is None
    assert d.consume(t1 + 6999) is None
    assert d.consume(t1 + 7000) == (1, "m")
    # And again, measured from the second consume.
    assert d.consume(t1 + 7000 + 6999) is None
    assert d.consume(t1 + 14_000) == (1, "m")


def test_fractional_retry(d):
    d.produce(NOW, retry=0.5)
    assert d.consume(NOW) == (1, "m")
    assert d.consume(NOW + 499) is None
    assert d.consume(NOW + 500) == (1, "m")


def test_fifo_between_pending_and_due_retry_by_time(d):
    d.produce(NOW, data="A", retry=5)
    assert d.consume(NOW) == (1, "A")  # due again at NOW+5000
    d.produce(NOW + 1000, data="B")  # ready NOW+1000
    d.produce(NOW + 1000, data="C", delay=5)  # ready NOW+6000
    d.produce(NOW + 1000, data="D", delay=4)  # ready NOW+5000, same time as A's retry
    got = d.drain(NOW + 7000)
    # By time; at equal times (A's retry and D) by msg_id.
    assert [m for _, m in got] == ["B", "A", "D", "C"]


def test_due_retry_goes_before_later_pending(d):
    d.produce(NOW, data="A", retry=2)
    assert d.consume(NOW) == (1, "A")
    d.produce(NOW + 2500, data="B")
    assert d.consume(NOW + 3000) == (1, "A")  # due at NOW+2000, before B's NOW+2500
    assert d.consume(NOW + 3000) == (2, "B")


def test_last_delivery_when_next_retry_reaches_ttl_deletes(d):
    d.produce(NOW, retry=5, ttl=12)  # ttl NOW+12000
    assert d.decide_consume(NOW).retry_at_ms == NOW + 5000
    assert d.consume(NOW) == (1, "m")
    assert d.decide_consume(NOW + 5000).retry_at_ms == NOW + 10_000
    assert d.consume(NOW + 5000) == (1, "m")
    last = d.decide_consume(NOW + 10_000)
    assert last.retry_at_ms == 0  # NOW+15000 would pass the ttl
    assert last.epoch == 0  # deleted by this delivery: no receipt
    assert d.apply(last) == (1, "m", 3)  # its third delivery
    assert len(d.store.get("q")) == 0
    assert d.consume(NOW + 100 * HOUR_MS) is None


def test_last_delivery_boundary_next_retry_equal_to_ttl(d):
    d.produce(NOW, retry=5, ttl=10)
    assert d.decide_consume(NOW).retry_at_ms == NOW + 5000
    d.consume(NOW)
    # NOW+5000+5000 == ttl: reaching the ttl is the last delivery.
    assert d.decide_consume(NOW + 5000).retry_at_ms == 0
    # One ms earlier the message would still come back.
    assert d.decide_consume(NOW + 4999) is None


def test_expired_never_consumed_message_is_still_delivered_once(d):
    d.produce(NOW, data="late", retry=3, ttl=10)
    d.produce(NOW, data="late0", retry=0, ttl=10)
    much_later = NOW + 10 * HOUR_MS
    assert d.consume(much_later) == (1, "late")
    assert d.consume(much_later) == (2, "late0")
    assert len(d.store.get("q")) == 0
    assert d.consume(much_later + HOUR_MS) is None


def test_expired_while_retrying_is_delivered_once_more(d):
    d.produce(NOW, retry=3, ttl=10)
    assert d.consume(NOW) == (1, "m")  # back at NOW+3000
    # Nobody asks until long after the ttl: one more (last) delivery.
    assert d.decide_consume(NOW + HOUR_MS).retry_at_ms == 0
    assert d.consume(NOW + HOUR_MS) == (1, "m")
    assert d.consume(NOW + 2 * HOUR_MS) is None


def test_default_ttl_bounds_retries(d):
    d.produce(NOW, retry=1000)
    t = NOW
    deliveries = 0
    while d.consume(t) is not None:
        deliveries += 1
        t += 1000 * 1000
    # Consumes at NOW, +1000 s, +2000 s keep it; the one at +3000 s is the
    # last, because its next retry (+4000 s) passes the default ttl (+3600 s).
    assert deliveries == 4
    assert len(d.store.get("q")) == 0


# -- confirm -------------------------------------------------------------------


def test_confirm_deletes_a_pending_message(d):
    d.produce(NOW, retry=5)
    d.produce(NOW, delay=60)
    assert d.confirm("q", 2) is True  # not yet ready, never delivered
    assert d.confirm("q", 1) is True  # ready, never delivered
    assert len(d.store.get("q")) == 0
    assert d.consume(NOW + HOUR_MS) is None


def test_confirm_deletes_a_retrying_message(d):
    d.produce(NOW, retry=5)
    assert d.consume(NOW) == (1, "m")
    entry = d.store.decide_confirm(ConfirmRequest(queue="q", msg_id=1))
    assert entry == Confirm(queue="q", msg_id=1)
    assert d.apply(entry) is True
    assert len(d.store.get("q")) == 0
    assert d.consume(NOW + 5000) is None
    assert d.consume(NOW + HOUR_MS) is None
    assert d.confirm("q", 1) is None  # a second confirm: unknown now


def test_confirm_of_unknown_id_or_queue_decides_nothing(d):
    d.produce(NOW)
    before = d.store.to_wire()
    assert d.confirm("q", 2) is None
    assert d.confirm("q", 10**12) is None
    assert d.confirm("other", 1) is None
    assert d.store.get("other") is None  # not created
    assert d.store.to_wire() == before


def test_apply_confirm_of_missing_message_is_harmless(d):
    # A Confirm entry is decided against state where the message exists, but
    # applying one that finds nothing is not a fork: it answers False.
    d.produce(NOW)
    assert d.apply(Confirm(queue="q", msg_id=9)) is False
    assert d.apply(Confirm(queue="nope", msg_id=1)) is False
    assert d.store.get("nope") is None


# -- queue_size ------------------------------------------------------------------


def test_produce_into_full_queue_is_refused_and_nothing_dropped():
    d = Driver(queue_size=2)
    d.produce(NOW, queue="jobs", data="one")
    d.produce(NOW, queue="jobs", data="two", retry=5)
    before = d.store.to_wire()
    reason = d.produce(NOW, queue="jobs", data="three")
    assert type(reason) is str and "full" in reason and "jobs" in reason
    assert d.store.to_wire() == before
    # A delivered, unconfirmed message still takes room.
    assert d.consume(NOW, "jobs") == (1, "one")
    assert d.consume(NOW, "jobs") == (2, "two")
    assert len(d.store.get("jobs")) == 1
    assert d.produce_id(NOW, "jobs", data="three") == 3
    assert type(d.produce(NOW, "jobs")) is str
    # Other queues are not affected by a full one.
    assert d.produce_id(NOW, "other") == 1
    assert d.confirm("jobs", 2) is True
    assert d.produce_id(NOW, "jobs") == 4


# -- virtual queues -------------------------------------------------------------


def test_virtual_produce_is_one_entry_in_config_order():
    d = Driver(virtual_queues={"fan": ["zeta", "alpha", "mid"]})
    d.produce(NOW, queue="alpha")  # alpha's counter is ahead
    entry = d.decide_produce(NOW, queue="fan", data="x", delay=5, ttl=100, retry=2)
    assert type(entry) is Produce
    assert entry.targets == (("zeta", 1), ("alpha", 2), ("mid", 1))
    assert (entry.ready_ms, entry.ttl_ms, entry.retry_ms) == (NOW + 5000, NOW + 100_000, 2000)
    assert d.apply(entry) == (("zeta", 1), ("alpha", 2), ("mid", 1))
    assert d.store.get("fan") is None  # no real queue under the virtual name
    for name, msg_id in entry.targets:
        msg = d.message(name, msg_id)
        assert msg[:4] == ("x", NOW + 5000, NOW + 100_000, 2000)  # data, ready, ttl, retry
    # Each copy is consumed and retried independently.
    assert d.consume(NOW + 5000, "zeta") == (1, "x")
    assert d.consume(NOW + 5000, "zeta") is None
    assert d.consume(NOW + 5000, "alpha") == (1, "m")
    assert d.consume(NOW + 5000, "alpha") == (2, "x")
    assert d.confirm("mid", 1) is True
    assert d.consume(NOW + 7000, "zeta") == (1, "x")
    assert d.consume(NOW + 7000, "mid") is None


def test_virtual_produce_is_all_or_nothing_when_one_member_is_full():
    d = Driver(queue_size=1, virtual_queues={"fan": ["a", "b", "c"]})
    d.produce(NOW, queue="b")
    before = d.store.to_wire()
    reason = d.produce(NOW, queue="fan")
    assert type(reason) is str and "full" in reason and "b" in reason.split(":")[-1]
    assert d.store.to_wire() == before
    assert d.store.get("a") is None and d.store.get("c") is None
    assert d.consume(NOW, "b") == (1, "m")
    assert d.produce(NOW, queue="fan") == (("a", 1), ("b", 2), ("c", 1))


def test_virtual_produce_time_error():
    d = Driver(virtual_queues={"fan": ["a", "b"]})
    assert d.produce(NOW, queue="fan", delay=10, ttl=5) == "time error"
    assert d.store.queues == {}


def test_consume_and_confirm_on_virtual_queue_are_refused():
    d = Driver(virtual_queues={"fan": ["a", "b"]})
    d.produce(NOW, queue="fan")
    before = d.store.to_wire()
    reason = d.consume(NOW, "fan")
    assert type(reason) is str and reason
    reason = d.confirm("fan", 1)
    assert type(reason) is str and reason
    assert d.store.to_wire() == before


# -- unknown queues --------------------------------------------------------------


def test_consume_on_unknown_queue_is_empty_and_does_not_create_it(d):
    assert d.consume(NOW, "ghost") is None
    assert d.store.get("ghost") is None
    assert d.store.queues == {}
    assert d.entries == []


def test_queue_created_by_its_first_produce_and_kept_when_empty(d):
    d.produce(NOW, "q")
    assert d.consume(NOW, "q") == (1, "m")
    assert d.store.get("q") is not None and len(d.store.get("q")) == 0
    assert d.store.message_count() == 0


# -- counts and wait_status --------------------------------------------------------


def test_counts_ready_delayed_in_flight(d):
    d.produce(NOW, data="r1")
    d.produce(NOW, data="r2", retry=10)
    d.produce(NOW, data="late", delay=60)
    q = d.store.get("q")
    assert q.counts(NOW) == (2, 1, 0)
    assert d.consume(NOW) == (1, "r1")  # deleted
    assert d.consume(NOW) == (2, "r2")  # in flight until NOW+10000
    assert q.counts(NOW) == (0, 1, 1)
    assert q.counts(NOW + 10_000) == (1, 1, 0)  # the retry is due: ready again
    assert q.counts(NOW + 60_000) == (2, 0, 0)


def test_wait_status_empty_and_not_ready(d):
    d.produce(NOW, delay=100)
    q = d.store.get("q")
    assert q.wait_status(NOW) == 0
    assert q.wait_status(NOW + 99_999) == 0
    assert q.wait_status(NOW + 100_000) == 0  # ready, waited 0 s
    assert q.wait_status(NOW + 101_999) == 1  # whole seconds, rounded down


def _model_wait_status(ready_times: list[int], now: int) -> int:
    waited = sorted(t for t in ready_times if t <= now)[:16]
    return sum(min((now - t) // 1000, 255) for t in waited)


def test_wait_status_sums_capped_seconds_of_16_oldest_ready(d):
    # 20 messages produced 1 s apart, plus some delayed ones.
    ready = []
    for i in range(20):
        t = NOW + i * 1000
        d.produce(t, data=f"m{i}")
        ready.append(t)
    for i in range(5):
        d.produce(NOW, data=f"late{i}", delay=400 + i)
        ready.append(NOW + (400 + i) * 1000)
    q = d.store.get("q")
    for now in (NOW, NOW + 5000, NOW + 19_500, NOW + 100_000, NOW + 270_000,
                NOW + 400_500, NOW + 1_000_000):
        assert q.wait_status(now) == _model_wait_status(ready, now), now
    # Spot values: at NOW+19500 the 16 oldest waited 19..4 s.
    assert q.wait_status(NOW + 19_500) == sum(range(4, 20))
    # Far later every one is capped at 255 s.
    assert q.wait_status(NOW + 1_000_000) == 16 * 255


def test_wait_status_ignores_retrying_and_deleted(d):
    d.produce(NOW, data="a", retry=5)
    d.produce(NOW, data="b")
    q = d.store.get("q")
    assert q.wait_status(NOW + 3000) == 6
    assert d.consume(NOW + 3000) == (1, "a")  # now retrying
    assert q.wait_status(NOW + 3000) == 3
    assert d.consume(NOW + 3000) == (2, "b")  # deleted
    assert q.wait_status(NOW + 3000) == 0


# -- whole-state views, replay and invariants ---------------------------------------


def _busy(d: Driver) -> None:
    d.produce(NOW, "a", data="a1", retry=5)
    d.produce(NOW, "a", data="a2", delay=30)
    d.produce(NOW, "a", data="a3", ttl=NOW_S + 100, retry=1.5)
    d.produce(NOW, "b", data="b1")
    d.produce(NOW, "b", data="b2")
    d.consume(NOW, "a")
    d.consume(NOW, "a")
    d.consume(NOW, "b")
    d.consume(NOW, "b")  # b is empty but exists, max_id 2
    d.produce(NOW + 10, "c", data="c1" * 100)
    d.confirm("c", 1)


def test_to_wire_load_wire_round_trip(d):
    _busy(d)
    wire = d.store.to_wire()
    fresh = Store(queue_size=1000)
    fresh.load_wire(wire)
    fresh._check()
    assert fresh.to_wire() == wire
    # The loaded copy behaves the same from here on.
    copy = Driver()
    copy.store = fresh
    for t in (NOW, NOW + 5000, NOW + 6500, NOW + 30_000, NOW + HOUR_MS):
        for name in ("a", "b", "c"):
            assert d.consume(t, name) == copy.consume(t, name)
        assert d.store.to_wire() == copy.store.to_wire()
    assert d.produce(NOW, "b") == copy.produce(NOW, "b") == (("b", 3),)


def test_to_wire_msgpack_round_trip(d):
    msgpack = pytest.importorskip("msgpack")
    _busy(d)
    wire = d.store.to_wire()
    fresh = Store(queue_size=1000)
    fresh.load_wire(msgpack.unpackb(msgpack.packb(wire)))
    fresh._check()
    assert fresh.to_wire() == wire


def test_load_wire_replaces_state(d):
    _busy(d)
    other = Driver()
    other.produce(NOW, "zzz")
    other.store.load_wire(d.store.to_wire())
    assert other.store.get("zzz") is None
    assert other.store.to_wire() == d.store.to_wire()


def test_replaying_the_entries_gives_the_same_state(d):
    _busy(d)
    replica = Store(queue_size=1)  # the limit is the master's decision, not apply's
    for entry in d.entries:
        replica.apply(entry)
        replica._check()
    assert replica.to_wire() == d.store.to_wire()


def test_noop_changes_nothing(d):
    _busy(d)
    before = d.store.to_wire()
    assert d.apply(Noop()) is None
    assert d.store.to_wire() == before


def test_apply_consume_of_missing_message_raises(d):
    d.produce(NOW)
    with pytest.raises(InvariantError):
        d.store.apply(Consume(queue="q", msg_id=2, retry_at_ms=0))
    with pytest.raises(InvariantError):
        d.store.apply(Consume(queue="nope", msg_id=1, retry_at_ms=0))
    d.consume(NOW)
    with pytest.raises(InvariantError):  # consumed (deleted) already
        d.store.apply(Consume(queue="q", msg_id=1, retry_at_ms=NOW + 5))


def test_apply_produce_at_or_below_max_id_raises(d):
    d.produce(NOW)
    d.produce(NOW)
    for msg_id in (0, 1, 2):
        with pytest.raises(InvariantError):
            d.store.apply(Produce(targets=(("q", msg_id),), data="x", ready_ms=NOW,
                                  ttl_ms=NOW + 1, retry_ms=0))
    d.store._check()
    # The next id is fine, and a gap (ids are the master's choice) too.
    d.apply(Produce(targets=(("q", 5),), data="x", ready_ms=NOW, ttl_ms=NOW + 1, retry_ms=0))
    assert d.store.get("q").max_id == 5
    assert d.produce_id(NOW) == 6


def test_apply_unknown_entry_type_raises(d):
    with pytest.raises(InvariantError):
        d.store.apply("not an entry")


def test_check_detects_a_broken_index(d):
    d.produce(NOW)
    d.produce(NOW, retry=4)
    d.consume(NOW)
    d.consume(NOW)
    q = d.store.get("q")
    q.retrying.clear()  # lose the retrying message from its index
    with pytest.raises(InvariantError):
        d.store._check()


# -- queue_server's client scenario ---------------------------------------------------


def test_queue_server_client_scenario(d):
    """produce(retry 2 s, ttl 10 s); consume gets it; consume at once gets
    nothing; consume after the retry gets it again; confirm; nothing after."""
    now_s = NOW_S
    now = now_s * 1000
    # As queue_server's PHP client sends it: delay=time(), ttl=time()+10.
    assert d.produce(now, queue="test_queue", data='{"title":"test_queue"}',
                     delay=now_s, ttl=now_s + 10, retry=2) == (("test_queue", 1),)
    assert d.consume(now, "test_queue") == (1, '{"title":"test_queue"}')
    assert d.consume(now, "test_queue") is None
    assert d.consume(now + 1999, "test_queue") is None
    assert d.consume(now + 2000, "test_queue") == (1, '{"title":"test_queue"}')
    assert d.confirm("test_queue", 1) is True
    for t in (now + 2000, now + 4000, now + 10_000, now + 20_000, now + 100 * HOUR_MS):
        assert d.consume(t, "test_queue") is None
    assert d.confirm("test_queue", 1) is None
    assert len(d.store.get("test_queue")) == 0


# -- undo and revert (the master's uncommitted tail) -------------------------------------


def test_revert_takes_back_each_kind_of_entry_newest_first(d):
    d.produce(NOW, "a", data="a1", retry=5)
    d.produce(NOW, "a", data="a2")
    d.produce(NOW, "a", data="a3", retry=5)
    d.consume(NOW, "a")  # a1 retrying
    store = d.store
    steps = [
        d.decide_produce(NOW, "new", data="n1"),  # creates a queue
        d.decide_produce(NOW, "a", data="a4"),  # advances max_id
        Consume(queue="a", msg_id=1, retry_at_ms=0),  # a retrying message, last delivery
        Consume(queue="a", msg_id=2, retry_at_ms=0),  # a pending one, deleted
        Consume(queue="a", msg_id=3, retry_at_ms=NOW + 5000),  # pending -> retrying
        Confirm(queue="a", msg_id=3),  # retrying, confirmed
        Confirm(queue="new", msg_id=1),  # pending, confirmed
        Confirm(queue="new", msg_id=1),  # nothing left: no-op
        Noop(),
    ]
    wires, undos = [], []
    for entry in steps:
        wires.append(store.to_wire())
        undo = []
        store.apply(entry, undo)
        store._check()
        undos.append(undo)
    assert [m for m in store.get("a").messages] == [4]
    for undo, wire in zip(reversed(undos), reversed(wires)):
        store.revert(undo)
        store._check()
        assert store.to_wire() == wire
    assert store.get("new") is None
    assert store.get("a").max_id == 3
    # The state behaves as if the reverted entries never were.
    assert d.produce_id(NOW, "a") == 4
    assert d.produce_id(NOW, "new") == 1
    assert d.consume(NOW, "a") == (2, "a2")


def test_apply_with_undo_gives_the_same_result_and_state(d):
    plain = Driver()
    for drv in (d, plain):
        drv.produce(NOW, "q", retry=3)
    entry = d.decide_consume(NOW)
    assert d.store.apply(entry, []) == plain.store.apply(entry) == (1, "m", 1)
    assert d.store.to_wire() == plain.store.to_wire()


# -- the FIFO index (never-delivered messages in time order, no keys) ---------------------


def _where(q, msg_id) -> str:
    """Which index holds a message: 'fifo', 'pending' or 'retrying'."""
    found = [name for name, ids in (
        ("fifo", list(q.fifo)),
        ("pending", [k & ((1 << 64) - 1) for k in q.pending]),
        ("retrying", [k & ((1 << 64) - 1) for k in q.retrying])) if msg_id in ids]
    assert len(found) == 1, (msg_id, found)
    return found[0]


def test_in_order_produces_go_to_the_fifo_without_keys(d):
    ids = [d.produce_id(NOW + i // 3, data=f"m{i}") for i in range(10)]
    q = d.store.get("q")
    assert list(q.fifo) == ids
    assert len(q.pending) == 0
    # The FIFO holds the dict's own key objects, not copies (ids above 256,
    # which CPython does not cache).
    big = [10**9 + i for i in range(3)]
    for msg_id in big:
        d.apply(Produce(targets=(("big", msg_id),), data="x", ready_ms=NOW, ttl_ms=NOW + 1,
                        retry_ms=0))
    keys = {id(k) for k in d.store.get("big").messages}
    assert list(d.store.get("big").fifo) == big
    assert {id(i) for i in d.store.get("big").fifo} == keys
    assert [m for _, m in d.drain(NOW + 5)] == [f"m{i}" for i in range(10)]
    assert len(q.fifo) == 0


def test_out_of_order_produces_go_to_pending_and_all_come_out_by_time(d):
    d.produce_id(NOW, data="a")  # FIFO
    d.produce_id(NOW, data="late60", delay=60)  # later than the tail: FIFO
    d.produce_id(NOW, data="late30", delay=30)  # earlier than the tail: pending
    d.produce_id(NOW + 1, data="b")  # in time order, but before the tail: pending
    d.produce_id(NOW + 2, data="c")
    q = d.store.get("q")
    assert list(q.fifo) == [1, 2]
    assert [_where(q, i) for i in (3, 4, 5)] == ["pending"] * 3
    assert [m for _, m in d.drain(NOW + 10)] == ["a", "b", "c"]
    assert d.consume(NOW + 29_999) is None
    # Once the clock passes the FIFO's tail, in-order produces join it again.
    d.produce_id(NOW + 60_000, data="d")
    assert _where(q, 6) == "fifo"
    assert [m for _, m in d.drain(NOW + 60_000)] == ["late30", "late60", "d"]


def test_fifo_and_pending_heads_interleave_with_retries_by_time(d):
    d.produce_id(NOW, data="r", retry=3)  # FIFO; retrying after its delivery
    assert d.consume(NOW) == (1, "r")
    d.produce_id(NOW, data="x", delay=10)  # FIFO tail at NOW+10000
    d.produce_id(NOW + 1, data="y")  # pending: before the tail
    d.produce_id(NOW + 1, data="z", delay=2)  # pending, NOW+2001
    q = d.store.get("q")
    assert [_where(q, i) for i in (1, 2, 3, 4)] == ["retrying", "fifo", "pending", "pending"]
    got = [(t, d.consume(t)) for t in (NOW + 1, NOW + 2001, NOW + 3000, NOW + 9999, NOW + 10_000)]
    # r is due again at NOW+6000 and NOW+9000, each time before x.
    assert got == [(NOW + 1, (3, "y")), (NOW + 2001, (4, "z")), (NOW + 3000, (1, "r")),
                   (NOW + 9999, (1, "r")), (NOW + 10_000, (2, "x"))]


def test_confirm_of_fifo_messages_at_head_middle_and_tail(d):
    ids = [d.produce_id(NOW, data=f"m{i}") for i in range(6)]
    q = d.store.get("q")
    assert d.confirm("q", ids[3]) is True  # middle
    assert d.confirm("q", ids[0]) is True  # head
    assert d.confirm("q", ids[5]) is True  # tail
    assert list(q.fifo) == [ids[1], ids[2], ids[4]]
    # The tail's ready time is tracked again, so in-order produces still join.
    assert d.produce_id(NOW) == 7
    assert list(q.fifo) == [2, 3, 5, 7]
    assert [m for _, m in d.drain(NOW)] == ["m1", "m2", "m4", "m"]


def test_confirm_of_a_pending_message_next_to_the_fifo(d):
    d.produce_id(NOW, data="a", delay=5)
    d.produce_id(NOW, data="b")  # pending
    d.produce_id(NOW, data="c")  # pending
    q = d.store.get("q")
    assert d.confirm("q", 2) is True
    assert list(q.fifo) == [1] and len(q.pending) == 1
    assert [m for _, m in d.drain(NOW + 5000)] == ["c", "a"]


def _apply_all(store, entries):
    wires, undos = [], []
    for entry in entries:
        wires.append(store.to_wire())
        undo = []
        store.apply(entry, undo)
        store._check()
        undos.append(undo)
    return wires, undos


def _revert_all(store, wires, undos):
    for undo, wire in zip(reversed(undos), reversed(wires)):
        store.revert(undo)
        store._check()
        assert store.to_wire() == wire


def test_revert_of_produce_consume_confirm_around_the_fifo(d):
    for i in range(4):
        d.produce_id(NOW, data=f"m{i}", retry=5)
    d.produce_id(NOW, data="late", delay=60)  # FIFO tail
    d.produce_id(NOW, data="p")  # pending
    store = d.store
    q = store.get("q")
    ready_before = q.fifo_ready
    steps = [
        d.decide_produce(NOW + 1, data="n7"),  # pending: before the tail
        d.decide_consume(NOW),  # FIFO head, to retrying
        Consume(queue="q", msg_id=2, retry_at_ms=0),  # the next FIFO head, deleted
        Confirm(queue="q", msg_id=4),  # FIFO middle
        Confirm(queue="q", msg_id=5),  # FIFO tail
        Confirm(queue="q", msg_id=6),  # pending
        Confirm(queue="q", msg_id=1),  # retrying
    ]
    wires, undos = _apply_all(store, steps)
    assert list(q.fifo) == [3] and len(q.pending) == 1  # only n7 left there
    _revert_all(store, wires, undos)
    assert q.fifo_ready >= ready_before
    # Everything is back and comes out in the original order.
    assert [m for _, m in d.drain(NOW + 60_000)] == ["m0", "m1", "m2", "m3", "p", "late"]


def test_revert_of_in_order_produces_and_consumes_keeps_the_fifo(d):
    d.produce_id(NOW, data="a")
    store = d.store
    q = store.get("q")
    steps = [d.decide_produce(NOW, data="b")]
    wires, undos = _apply_all(store, steps)
    steps2 = [d.decide_consume(NOW)]
    w2, u2 = _apply_all(store, steps2)
    _revert_all(store, w2, u2)  # the head comes back at the head
    assert list(q.fifo) == [1, 2] and len(q.pending) == 0
    _revert_all(store, wires, undos)  # the tail is popped
    assert list(q.fifo) == [1] and q.max_id == 1
    assert d.produce_id(NOW, data="c") == 2
    assert list(q.fifo) == [1, 2] and len(q.pending) == 0
    # Reverting the produce that created the queue removes it.
    w3, u3 = _apply_all(store, [d.decide_produce(NOW, "new")])
    _revert_all(store, w3, u3)
    assert store.get("new") is None


def test_revert_restores_into_an_emptied_fifo_and_into_pending(d):
    for i in range(3):
        d.produce_id(NOW, data=f"m{i}")
    store = d.store
    q = store.get("q")
    steps = [Confirm(queue="q", msg_id=2), d.decide_consume(NOW), Consume(queue="q", msg_id=3,
                                                                        retry_at_ms=0)]
    wires, undos = _apply_all(store, steps)
    assert len(q.fifo) == 0
    _revert_all(store, wires, undos)
    # 3 back into the empty FIFO, 1 at its head; 2 (the old middle) may be
    # in either index, but the order of delivery is the original one.
    assert [m for _, m in d.drain(NOW)] == ["m0", "m1", "m2"]


def test_counts_and_wait_status_with_fifo_and_pending_both_populated(d):
    ready = []
    for i in range(10):  # FIFO, 1 s apart
        d.produce(NOW + i * 1000, data=f"f{i}")
        ready.append(NOW + i * 1000)
    d.produce(NOW + 9000, data="tail", delay=100)  # FIFO tail at NOW+109000
    ready.append(NOW + 109_000)
    for i in range(10):  # pending: before the tail; interleaved in time with the FIFO
        d.produce(NOW + 9000 + i * 500, data=f"p{i}", delay=i % 3)
        ready.append(NOW + 9000 + i * 500 + (i % 3) * 1000)
    q = d.store.get("q")
    assert len(q.fifo) == 11 and len(q.pending) == 10
    for now in (NOW - 1, NOW, NOW + 4500, NOW + 9000, NOW + 11_000, NOW + 14_000,
                NOW + 108_999, NOW + 109_000, NOW + 400_000):
        n_ready = sum(1 for t in ready if t <= now)
        assert q.counts(now) == (n_ready, len(ready) - n_ready, 0), now
        assert q.wait_status(now) == _model_wait_status(ready, now), now
    # With a retrying message too.
    assert d.consume(NOW + 20_000) == (1, "f0")  # retry 0: deleted
    ready.remove(NOW)
    d.produce(NOW + 20_000, data="r", retry=10)  # pending (before the tail)
    assert _where(q, 22) == "pending"
    ready.append(NOW + 20_000)
    assert d.consume(NOW + 20_000) == (2, "f1")
    ready.remove(NOW + 1000)
    assert q.counts(NOW + 20_000) == (len(ready) - 1, 1, 0)  # all but the tail
    assert q.wait_status(NOW + 20_000) == _model_wait_status(ready, NOW + 20_000)
    assert [m for _, m in d.drain(NOW + 20_000)][-1] == "r"  # in flight until NOW+30000
    assert q.counts(NOW + 20_000) == (0, 1, 1)
    assert q.counts(NOW + 30_000) == (1, 1, 0)
    assert q.wait_status(NOW + 30_000) == 0


def test_snapshot_load_builds_the_fifo(d):
    for i in range(5):
        d.produce(NOW + i, data=f"f{i}")
    d.produce(NOW + 5, data="late", delay=30)  # FIFO tail
    d.produce(NOW + 6, data="p")  # pending
    d.produce(NOW + 7, data="r", retry=5)  # pending
    assert d.consume(NOW + 10) == (1, "f0")
    d.confirm("q", 3)  # a hole in the FIFO
    wire = d.store.to_wire()
    fresh = Store(queue_size=1000)
    fresh.load_wire(wire)
    fresh._check()
    assert fresh.to_wire() == wire
    q = fresh.get("q")
    assert list(q.fifo) == [2, 4, 5, 6]
    assert sorted(k & ((1 << 64) - 1) for k in q.pending) == [7, 8]
    # Through a snapshot loader fed in chunks, as storage decodes one.
    loader = fresh.snapshot_loader()
    for name, max_id, msgs in wire:
        loader.queue(name, max_id)
        for start in range(0, len(msgs), 2):
            loader.messages(msgs[start:start + 2])
    other = Store(queue_size=1000)
    other.load_wire(loader)
    other._check()
    assert list(other.get("q").fifo) == [2, 4, 5, 6]
    assert other.to_wire() == wire
    copy = Driver()
    copy.store = other
    for t in (NOW + 10, NOW + 30_005, NOW + HOUR_MS):
        assert d.drain(t) == copy.drain(t)


def test_check_detects_a_broken_fifo(d):
    for i in range(3):
        d.produce(NOW + i)
    q = d.store.get("q")
    q.fifo.rotate(1)  # out of order
    with pytest.raises(InvariantError):
        d.store._check()
    q.fifo.rotate(-1)
    d.store._check()
    q.pending.add(NOW << 64 | 1)  # in both indexes
    q.fifo.pop()  # (and the sizes still add up)
    with pytest.raises(InvariantError):
        d.store._check()
