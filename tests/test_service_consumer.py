"""The request service's consumer controls (issue 14) on a single node
(Store + LocalEngine), called directly with decoded requests and a clock
the test drives: every new action's answer exactly as protocol-v2 and
spec14 give it, every bad input of every new field (code -1, a clear
reason, nothing stored), long poll (parking, serving first come first
served, timers through `Service.schedule` and `tick`, sessions, the loss
of the master's role) and the expiry of final leases.

No sockets, no sleeps: `now` is an argument, timers are the calls the
service makes to `schedule`, and the test calls `tick` itself.
"""

from __future__ import annotations

from typing import Any

import pytest

from qserver.config import Config
from qserver.engines import LeaderInfo, LocalEngine
from qserver.engines.base import FORWARD_TIMEOUT_S, Session
from qserver.service import Service
from qserver.state.log import Log
from qserver.state.store import Store
from qserver.wire.codec import encode_response

NOW = 1_700_000_000_000  # unix ms
NOW_S = NOW // 1000
HOUR = 3_600_000
EPOCH = 5  # the LocalEngine's receipt epoch here (a node passes its start time)


class Node:
    """A node's service wired as node.Node wires it, minus the sockets; its
    timer is the list of times the service asked for."""

    def __init__(self, **overrides: Any) -> None:
        overrides.setdefault("node_id", 3)
        overrides.setdefault("host", "127.0.0.9")
        overrides.setdefault("port", 4567)
        self.config = cfg = Config(**overrides)
        self.store = Store(queue_size=cfg.queue_size, virtual_queues=cfg.virtual_queues)
        self.log = Log()
        me = LeaderInfo(node_id=cfg.node_id, host=cfg.host, port=cfg.port)
        self.engine = LocalEngine(store=self.store, log=self.log, me=me, log_size=cfg.log_size,
                                  epoch=EPOCH)
        self.service = Service(config=cfg, store=self.store, engine=self.engine)
        self.scheduled: list[int] = []
        self.service.schedule = self.scheduled.append

    def send(self, obj: object, now: int = NOW, session: Session | None = None) -> list[dict]:
        """Every answer the request gets now: none while it is parked; one
        for the request; more when it serves parked consumes."""
        out: list[dict] = []
        self.service.handle(obj, now, out.append, session=session)
        self.store._check()
        for resp in out:
            encode_response(resp)
        return out

    def __call__(self, obj: object, now: int = NOW, session: Session | None = None) -> dict:
        """One request, answered at once with exactly one answer."""
        out = self.send(obj, now, session)
        assert len(out) == 1, out
        assert out[0]["code"] in (0, -1), out
        return out[0]

    def park(self, obj: dict, now: int = NOW, session: Session | None = None) -> list[dict]:
        """A consume that must wait: its answers land in the list returned."""
        answers: list[dict] = []
        self.service.handle(obj, now, answers.append, session=session)
        assert answers == [], answers
        return answers

    def tick(self, now: int) -> None:
        self.service.tick(now)
        self.store._check()

    def produce(self, queue: str = "q", data: str = "x", now: int = NOW, **fields: Any) -> int:
        resp = self({"action": 1, "queue": queue, "data": data, **fields}, now)
        assert resp["code"] == 0, resp
        return resp["msg_id"]

    def consume(self, queue: str = "q", now: int = NOW, **fields: Any) -> dict:
        resp = self({"action": 2, "queue": queue, "seq": 0, **fields}, now)
        assert resp["code"] == 0, resp
        return resp

    def state(self) -> tuple:
        return self.log.last_trans_id, self.store.to_wire()


@pytest.fixture
def node() -> Node:
    return Node()


def ok(resp: dict) -> dict:
    assert resp["code"] == 0 and "reason" not in resp, resp
    return resp


def error(resp: dict, reason: str) -> dict:
    assert resp["code"] == -1, resp
    assert resp["reason"] == reason
    return resp


# -- consume: answer forms --------------------------------------------------------


def test_consume_answer_has_deliveries_and_a_receipt_for_at_least_once(node):
    node.produce(retry=30, data="job")
    assert node({"action": 2, "queue": "q", "seq": 1}) == {
        "action": 2, "queue": "q", "seq": 1, "code": 0, "msg_id": 1, "data": "job",
        "deliveries": 1, "receipt": f"{EPOCH}.1.1"}
    assert node({"action": 2, "queue": "q", "seq": 2}, NOW + 30_000) == {
        "action": 2, "queue": "q", "seq": 2, "code": 0, "msg_id": 1, "data": "job",
        "deliveries": 2, "receipt": f"{EPOCH}.1.2"}


def test_consume_with_count_answers_a_list(node):
    node.produce(data="a")
    node.produce(data="b", retry=10)
    node.produce(data="c")
    resp = node({"action": 2, "queue": "q", "count": 2, "seq": 1})
    assert resp == {"action": 2, "queue": "q", "count": 2, "seq": 1, "code": 0, "messages": [
        {"queue": "q", "msg_id": 1, "data": "a", "deliveries": 1},
        {"queue": "q", "msg_id": 2, "data": "b", "deliveries": 1, "receipt": f"{EPOCH}.2.1"}]}
    resp = node({"action": 2, "queue": "q", "count": 1000, "seq": 2})
    assert resp["messages"] == [{"queue": "q", "msg_id": 3, "data": "c", "deliveries": 1}]
    assert node({"action": 2, "queue": "q", "count": 5, "seq": 3}) == {
        "action": 2, "queue": "q", "count": 5, "seq": 3, "code": 0, "messages": []}
    assert node({"action": 2, "queue": "nope", "count": 5, "seq": 4})["messages"] == []
    assert node.store.get("nope") is None


def test_consume_from_several_queues_names_the_queue(node):
    node.produce("b", "from b", retry=10)
    node.produce("c", "from c")
    resp = node({"action": 2, "queues": ["a", "b", "c"], "seq": 1})
    assert resp == {"action": 2, "queues": ["a", "b", "c"], "seq": 1, "code": 0, "queue": "b",
                    "msg_id": 1, "data": "from b", "deliveries": 1, "receipt": f"{EPOCH}.1.1"}
    resp = node({"action": 2, "queues": ["a", "b", "c"], "count": 3, "seq": 2})
    assert resp["messages"] == [{"queue": "c", "msg_id": 1, "data": "from c", "deliveries": 1}]
    assert node({"action": 2, "queues": ["a", "b", "c"], "seq": 3}) == {
        "action": 2, "queues": ["a", "b", "c"], "seq": 3, "code": 0}


def test_consume_lease(node):
    node.produce(retry=30)
    resp = node.consume(lease=2)
    assert resp["receipt"] == f"{EPOCH}.1.1"
    assert "msg_id" not in node.consume(now=NOW + 1999)
    assert node.consume(now=NOW + 2000)["deliveries"] == 2
    assert node.store.get("q").messages[1][4] == NOW + 2000 + 30_000  # the retry again


@pytest.mark.parametrize("field", [{"count": 2}, {"wait": 5}, {"lease": 1},
                                   {"queues": ["q"]}])
def test_a_consume_with_only_a_new_field_is_not_taken_by_the_fast_path(field):
    # {"action", "queue", <one new field>}: three keys, no seq
    node = Node()
    node.produce(retry=30)
    node.produce(retry=30)
    if "queues" in field:  # both queue and queues: an error
        error(node({"action": 2, "queue": "q", **field}), "give queue or queues, not both")
        assert node.store.get("q").messages[1][4] == 0  # nothing delivered
    elif "count" in field:
        resp = ok(node({"action": 2, "queue": "q", **field}))
        assert [m["msg_id"] for m in resp["messages"]] == [1, 2]
    elif "lease" in field:
        ok(node({"action": 2, "queue": "q", **field}))
        assert node.store.get("q").messages[1][4] == NOW + 1000
    else:
        node.consume()
        node.consume()
        node.park({"action": 2, "queue": "q", **field})  # nothing ready: it waits
        assert node.service.parked == 1


# -- confirm, nack, touch with receipts ---------------------------------------------


def test_confirm_with_the_current_receipt_deletes_and_answers_found(node):
    node.produce(retry=30)
    receipt = node.consume()["receipt"]
    req = {"action": 3, "queue": "q", "msg_id": 1, "receipt": receipt, "seq": 7}
    assert node(dict(req)) == dict(req, code=0, found=True)
    assert len(node.store.get("q")) == 0
    # now the receipt names nothing: stale, and nothing changes
    before = node.state()
    assert node(dict(req)) == dict(req, code=-1, reason="stale receipt")
    assert node.state() == before


def test_a_late_confirm_cannot_confirm_a_redelivery(node):
    node.produce(retry=5, data="job")
    first = node.consume()["receipt"]
    second = node.consume(now=NOW + 5000)["receipt"]
    assert (first, second) == (f"{EPOCH}.1.1", f"{EPOCH}.1.2")
    before = node.state()
    error(node({"action": 3, "queue": "q", "msg_id": 1, "receipt": first}, NOW + 6000),
          "stale receipt")
    error(node({"action": 9, "queue": "q", "msg_id": 1, "receipt": first}, NOW + 6000),
          "stale receipt")
    error(node({"action": 10, "queue": "q", "msg_id": 1, "receipt": first}, NOW + 6000),
          "stale receipt")
    assert node.state() == before
    assert ok(node({"action": 3, "queue": "q", "msg_id": 1, "receipt": second}))["found"]
    # without a receipt, today's semantics: unknown id is code 0, found false
    assert ok(node({"action": 3, "queue": "q", "msg_id": 1}))["found"] is False


@pytest.mark.parametrize("receipt", ["garbage", "1.2", "5.1.1.1", "-5.1.1", "5.1.2", "6.1.1",
                                     "5.2.1", "0.0.0"])
@pytest.mark.parametrize("action", [3, 9, 10])
def test_a_receipt_that_is_not_the_current_delivery_is_stale(node, action, receipt):
    node.produce(retry=30)
    node.produce(retry=30)
    node.consume()
    before = node.state()
    req = {"action": action, "queue": "q", "msg_id": 1, "receipt": receipt, "seq": 2}
    assert node(dict(req)) == dict(req, code=-1, reason="stale receipt")
    assert node.state() == before


def test_nack_answers_ready_at_and_the_message_comes_back(node):
    node.produce(retry=30, data="job")
    receipt = node.consume()["receipt"]
    req = {"action": 9, "queue": "q", "msg_id": 1, "receipt": receipt, "delay": 2, "seq": 3}
    assert node(dict(req), NOW + 500) == dict(req, code=0, ready_at=(NOW + 2500) / 1000)
    assert "msg_id" not in node.consume(now=NOW + 2499)
    again = node.consume(now=NOW + 2500)
    assert (again["deliveries"], again["receipt"]) == (2, f"{EPOCH}.1.2")
    shown = ok(node({"action": 11, "queue": "q", "msg_id": 1}, NOW + 2500))["message"]
    assert (shown["nacks"], shown["deliveries"]) == (1, 2)
    # default delay 0: deliverable at once; an absolute delay (>= 1e9) is a unix time
    assert ok(node({"action": 9, "queue": "q", "msg_id": 1}, NOW + 3000))["ready_at"] == (
        (NOW + 3000) / 1000)
    node.consume(now=NOW + 3000)
    resp = ok(node({"action": 9, "queue": "q", "msg_id": 1, "delay": NOW_S + 20}, NOW + 3000))
    assert resp["ready_at"] == NOW_S + 20
    # an absolute time in the past is now
    node.consume(now=NOW + 20_000)
    resp = ok(node({"action": 9, "queue": "q", "msg_id": 1, "delay": NOW_S}, NOW + 21_000))
    assert resp["ready_at"] == (NOW + 21_000) / 1000


def test_nack_and_touch_of_what_is_not_in_flight(node):
    node.produce(retry=30)
    for action in (9, 10):
        before = node.state()
        for msg_id, queue in ((1, "q"), (2, "q"), (1, "nope")):
            req = {"action": action, "queue": queue, "msg_id": msg_id, "seq": 1}
            assert node(dict(req)) == dict(req, code=-1, reason="not in flight")
        assert node.state() == before
    node.consume()
    error(node({"action": 9, "queue": "q", "msg_id": 1}, NOW + 30_000), "not in flight")
    error(node({"action": 10, "queue": "q", "msg_id": 1}, NOW + 30_000), "not in flight")


def test_nack_that_moves_the_message_out(node):
    ok(node({"action": 5, "queue": "q", "set": {"max_deliveries": 1, "dead_letter": "dlq"}}))
    node.produce(retry=30, data="poison")
    receipt = node.consume()["receipt"]
    req = {"action": 9, "queue": "q", "msg_id": 1, "receipt": receipt, "seq": 1}
    assert node(dict(req)) == dict(req, code=0, dead_lettered=True, dead_letter="dlq")
    shown = ok(node({"action": 11, "queue": "dlq", "msg_id": 1}))["message"]
    assert (shown["origin_queue"], shown["origin_msg_id"], shown["dead_letter_reason"]) == (
        "q", 1, "max_deliveries")
    # without a dead-letter queue: deleted
    ok(node({"action": 5, "queue": "r", "set": {"max_deliveries": 1}}))
    node.produce("r", retry=30)
    node.consume("r")
    req = {"action": 9, "queue": "r", "msg_id": 1}
    assert node(dict(req)) == dict(req, code=0, deleted=True)
    assert len(node.store.get("r")) == 0
    mon = ok(node({"action": 4, "queue": "r"}))
    assert mon["dead_lettered"] == 1


def test_touch_answers_retry_at(node):
    node.produce(retry=30)
    receipt = node.consume()["receipt"]
    req = {"action": 10, "queue": "q", "msg_id": 1, "receipt": receipt, "lease": 90, "seq": 4}
    assert node(dict(req), NOW + 1000) == dict(req, code=0, retry_at=(NOW + 91_000) / 1000)
    assert "msg_id" not in node.consume(now=NOW + 90_999)
    # default lease: the message's retry
    resp = ok(node({"action": 10, "queue": "q", "msg_id": 1}, NOW + 2000))
    assert resp["retry_at"] == (NOW + 32_000) / 1000
    assert node.consume(now=NOW + 32_000)["deliveries"] == 2


# -- show and peek ----------------------------------------------------------------


def test_show(node):
    node.produce(data="job", retry=30, ttl=100)
    node.consume()
    req = {"action": 11, "queue": "q", "msg_id": 1, "seq": 5}
    assert node(dict(req), NOW + 1000) == dict(req, code=0, message={
        "msg_id": 1, "state": "in_flight", "data": "job", "priority": 1024,
        "ready_at": NOW / 1000, "ttl": (NOW + 100_000) / 1000, "retry": 30.0,
        "retry_at": (NOW + 30_000) / 1000, "deliveries": 1, "nacks": 0})
    assert node.log.last_trans_id == 2  # a read appends nothing
    for queue, msg_id in (("q", 2), ("nope", 1)):
        req = {"action": 11, "queue": queue, "msg_id": msg_id, "seq": 6}
        assert node(dict(req)) == dict(req, code=-1, reason="no such message")


def test_peek_lists_what_consumes_would_deliver_and_changes_nothing(node):
    node.produce(data="later", delay=60)
    node.produce(data="a", retry=5)
    node.produce(data="b")
    node.consume()  # "a": back at NOW + 5 s
    before = node.state()
    req = {"action": 12, "queue": "q", "seq": 1}
    assert node(dict(req), NOW + 5000) == dict(req, code=0, messages=[
        {"queue": "q", "msg_id": 3, "state": "ready", "data": "b", "priority": 1024,
         "ready_at": NOW / 1000, "ttl": (NOW + HOUR) / 1000, "retry": 0.0, "retry_at": 0.0,
         "deliveries": 0, "nacks": 0}])  # count defaults to 1
    resp = ok(node({"action": 12, "queue": "q", "count": 1000}, NOW + 5000))
    assert [(m["msg_id"], m["state"]) for m in resp["messages"]] == [(3, "ready"), (2, "ready")]
    assert node.state() == before
    resp = ok(node({"action": 12, "queue": "q", "count": 10}, NOW + 60_000))
    assert [m["msg_id"] for m in resp["messages"]] == [3, 2, 1]
    assert [m["msg_id"] for m in node.consume(now=NOW + 60_000, count=10)["messages"]] == [
        3, 2, 1]
    assert ok(node({"action": 12, "queue": "nope"}))["messages"] == []


# -- config ---------------------------------------------------------------------


def test_config_set_answers_the_settings_and_is_logged(node):
    req = {"action": 5, "queue": "q", "set": {"max_deliveries": 3, "dead_letter": "dlq"},
           "seq": 1}
    settings = {"max_deliveries": 3, "dead_letter": "dlq", "max_size": 1_000_000,
                "dedup_window": 300, "paused": "none"}
    assert node(dict(req)) == dict(req, code=0, config=settings)
    assert node.log.last_trans_id == 1
    assert ok(node({"action": 5, "queue": "q"}))["config"] == settings
    resp = ok(node({"action": 5, "queue": "q", "set": {"dead_letter": None}}))
    assert resp["config"] == {"max_deliveries": 3, "dead_letter": None,
        "max_size": 1000000, "dedup_window": 300, "paused": "none"}
    resp = ok(node({"action": 5, "queue": "q", "set": {"max_deliveries": 0, "dead_letter": ""}}))
    assert resp["config"] == {"max_deliveries": 0, "dead_letter": None,
        "max_size": 1000000, "dedup_window": 300, "paused": "none"}
    assert node.log.last_trans_id == 3
    # an unknown queue reads as the defaults, and the read creates nothing
    assert ok(node({"action": 5, "queue": "other"}))["config"] == {"max_deliveries": 0,
                                                                   "dead_letter": None,
        "max_size": 1000000, "dedup_window": 300, "paused": "none"}
    assert node.store.get("other") is None
    # an empty set is a read
    ok(node({"action": 5, "queue": "other", "set": {}}))
    assert node.log.last_trans_id == 3 and node.store.get("other") is None


# -- every bad input class of the new fields ------------------------------------------

COUNT = "count must be an integer from 1 to 1000"
QUEUES = "queues must be a list of 1 to 16 queue names"
NAMES = "queues must hold queue names (strings of 1 to 255 characters)"
MAX_DELIVERIES = ("bad value for max_deliveries: must be an integer from 0 (unlimited) to "
                  "1000000")
DEAD_LETTER = ("bad value for dead_letter: must be a queue name (1 to 255 characters), or null "
               "for none")

BAD = [
    ({"action": 2, "queue": "q", "count": 0}, COUNT),
    ({"action": 2, "queue": "q", "count": 1001}, COUNT),
    ({"action": 2, "queue": "q", "count": "x"}, COUNT),
    ({"action": 2, "queue": "q", "count": True}, COUNT),
    ({"action": 2, "queue": "q", "count": 2.0}, COUNT),
    ({"action": 2, "queue": "q", "wait": -1}, "wait must be at least 0"),
    ({"action": 2, "queue": "q", "wait": 31}, "wait out of range"),  # over max_wait (30)
    ({"action": 2, "queue": "q", "wait": 30.5}, "wait out of range"),
    ({"action": 2, "queue": "q", "wait": 10**12}, "wait out of range"),
    ({"action": 2, "queue": "q", "wait": "5"}, "wait must be a number of seconds"),
    ({"action": 2, "queue": "q", "wait": False}, "wait must be a number of seconds"),
    ({"action": 2, "queue": "q", "lease": 0}, "lease must be positive"),
    ({"action": 2, "queue": "q", "lease": -3}, "lease must be positive"),
    ({"action": 2, "queue": "q", "lease": "1"}, "lease must be a number of seconds"),
    ({"action": 2, "queues": []}, QUEUES),
    ({"action": 2, "queues": [f"q{i}" for i in range(17)]}, QUEUES),
    ({"action": 2, "queues": "q"}, QUEUES),
    ({"action": 2, "queues": ["q", "r", "q"]}, "queues names a queue twice"),
    ({"action": 2, "queues": ["q", 7]}, NAMES),
    ({"action": 2, "queues": ["q", ""]}, NAMES),
    ({"action": 2, "queues": ["q" * 256]}, NAMES),
    ({"action": 2, "queue": "q", "queues": ["q"]}, "give queue or queues, not both"),
    ({"action": 3, "queue": "q", "msg_id": 1, "receipt": 5}, "receipt must be a string"),
    ({"action": 3, "queue": "q", "msg_id": 1, "receipt": ["5.1.1"]}, "receipt must be a string"),
    ({"action": 3, "queue": "q", "msg_id": 1, "receipt": "5" * 65},
     "receipt must be 1 to 64 characters"),
    ({"action": 3, "queue": "q", "msg_id": 1, "receipt": ""},
     "receipt must be 1 to 64 characters"),
    ({"action": 9, "queue": "q", "msg_id": 1, "receipt": 5.1}, "receipt must be a string"),
    ({"action": 9, "queue": "q", "msg_id": 1, "delay": "soon"}, "delay must be a number"),
    ({"action": 9, "queue": "q", "msg_id": 1, "delay": -1}, "delay must not be negative"),
    ({"action": 9, "queue": "q", "msg_id": 1, "delay": 10**12}, "delay out of range"),
    ({"action": 9, "queue": "q"}, "missing field: msg_id"),
    ({"action": 10, "queue": "q", "msg_id": 1, "lease": 0}, "lease must be positive"),
    ({"action": 10, "queue": "q", "msg_id": 1, "lease": -1}, "lease must be positive"),
    ({"action": 10, "queue": "q", "msg_id": 1, "lease": []}, "lease must be a number of seconds"),
    ({"action": 10, "queue": "q", "msg_id": 1, "receipt": {}}, "receipt must be a string"),
    ({"action": 11, "queue": "q"}, "missing field: msg_id"),
    ({"action": 11, "queue": "q", "msg_id": "one"}, "msg_id must be an integer"),
    ({"action": 12, "queue": "q", "count": 0}, COUNT),
    ({"action": 12, "queue": "q", "count": 1001}, COUNT),
    ({"action": 12, "count": 1}, "missing field: queue"),
    ({"action": 5, "queue": "q", "set": [1]}, "set must be an object of settings"),
    ({"action": 5, "queue": "q", "set": "max_deliveries=1"}, "set must be an object of settings"),
    ({"action": 5, "queue": "q", "set": {"colour": "red"}}, "unknown setting: colour"),
    ({"action": 5, "queue": "q", "set": {"max_deliveries": 1, "paused": "in", "hue": 1}},
     "unknown setting: hue"),
    ({"action": 5, "queue": "q", "set": {"max_deliveries": -1}}, MAX_DELIVERIES),
    ({"action": 5, "queue": "q", "set": {"max_deliveries": 1_000_001}}, MAX_DELIVERIES),
    ({"action": 5, "queue": "q", "set": {"max_deliveries": "3"}}, MAX_DELIVERIES),
    ({"action": 5, "queue": "q", "set": {"max_deliveries": None}}, MAX_DELIVERIES),
    ({"action": 5, "queue": "q", "set": {"dead_letter": 3}}, DEAD_LETTER),
    ({"action": 5, "queue": "q", "set": {"dead_letter": "d" * 256}}, DEAD_LETTER),
    ({"action": 5, "queue": "q", "set": {"dead_letter": "q"}},
     "bad value for dead_letter: a queue cannot be its own dead-letter queue"),
    ({"action": 5, "queue": "a", "set": {"dead_letter": "v"}},
     "bad value for dead_letter: virtual queue v includes a itself"),
    ({"action": 5, "queue": "v", "set": {"max_deliveries": 2}},
     "virtual queue only takes produce"),
    ({"action": 2, "queues": ["q", "v"]}, "virtual queue only takes produce"),
    ({"action": 9, "queue": "v", "msg_id": 1}, "virtual queue only takes produce"),
    ({"action": 10, "queue": "v", "msg_id": 1}, "virtual queue only takes produce"),
    ({"action": 3, "queue": "v", "msg_id": 1, "receipt": "5.1.1"},
     "virtual queue only takes produce"),
]


@pytest.mark.parametrize("req,reason", BAD, ids=lambda v: str(v)[:60])
def test_bad_input_is_refused_with_its_reason_and_stores_nothing(req, reason):
    node = Node(virtual_queues={"v": ("a", "b")})
    node.produce("q", retry=30)
    node.consume("q")  # in flight, so a receipt could have matched
    before = node.state()
    req = dict(req, seq="s")
    resp = node(dict(req))
    expected = dict(req, code=-1, reason=reason)
    assert resp == expected
    assert node.state() == before
    assert node.service.parked == 0


def test_config_read_of_a_virtual_queue_is_refused():
    # A virtual queue has no settings: a read must not answer defaults that
    # a write would refuse to change.
    node = Node(virtual_queues={"v": ("a", "b")})
    error(node({"action": 5, "queue": "v"}), "virtual queue only takes produce")


def test_max_wait_is_the_nodes_setting():
    node = Node(max_wait_s=5)
    error(node({"action": 2, "queue": "q", "wait": 5.001}), "wait out of range")
    node.park({"action": 2, "queue": "q", "wait": 5, "seq": 1})
    assert node.service.parked == 1
    off = Node(max_wait_s=0)
    error(off({"action": 2, "queue": "q", "wait": 1}), "wait out of range")
    assert ok(off({"action": 2, "queue": "q", "wait": 0}))  # no wait: answered at once


# -- monitor ----------------------------------------------------------------------


def test_monitor_fields_for_consumers(node):
    node.produce(data="old")
    node.produce(data="new", now=NOW + 4000)
    node.produce(data="job", retry=10, now=NOW + 4000)
    node.consume(now=NOW + 4000)  # "old" (at-most-once) gone
    node.consume(now=NOW + 4000)  # "new" gone
    node.consume(now=NOW + 4000)  # "job": in flight until NOW + 14 s
    node.park({"action": 2, "queue": "q", "wait": 10}, NOW + 5000)
    node.park({"action": 2, "queues": ["x", "q"], "wait": 10}, NOW + 5000)
    resp = ok(node({"action": 4, "queue": "q"}, NOW + 6000))
    assert (resp["ready"], resp["delayed"], resp["in_flight"]) == (0, 0, 1)
    assert (resp["waiting"], resp["dead_lettered"], resp["oldest_ready_age"]) == (2, 0, 0)
    assert ok(node({"action": 104, "queue": "x"}, NOW + 6000))["waiting"] == 1
    node.tick(NOW + 14_000)  # "job" is due again: the first parked consume takes it
    node.produce(data="late", now=NOW + 14_000)  # the second takes this
    node.produce(data="waits", now=NOW + 14_000)
    resp = ok(node({"action": 4, "queue": "q"}, NOW + 16_500))
    assert (resp["ready"], resp["waiting"], resp["oldest_ready_age"]) == (1, 0, 2.5)
    resp = ok(node({"action": 4, "queue": "none"}))
    assert (resp["dead_lettered"], resp["waiting"], resp["oldest_ready_age"]) == (0, 0, 0)


# -- long poll --------------------------------------------------------------------


def test_a_parked_consume_is_served_by_a_later_produce(node):
    answers = node.park({"action": 2, "queue": "q", "wait": 10, "seq": "w"})
    assert node.service.parked == 1 and NOW + 10_000 in node.scheduled
    produced = node.send({"action": 1, "queue": "q", "data": "job", "retry": 5, "seq": "p"},
                         NOW + 3000)
    assert [r["seq"] for r in produced] == ["p"]
    assert answers == [{"action": 2, "queue": "q", "wait": 10, "seq": "w", "code": 0,
                        "msg_id": 1, "data": "job", "deliveries": 1,
                        "receipt": f"{EPOCH}.1.1"}]
    assert node.service.parked == 0
    assert node.store.get("q").messages[1][4] == NOW + 3000 + 5000  # delivered at the produce
    node.tick(NOW + 10_000)  # its old deadline: nothing more is answered
    assert len(answers) == 1


def test_parked_consumes_are_served_first_come_first_served(node):
    first = node.park({"action": 2, "queue": "q", "wait": 10}, NOW)
    second = node.park({"action": 2, "queues": ["other", "q"], "wait": 10}, NOW + 1)
    third = node.park({"action": 2, "queue": "q", "count": 5, "wait": 10}, NOW + 2)
    node.produce(data="one", now=NOW + 100)
    assert [a["data"] for a in first] == ["one"] and second == [] and third == []
    node.produce(data="two", now=NOW + 200)
    assert second == [{"action": 2, "queues": ["other", "q"], "wait": 10, "code": 0,
                       "queue": "q", "msg_id": 2, "data": "two", "deliveries": 1}]
    assert third == []
    node.produce(data="three", now=NOW + 300)
    # with count: whatever is deliverable then, without waiting to fill it
    assert third == [{"action": 2, "queue": "q", "count": 5, "wait": 10, "code": 0,
                      "messages": [{"queue": "q", "msg_id": 3, "data": "three",
                                    "deliveries": 1}]}]
    assert node.service.parked == 0


def test_a_parked_consume_is_served_when_a_delayed_message_comes_due(node):
    answers = node.park({"action": 2, "queue": "q", "wait": 20})
    node.scheduled.clear()
    node.produce(data="later", delay=3, now=NOW + 1000)
    assert answers == [] and node.scheduled == [NOW + 4000]
    node.tick(NOW + 3999)
    assert answers == []
    node.tick(NOW + 4000)
    assert [(a["msg_id"], a["data"]) for a in answers] == [(1, "later")]


def test_a_parked_consume_is_served_when_a_retry_comes_due(node):
    node.produce(data="job", retry=5)
    node.consume()  # in flight until NOW + 5 s
    node.scheduled.clear()
    answers = node.park({"action": 2, "queue": "q", "wait": 30}, NOW + 1000)
    assert NOW + 5000 in node.scheduled and NOW + 31_000 in node.scheduled
    node.tick(NOW + 5000)
    assert [(a["msg_id"], a["deliveries"]) for a in answers] == [(1, 2)]


def test_a_parked_consume_is_served_by_a_nack(node):
    node.produce(data="job", retry=60)
    receipt = node.consume()["receipt"]
    answers = node.park({"action": 2, "queue": "q", "wait": 30}, NOW + 1000)
    ok(node({"action": 9, "queue": "q", "msg_id": 1, "receipt": receipt}, NOW + 2000))
    assert [(a["msg_id"], a["deliveries"], a["receipt"]) for a in answers] == [
        (1, 2, f"{EPOCH}.1.2")]


def test_a_parked_consume_times_out_with_the_empty_answer(node):
    answers = node.park({"action": 2, "queue": "q", "wait": 2, "seq": 1})
    listed = node.park({"action": 2, "queue": "q", "wait": 2.5, "count": 3, "seq": 2})
    assert NOW + 2000 in node.scheduled and NOW + 2500 in node.scheduled
    node.tick(NOW + 1999)
    assert answers == [] and listed == []
    node.tick(NOW + 2000)
    assert answers == [{"action": 2, "queue": "q", "wait": 2, "seq": 1, "code": 0}]
    assert listed == []
    node.tick(NOW + 2500)
    assert listed == [{"action": 2, "queue": "q", "wait": 2.5, "count": 3, "seq": 2, "code": 0,
                       "messages": []}]
    assert node.service.parked == 0 and node.log.last_trans_id == 0


def test_a_consume_with_wait_is_answered_at_once_when_something_is_ready(node):
    node.produce(data="ready")
    resp = node({"action": 2, "queue": "q", "wait": 10})
    assert resp["data"] == "ready" and node.service.parked == 0


def test_a_closed_session_drops_its_waiter_and_takes_no_message(node):
    session = Session()
    answers = node.park({"action": 2, "queue": "q", "wait": 10}, session=session)
    assert len(session) == 1
    session.close()
    assert node.service.parked == 0 and node.service.waiting == {}
    node.produce(data="at most once")
    assert answers == []  # never answered
    assert len(node.store.get("q")) == 1  # the message was not taken for nobody
    assert node.consume()["data"] == "at most once"
    node.tick(NOW + 10_000)
    assert answers == []


def test_a_waiter_answered_forgets_its_session(node):
    session = Session()
    answers = node.park({"action": 2, "queue": "q", "wait": 10}, session=session)
    node.produce()
    assert len(answers) == 1 and len(session) == 0
    session.close()  # nothing left to cancel
    assert len(answers) == 1


def test_a_consume_from_a_session_already_closed_does_not_park(node):
    session = Session()
    session.close()
    resp = node({"action": 2, "queue": "q", "wait": 10}, session=session)
    assert resp == {"action": 2, "queue": "q", "wait": 10, "code": 0}
    assert node.service.parked == 0


def test_losing_the_masters_role_answers_parked_consumes_empty(node):
    plain = node.park({"action": 2, "queue": "q", "wait": 10, "seq": 1})
    listed = node.park({"action": 2, "queues": ["q", "r"], "count": 2, "wait": 10, "seq": 2})
    node.service.role_changed(False)
    assert plain == [{"action": 2, "queue": "q", "wait": 10, "seq": 1, "code": 0}]
    assert listed == [{"action": 2, "queues": ["q", "r"], "count": 2, "wait": 10, "seq": 2,
                       "code": 0, "messages": []}]
    assert node.service.parked == 0
    node.tick(NOW + 10_000)
    assert len(plain) == len(listed) == 1


class _Slave(LocalEngine):
    """A slave's engine: not master, relays to a master the test plays."""

    commits_at_once = False

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.is_master = False
        self.forwarded: list = []
        self.cancelled: list = []

    def forward(self, request, respond, timeout_s=None):
        self.forwarded.append((dict(request), respond, timeout_s))
        return lambda: self.cancelled.append(request)


def test_a_slave_relays_a_waiting_consume_with_a_longer_timeout():
    cfg = Config()
    store = Store(queue_size=cfg.queue_size)
    engine = _Slave(store=store, log=Log(), log_size=cfg.log_size,
                    me=LeaderInfo(node_id=1, host="127.0.0.1", port=1111))
    service = Service(config=cfg, store=store, engine=engine)
    session = Session()
    answers: list = []
    service.handle({"action": 2, "queue": "q", "wait": 7}, NOW, answers.append, session=session)
    (request, respond, timeout_s), = engine.forwarded
    assert request == {"action": 2, "queue": "q", "wait": 7}
    assert timeout_s == FORWARD_TIMEOUT_S + 7
    assert len(session) == 1
    respond({"code": 0})
    assert answers == [{"code": 0}] and len(session) == 0
    # without wait: the usual forward timeout, nothing to cancel
    service.handle({"action": 2, "queue": "q"}, NOW, answers.append, session=session)
    assert engine.forwarded[-1][2] is None and len(session) == 0
    # one whose client goes: the forward is cancelled, the client hears nothing
    service.handle({"action": 2, "queue": "q", "wait": 7}, NOW, answers.append, session=session)
    session.close()
    assert len(engine.cancelled) == 1 and len(answers) == 1
    # over the slave's own max_wait: refused there, not relayed
    service.handle({"action": 2, "queue": "q", "wait": 31}, NOW, answers.append)
    assert answers[-1]["reason"] == "wait out of range" and len(engine.forwarded) == 3


# -- final leases: expiry by the master's timer --------------------------------------


def test_tick_moves_expired_final_leases_to_the_dead_letter_queue(node):
    ok(node({"action": 5, "queue": "q", "set": {"max_deliveries": 2, "dead_letter": "dlq"}}))
    node.produce(data="poison", retry=5)
    node.consume()
    waiter = node.park({"action": 2, "queue": "dlq", "wait": 30}, NOW + 100)
    node.scheduled.clear()
    last = node.consume(now=NOW + 5000)  # the second and last delivery: final
    assert last["deliveries"] == 2 and node.scheduled == [NOW + 10_000]
    node.tick(NOW + 9999)
    assert len(node.store.get("q")) == 1
    shown = ok(node({"action": 11, "queue": "q", "msg_id": 1}, NOW + 9999))["message"]
    assert shown["state"] == "in_flight"
    node.tick(NOW + 10_000)
    assert len(node.store.get("q")) == 0
    # the dead letter wakes the consume parked on the dead-letter queue
    assert [(a["msg_id"], a["data"], a["deliveries"]) for a in waiter] == [(1, "poison", 1)]
    shown = ok(node({"action": 11, "queue": "dlq", "msg_id": 1}, NOW + 10_000))["message"]
    assert (shown["origin_queue"], shown["origin_msg_id"], shown["dead_letter_reason"]) == (
        "q", 1, "max_deliveries")
    assert shown["state"] == "in_flight"  # the waiter took it
    assert ok(node({"action": 4, "queue": "q"}, NOW + 10_000))["dead_lettered"] == 1
    # a stale confirm of the moved message: the receipt names nothing now
    error(node({"action": 3, "queue": "q", "msg_id": 1, "receipt": last["receipt"]}),
          "stale receipt")


def test_tick_expires_a_final_lease_from_the_ttl_rule(node):
    ok(node({"action": 5, "queue": "q", "set": {"dead_letter": "dlq"}}))
    node.produce(data="late", retry=5, ttl=8)
    node.consume()
    node.scheduled.clear()
    node.consume(now=NOW + 5000)  # NOW + 10 s passes the ttl: final (expired)
    assert node.scheduled == [NOW + 10_000]
    node.tick(NOW + 10_000)
    shown = ok(node({"action": 11, "queue": "dlq", "msg_id": 1}, NOW + 10_000))["message"]
    assert shown["dead_letter_reason"] == "expired" and shown["state"] == "ready"
    assert len(node.store.get("q")) == 0 and node.store.next_final_ms() is None


def test_role_changed_to_master_arms_the_timer_for_final_leases(node):
    ok(node({"action": 5, "queue": "q", "set": {"max_deliveries": 1}}))
    node.produce(retry=5)
    node.consume()
    node.scheduled.clear()
    node.service.role_changed(True)
    assert node.scheduled == [NOW + 5000]


def test_a_parked_consume_keeps_waiting_when_the_due_message_is_moved_out(node):
    # The only message due is over a lowered max_deliveries: serving the
    # parked consume moves it out (deleted: no dead-letter queue), and then
    # nothing is deliverable, so the consume must keep waiting for its
    # wait, not be answered empty early.
    node.produce(data="job", retry=5)
    node.consume()
    ok(node({"action": 5, "queue": "q", "set": {"max_deliveries": 1}}))
    answers = node.park({"action": 2, "queue": "q", "wait": 30}, NOW + 1000)
    node.tick(NOW + 5000)  # the lease ran out: it is due, and over the limit
    assert len(node.store.get("q")) == 0 and node.store.get("q").dead_lettered == 1
    assert answers == [] and node.service.parked == 1
    node.produce(data="next", now=NOW + 6000)
    assert [a["data"] for a in answers] == ["next"]


def test_a_parked_consume_is_served_by_a_produce_into_a_virtual_queue():
    node = Node(virtual_queues={"v": ("a", "b")})
    on_b = node.park({"action": 2, "queue": "b", "wait": 10})
    node.produce("v", "fan")
    assert [(a["msg_id"], a["data"]) for a in on_b] == [(1, "fan")]
    assert len(node.store.get("a")) == 1 and len(node.store.get("b")) == 0


def test_deadlines_of_served_long_polls_do_not_pile_up(node):
    # Each served long poll leaves its deadline in the timer heap until it
    # passes; many short-lived long polls must not hold thousands of them.
    for i in range(1000):
        answers = node.park({"action": 2, "queue": "q", "wait": 30})
        node.produce(data=f"m{i}")
        assert [a["data"] for a in answers] == [f"m{i}"]
    assert node.service.parked == 0
    assert len(node.service._timeouts) <= 64
