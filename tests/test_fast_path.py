"""The single-node fast path (Service.answer_now) must answer exactly as the
general path (Service.handle_general) does, and leave the same store and
log: two services fed the same requests, one through each path. The same
holds for a replicating master's produce path (Service.propose_now), whose
answers come once the write commits."""

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from qserver.config import Config
from qserver.engines import LeaderInfo, LocalEngine
from qserver.service import Service
from qserver.state.log import Log
from qserver.state.store import Store
from test_node_shutdown import HeldEngine

NOW = 1_700_000_000_000

# Values of the shapes both paths see: ints in and out of range, floats,
# strings, bools, None, absent.
_times = st.one_of(st.none(), st.integers(-5, 2_000_000_000), st.floats(0, 100),
                   st.booleans(), st.just("10"))
_request = st.fixed_dictionaries(
    {"action": st.sampled_from([1, 1, 1, 2, 2, 3, 3, 3, 4, 7, True, "1"])},
    optional={"queue": st.sampled_from(["a", "b", "v", "", 5, "x" * 300]),
              "data": st.one_of(st.text(max_size=5), st.integers()),
              "delay": _times, "ttl": _times, "retry": _times,
              "msg_id": st.one_of(st.integers(-1, 12), st.just("3"), st.booleans()),
              # both services' receipts have epoch 1: some of these match
              "receipt": st.sampled_from(["1.1.1", "1.2.1", "1.1.2", "2.1.1", "1.1", "",
                                          "x", "1.1.1.1", 7, None, "9" * 70]),
              "count": st.sampled_from([1, 2, 0, "2"]),
              "lease": st.sampled_from([1, 0.5, 0, -1]),
              "seq": st.integers()})


def _service() -> Service:
    config = Config(queue_size=4, virtual_queues={"v": ("a", "b")})
    store = Store(queue_size=config.queue_size, virtual_queues=config.virtual_queues)
    log = Log()
    engine = LocalEngine(store=store, log=log, me=LeaderInfo(node_id=1, host="h", port=1),
                         log_size=1000)
    return Service(config=config, store=store, engine=engine)


def _same_answers(fast: list, general: list, request: dict) -> None:
    """The same answers, their fields in the same order."""
    assert fast == general, request
    assert [list(r.items()) for r in fast] == [list(r.items()) for r in general]


def _same_state(fast: Service, general: Service) -> None:
    """The same store and log, and a consistent store."""
    assert fast.store.to_wire() == general.store.to_wire()
    assert list(fast.engine.log.records) == list(general.engine.log.records)
    fast.store._check()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_request, st.integers(0, 5000)), max_size=40))
def test_fast_path_matches_general_path(steps):
    fast, general = _service(), _service()
    now = NOW
    for request, advance in steps:
        now += advance
        got_fast, got_general = [], []
        fast.handle(copy.deepcopy(request), now, got_fast.append)
        general.handle_general(copy.deepcopy(request), now, got_general.append)
        _same_answers(got_fast, got_general, request)
    _same_state(fast, general)


def test_fast_path_is_taken_for_the_usual_shape():
    """Guards the test above against comparing the general path with itself."""
    s = _service()
    assert s.answer_now({"action": 1, "queue": "a", "data": "x", "delay": 0, "ttl": 60,
                         "retry": 0}, NOW) is not None
    assert s.answer_now({"action": 4, "queue": "a"}, NOW) is None


def test_a_confirm_with_a_receipt_takes_the_fast_path():
    """A worker confirming its delivery is the usual at-least-once shape."""
    s = _service()
    s.answer_now({"action": 1, "queue": "a", "data": "x", "retry": 30}, NOW)
    delivery = s.answer_now({"action": 2, "queue": "a"}, NOW)
    assert delivery is not None and delivery["receipt"] == "1.1.1"
    stale = s.answer_now({"action": 3, "queue": "a", "msg_id": 1, "receipt": "1.1.2"}, NOW)
    assert stale == {"action": 3, "queue": "a", "msg_id": 1, "receipt": "1.1.2", "code": -1,
                     "reason": "stale receipt"}
    assert len(s.store.get("a")) == 1
    done = s.answer_now({"action": 3, "queue": "a", "msg_id": 1, "receipt": "1.1.1"}, NOW)
    assert done is not None and done["code"] == 0 and done["found"] is True
    assert len(s.store.get("a")) == 0
    # a receipt that is not one of ours: the general path words it
    assert s.answer_now({"action": 3, "queue": "a", "msg_id": 1, "receipt": 5}, NOW) is None


class _Replicating(HeldEngine):
    """A master whose writes and reads are answered when the test says (a
    quorum master: the entry is applied at once, answered once it commits)."""

    def read_index(self, done) -> None:
        self.held.append(lambda: done(None, None))


def _replicating_service() -> Service:
    # queues of two messages: full often, a refusal that waits for the read index
    config = Config(queue_size=2, virtual_queues={"v": ("a", "b")})
    store = Store(queue_size=config.queue_size, virtual_queues=config.virtual_queues)
    engine = _Replicating(store=store, log=Log(), me=LeaderInfo(node_id=1, host="h", port=1),
                          log_size=1000)
    return Service(config=config, store=store, engine=engine)


# The produce nearly every client sends, valid: queues fill up (a refusal
# that waits for the read index) and messages come due.
_usual_produce = st.fixed_dictionaries(
    {"action": st.just(1), "queue": st.sampled_from(["a", "b", "v"]),
     "data": st.text(max_size=5), "delay": st.integers(0, 3), "ttl": st.integers(0, 30),
     "retry": st.integers(0, 10)}, optional={"seq": st.integers()})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(_usual_produce, _request), st.integers(0, 5000),
                          st.booleans()), max_size=40))
def test_propose_path_matches_general_path(steps):
    fast, general = _replicating_service(), _replicating_service()
    now = NOW
    got_fast: list = []
    got_general: list = []
    for request, advance, commit in steps:
        now += advance
        fast.handle(copy.deepcopy(request), now, got_fast.append)
        # The general path without propose_now: on a replicating master,
        # handle() goes to handle_general, which tries propose_now first.
        general.handle_parsed(copy.deepcopy(request), now, got_general.append)
        if commit:  # or with later requests: answers of several turns wait together
            fast.engine.release()
            general.engine.release()
        _same_answers(got_fast, got_general, request)
    _same_state(fast, general)


def test_propose_path_is_taken_for_the_usual_produce_and_answers_once_committed():
    """Guards the test above against comparing the general path with itself."""
    s = _replicating_service()
    out: list = []
    request = {"action": 1, "queue": "a", "data": "x", "delay": 0, "ttl": 60, "retry": 0,
               "seq": 4}
    assert s.propose_now(request, NOW, out.append)
    assert out == [] and s.engine.log.last_trans_id == 1  # applied, not yet answered
    s.engine.release()
    assert out == [{"action": 1, "queue": "a", "seq": 4, "code": 0, "msg_id": 1}]
    # other actions and unusual shapes: the general path
    assert not s.propose_now({"action": 2, "queue": "a"}, NOW, out.append)
    assert not s.propose_now({"action": True, "queue": "a", "data": "x"}, NOW, out.append)
    assert not s.propose_now({"action": 1, "queue": "a", "data": "x", "priority": 3}, NOW,
                             out.append)
    assert not s.propose_now({"action": 1, "queue": "a", "data": "x", "ttl": 1.5}, NOW,
                             out.append)
    assert len(out) == 1 and s.engine.log.last_trans_id == 1
