"""The Store against a plain model, under random produce/consume/confirm/time.

The model is deliberately naive: one dict per queue, linear scans, the rules
of design.md section 1 written out directly. After every rule the store must
pass `_check()`, match the model, and a fresh Store fed every entry applied
so far must reach the same `to_wire()` (replay gives the same state).

Every entry is applied with an undo list, as the master does before the
entry commits; a `revert` rule takes back the newest few entries, newest
first (a deposed master rolling back its uncommitted tail), and the store
must be exactly as it was before them.
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from qserver.state.entries import Confirm, Consume, Produce
from qserver.state.store import RETRY_AT_MS, Store
from qserver.wire.requests import ConfirmRequest, ConsumeRequest, ProduceRequest

QUEUE_SIZE = 5
REAL = ("alpha", "beta", "gamma")
VIRTUAL = {"fan": ("beta", "alpha")}  # deliberately not in sorted order
UNKNOWN = "ghost"  # never produced into
HOUR_MS = 3_600_000
START_MS = 1_700_000_000_000


def to_ms(value_s, now_ms: int) -> int:
    """Client seconds to absolute ms: below 1e9 is relative to now."""
    if value_s < 1_000_000_000:
        return now_ms + round(value_s * 1000)
    return round(value_s * 1000)


class ModelMessage:
    def __init__(self, data, ready, ttl, retry):
        self.data = data
        self.ready = ready
        self.ttl = ttl
        self.retry = retry
        self.retry_at = None  # None: never delivered (pending)

    def due(self) -> int:
        return self.ready if self.retry_at is None else self.retry_at


class Model:
    def __init__(self):
        self.queues: dict[str, dict[int, ModelMessage]] = {}
        self.max_id: dict[str, int] = {}

    def produce(self, queue, data, delay, ttl, retry, now):
        ready = now if delay is None else to_ms(delay, now)
        ttl_ms = ready + HOUR_MS if ttl is None else to_ms(ttl, now)
        if ttl_ms < ready:
            return "time error"
        ready = max(ready, now)
        names = VIRTUAL.get(queue, (queue,))
        full = [n for n in names if len(self.queues.get(n, {})) >= QUEUE_SIZE]
        if full:
            return ("full", full[0])
        targets = []
        for name in names:
            msg_id = self.max_id.get(name, 0) + 1
            self.max_id[name] = msg_id
            self.queues.setdefault(name, {})[msg_id] = ModelMessage(
                data, ready, ttl_ms, round(retry * 1000))
            targets.append((name, msg_id))
        return tuple(targets)

    def consume(self, queue, now):
        """(msg_id, data, retry_at or 0), None, or 'virtual'."""
        if queue in VIRTUAL:
            return "virtual"
        msgs = self.queues.get(queue, {})
        due = [(m.due(), i) for i, m in msgs.items() if m.due() <= now]
        if not due:
            return None
        _, msg_id = min(due)
        m = msgs[msg_id]
        if m.retry > 0 and now + m.retry < m.ttl:
            m.retry_at = now + m.retry
            return msg_id, m.data, m.retry_at
        del msgs[msg_id]
        return msg_id, m.data, 0

    def confirm(self, queue, msg_id):
        if queue in VIRTUAL:
            return "virtual"
        msgs = self.queues.get(queue, {})
        if msg_id not in msgs:
            return None
        del msgs[msg_id]
        return True

    def wire(self):
        out = []
        for name in sorted(self.queues):
            msgs = [[i, m.data, m.ready, m.ttl, m.retry, m.retry_at or 0]
                    for i, m in sorted(self.queues[name].items())]
            out.append([name, self.max_id[name], msgs])
        return out

    def counts(self, queue, now):
        msgs = self.queues[queue].values()
        ready = sum(1 for m in msgs if m.due() <= now)
        delayed = sum(1 for m in msgs if m.retry_at is None and m.ready > now)
        in_flight = sum(1 for m in msgs if m.retry_at is not None and m.retry_at > now)
        return ready, delayed, in_flight

    def wait_status(self, queue, now):
        waiting = sorted((m.ready, i) for i, m in self.queues[queue].items()
                         if m.retry_at is None and m.ready <= now)[:16]
        return sum(min((now - t) // 1000, 255) for t, _ in waiting)


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
ttl_spec = st.one_of(st.none(), time_spec(120))
# Short retries, so that redeliveries happen within a run of steps.
retry_spec = st.one_of(st.just(0), st.integers(1, 4), st.sampled_from([0.5, 1.25, 2.75]))


class StoreMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.store = Store(queue_size=QUEUE_SIZE, virtual_queues=VIRTUAL)
        self.model = Model()
        self.entries = []  # what a replica's log holds: applied and not reverted
        self.history = []  # per entry in `entries`: (undo ops, what to restore on revert)
        self.now = START_MS + 123
        self.counter = 0
        self.gone: set = set()  # (queue, id) deleted by confirm or by its last delivery

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
        return copy.deepcopy(self.model), set(self.gone), self.store.to_wire()

    def _apply(self, entry, snapshot):
        undo = []
        result = self.store.apply(entry, undo)
        self.entries.append(entry)
        self.history.append((undo, snapshot))
        return result

    @rule(queue=st.sampled_from(REAL + tuple(VIRTUAL)), delay=delay_spec, ttl=ttl_spec,
          retry=retry_spec)
    def produce(self, queue, delay, ttl, retry):
        self.counter += 1
        data = f"m{self.counter}"
        delay_s, ttl_s = self._resolve(delay), self._resolve(ttl)
        req = ProduceRequest(queue=queue, data=data, delay_s=delay_s, ttl_s=ttl_s, retry_s=retry)
        snapshot = self._snapshot()
        before = self.store.to_wire()
        out = self.store.decide_produce(req, self.now)
        assert self.store.to_wire() == before
        expected = self.model.produce(queue, data, delay_s, ttl_s, retry, self.now)
        if expected == "time error":
            event("produce: time error")
            assert out == "time error"
        elif type(expected[0]) is str and expected[0] == "full":
            event("produce: queue full")
            assert type(out) is str and "full" in out and expected[1] in out, (out, expected)
        else:
            event(f"produce: into {len(expected)} queue(s)")
            assert type(out) is Produce, out
            assert out.targets == expected
            assert self._apply(out, snapshot) == expected

    # Real queues weighted up: a redelivery needs two consumes of one queue.
    @rule(queue=st.sampled_from(REAL * 3 + tuple(VIRTUAL) + (UNKNOWN,)), times=st.integers(1, 4))
    def consume(self, queue, times):
        for _ in range(times):
            self._consume_one(queue)

    def _consume_one(self, queue):
        snapshot = self._snapshot()
        before = self.store.to_wire()
        out = self.store.decide_consume(ConsumeRequest((queue,), None, 0, 0, False), self.now, 1)
        assert self.store.to_wire() == before
        expected = self.model.consume(queue, self.now)
        if expected is None:
            event("consume: nothing ready")
            assert out is None
        elif expected == "virtual":
            assert type(out) is str and out
        else:
            msg_id, data, retry_at = expected
            redelivery = self.store.get(queue).messages[msg_id][RETRY_AT_MS] != 0
            event(f"consume: {'redelivery' if redelivery else 'first delivery'}, "
                  f"{'retry again' if retry_at else 'deleted'}")
            assert out == Consume(queue=queue, msg_id=msg_id, retry_at_ms=retry_at)
            assert self._apply(out, snapshot) == (msg_id, data)
            key = (queue, msg_id)
            # Covers retry=0 (deleted by its one delivery) and confirmed messages.
            assert key not in self.gone, "deleted message delivered again"
            if retry_at == 0:
                self.gone.add(key)
            msg = self.store.get(queue)
            if retry_at == 0:
                assert msg_id not in msg.messages
        if queue == UNKNOWN:
            assert self.store.get(UNKNOWN) is None

    @rule(queue=st.sampled_from(REAL + tuple(VIRTUAL) + (UNKNOWN,)), offset=st.integers(-2, 2),
          pick=st.integers(0, 10**6))
    def confirm(self, queue, offset, pick):
        # An id near the queue's live ids (known) or around/after max_id (unknown).
        live = sorted(self.model.queues.get(queue, {}))
        if live and offset == 0:
            msg_id = live[pick % len(live)]
        else:
            msg_id = max(1, self.model.max_id.get(queue, 0) + offset)
        snapshot = self._snapshot()
        before = self.store.to_wire()
        out = self.store.decide_confirm(ConfirmRequest(queue=queue, msg_id=msg_id))
        assert self.store.to_wire() == before
        expected = self.model.confirm(queue, msg_id)
        if expected is None:
            event("confirm: unknown id")
            assert out is None
        elif expected == "virtual":
            assert type(out) is str and out
        else:
            event("confirm: deleted")
            assert out == Confirm(queue=queue, msg_id=msg_id)
            assert self._apply(out, snapshot) is True
            self.gone.add((queue, msg_id))

    # Mostly steps of whole 250 ms, which land exactly on retry deadlines
    # (retries are multiples of 250 ms); some odd steps; rarely a jump of an
    # hour (past the default ttl), which would otherwise expire everything.
    @rule(ms=st.tuples(st.integers(0, 19), st.integers(0, 40), st.integers(0, 20_000)).map(
        lambda t: HOUR_MS if t[0] == 0 else t[1] * 250 if t[0] < 14 else t[2]))
    def advance(self, ms):
        self.now += ms

    # Rarer than the other rules (count 0 is a no-op), so that runs still
    # build up state long enough for redeliveries.
    @rule(count=st.integers(-3, 3))
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

    @invariant()
    def store_is_sound_and_matches_model(self):
        self.store._check()
        wire = self.store.to_wire()
        assert wire == self.model.wire()
        for name in self.model.queues:
            q = self.store.get(name)
            assert q.counts(self.now) == self.model.counts(name, self.now)
            assert q.wait_status(self.now) == self.model.wait_status(name, self.now)
        for name in tuple(VIRTUAL) + (UNKNOWN,):
            assert self.store.get(name) is None

    @invariant()
    def replay_gives_the_same_state(self):
        replica = Store(queue_size=QUEUE_SIZE, virtual_queues=VIRTUAL)
        for entry in self.entries:
            replica.apply(entry)
        replica._check()
        wire = self.store.to_wire()
        assert replica.to_wire() == wire
        loaded = Store(queue_size=QUEUE_SIZE, virtual_queues=VIRTUAL)
        loaded.load_wire(wire)
        loaded._check()
        assert loaded.to_wire() == wire


StoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase
