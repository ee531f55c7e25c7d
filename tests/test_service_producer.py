"""The request service's producer and queue controls (issue 15) on a single
node (Store + LocalEngine), called directly with decoded requests and a
clock the test drives: every answer of protocol-v2 and spec15 (produce
with priority and dedup_id, batch produce, the echo, all or nothing,
config max_size/dedup_window/paused, pause in/out/all with long polls,
clear, monitor, the XML queue defaults), every bad input of every new
field (code -1, the exact reason, nothing stored, the node fine after),
and, on a master whose writes and reads wait (as a cluster master's do),
that a `duplicate: true` and a `cleared: 0` answer rest on the read index.

No sockets, no sleeps: `now` is an argument, timers are the calls the
service makes to `schedule`, and the test calls `tick` itself.
"""

from __future__ import annotations

from typing import Any

import pytest

from qserver.config import Config, parse_xml
from qserver.engines import LeaderInfo, LocalEngine
from qserver.engines.native.core import OUTCOME_UNKNOWN
from qserver.service import Service
from qserver.state.log import Log
from qserver.state.store import Store
from qserver.wire.codec import encode_response

NOW = 1_700_000_000_000  # unix ms
NOW_S = NOW // 1000
EPOCH = 5  # the LocalEngine's receipt epoch here
QUEUE_SIZE = 1_000_000  # Config's default queue_size
DEFAULT_SETTINGS = {"max_deliveries": 0, "dead_letter": None, "max_size": QUEUE_SIZE,
                    "dedup_window": 300, "paused": "none"}


class Node:
    """A node's service wired as node.Node wires it (the XML queue defaults
    included), minus the sockets; its timer is the list of times the
    service asked for."""

    def __init__(self, **overrides: Any) -> None:
        overrides.setdefault("node_id", 3)
        overrides.setdefault("host", "127.0.0.9")
        overrides.setdefault("port", 4567)
        self.config = cfg = Config(**overrides)
        self.store = Store(queue_size=cfg.queue_size, virtual_queues=cfg.virtual_queues,
                           queue_defaults=cfg.queue_defaults)
        self.log = Log()
        me = LeaderInfo(node_id=cfg.node_id, host=cfg.host, port=cfg.port)
        self.engine = LocalEngine(store=self.store, log=self.log, me=me, log_size=cfg.log_size,
                                  epoch=EPOCH)
        self.service = Service(config=cfg, store=self.store, engine=self.engine)
        self.scheduled: list[int] = []
        self.service.schedule = self.scheduled.append

    def send(self, obj: object, now: int = NOW) -> list[dict]:
        """Every answer the request gets now (none while it is parked)."""
        out: list[dict] = []
        self.service.handle(obj, now, out.append)
        self.store._check()
        for resp in out:
            encode_response(resp)
        return out

    def __call__(self, obj: object, now: int = NOW) -> dict:
        """One request, answered at once with exactly one answer."""
        out = self.send(obj, now)
        assert len(out) == 1, out
        assert out[0]["code"] in (0, -1), out
        return out[0]

    def park(self, obj: dict, now: int = NOW) -> list[dict]:
        """A consume that must wait: its answers land in the list returned."""
        answers: list[dict] = []
        self.service.handle(obj, now, answers.append)
        assert answers == [], answers
        return answers

    def tick(self, now: int) -> None:
        self.service.tick(now)
        self.store._check()

    def produce(self, queue: str = "q", data: str = "x", now: int = NOW, **fields: Any) -> dict:
        return ok(self({"action": 1, "queue": queue, "data": data, **fields}, now))

    def batch(self, queue: str, messages: list, now: int = NOW, **fields: Any) -> dict:
        return ok(self({"action": 1, "queue": queue, "messages": messages, **fields}, now))

    def consume(self, queue: str = "q", now: int = NOW, **fields: Any) -> dict:
        return ok(self({"action": 2, "queue": queue, **fields}, now))

    def configure(self, queue: str = "q", now: int = NOW, **settings: Any) -> dict:
        return ok(self({"action": 5, "queue": queue, "set": settings}, now))["config"]

    def settings(self, queue: str = "q") -> dict:
        return ok(self({"action": 5, "queue": queue}))["config"]

    def data(self, queue: str = "q") -> list[tuple[int, str]]:
        """(msg_id, data) of every message the queue holds, by id."""
        q = self.store.get(queue)
        return [] if q is None else sorted((i, m[0]) for i, m in q.messages.items())

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


def still_fine(node: Node, queue: str = "q") -> None:
    """The node still takes a produce (each form) and delivers in order."""
    before = node.data(queue)
    one = node.produce(queue, "fine", priority=0)["msg_id"]
    two = node.batch(queue, [{"data": "fine2"}])["msg_ids"][0]
    assert two == one + 1
    assert node.data(queue) == before + [(one, "fine"), (two, "fine2")]
    assert node.consume(queue)["msg_id"] == one  # priority 0 before everything else


# -- produce: single ------------------------------------------------------------


def test_single_produce_with_priority_answers_as_today(node):
    req = {"action": 1, "queue": "q", "data": "x", "priority": 5, "delay": 0, "ttl": 100,
           "retry": 3, "seq": 1, "colour": "red"}
    assert node(dict(req)) == {"action": 1, "queue": "q", "priority": 5, "seq": 1,
                               "colour": "red", "code": 0, "msg_id": 1}
    shown = ok(node({"action": 11, "queue": "q", "msg_id": 1}))["message"]
    assert (shown["priority"], shown["retry"], shown["ttl"]) == (5, 3.0, (NOW + 100_000) / 1000)
    # the default priority: 1024, shown as such
    node.produce(data="plain")
    assert ok(node({"action": 11, "queue": "q", "msg_id": 2}))["message"]["priority"] == 1024
    # 0 and 2^31-1 are the bounds
    assert node.produce(priority=0)["msg_id"] == 3
    assert node.produce(priority=2**31 - 1)["msg_id"] == 4


def test_priorities_are_delivered_lowest_first_then_in_order(node):
    node.produce(data="default-1")
    node.produce(data="p7", priority=7)
    node.produce(data="p1024", priority=1024)  # as no priority: today's order
    node.produce(data="p0-a", priority=0)
    node.produce(data="p7-b", priority=7)
    node.produce(data="p0-b", priority=0)
    node.produce(data="last", priority=2**31 - 1)
    node.produce(data="default-2")
    got = [node.consume()["data"] for _ in range(8)]
    assert got == ["p0-a", "p0-b", "p7", "p7-b", "default-1", "p1024", "default-2", "last"]
    assert "msg_id" not in node.consume()


def test_a_consume_with_count_takes_priorities_in_the_same_order(node):
    priorities = [None, 5, None, 0, 5, 2**31 - 1, 1024, 0]
    for i, priority in enumerate(priorities):
        node.produce(data=f"m{i}", **({} if priority is None else {"priority": priority}))
    peeked = ok(node({"action": 12, "queue": "q", "count": 10}))["messages"]
    expected = ["m3", "m7", "m1", "m4", "m0", "m2", "m6", "m5"]
    assert [m["data"] for m in peeked] == expected
    assert [m["priority"] for m in peeked] == [0, 0, 5, 5, 1024, 1024, 1024, 2**31 - 1]
    assert [m["data"] for m in node.consume(count=10)["messages"]] == expected


def test_parked_consumes_are_served_by_batches_dedup_produces_and_due_priorities(node):
    first = node.park({"action": 2, "queue": "q", "wait": 20, "count": 5})
    second = node.park({"action": 2, "queue": "q", "wait": 20})
    node.batch("q", [{"data": "b1", "priority": 7}, {"data": "b2"},
                     {"data": "b3", "priority": 1}], now=NOW + 100)
    assert [(m["msg_id"], m["data"]) for m in first[0]["messages"]] == [
        (3, "b3"), (1, "b1"), (2, "b2")]
    assert second == []
    node.produce(data="dd", dedup_id="x", now=NOW + 200)
    assert [(a["msg_id"], a["data"]) for a in second] == [(4, "dd")]
    # a duplicate stores nothing and serves nobody
    third = node.park({"action": 2, "queue": "q", "wait": 20}, NOW + 300)
    assert node.produce(dedup_id="x", now=NOW + 400)["duplicate"] is True
    assert third == [] and node.service.parked == 1
    # a delayed message with a priority: the timer comes when it is due
    node.scheduled.clear()
    node.produce(data="later", priority=3, delay=2, now=NOW + 500)
    assert node.scheduled == [NOW + 2500]
    node.tick(NOW + 2499)
    assert third == []
    node.tick(NOW + 2500)
    assert [(a["msg_id"], a["data"]) for a in third] == [(5, "later")]


def test_single_produce_with_dedup_id(node):
    req = {"action": 1, "queue": "q", "data": "x", "dedup_id": "order-1", "seq": "a",
           "retry": 5}
    assert node(dict(req)) == {"action": 1, "queue": "q", "dedup_id": "order-1", "seq": "a",
                               "code": 0, "msg_id": 1, "duplicate": False}
    log_length = node.log.last_trans_id
    # the resend: nothing stored, the first produce's msg_id
    req = dict(req, data="other data", seq="b", priority=3)
    assert node(dict(req), NOW + 1000) == {
        "action": 1, "queue": "q", "dedup_id": "order-1", "seq": "b", "priority": 3,
        "code": 0, "msg_id": 1, "duplicate": True}
    assert node.log.last_trans_id == log_length
    assert node.data() == [(1, "x")]
    # another id: stored
    assert node.produce(dedup_id="order-2")["duplicate"] is False
    assert node.data() == [(1, "x"), (2, "x")]
    # still a duplicate once the first message is consumed (the table is not the queue)
    node.consume()
    resp = node.produce(dedup_id="order-1", now=NOW + 2000)
    assert (resp["msg_id"], resp["duplicate"]) == (1, True)
    # a 128-character id is fine
    assert node.produce(dedup_id="k" * 128)["duplicate"] is False
    assert node.produce(dedup_id="k" * 128)["duplicate"] is True


def test_dedup_id_null_is_absent(node):
    req = {"action": 1, "queue": "q", "data": "x", "dedup_id": None, "priority": None}
    assert node(dict(req)) == {"action": 1, "queue": "q", "dedup_id": None, "priority": None,
                               "code": 0, "msg_id": 1}
    assert node(dict(req))["msg_id"] == 2  # no dedup: stored again
    assert node.data() == [(1, "x"), (2, "x")]


def test_dedup_window_edge_and_per_queue_tables(node):
    assert node.configure(dedup_window=2)["dedup_window"] == 2
    assert node.produce(dedup_id="k")["msg_id"] == 1
    # still a duplicate a millisecond before the window ends
    assert node.produce(dedup_id="k", now=NOW + 1999)["duplicate"] is True
    # at t + window: accepted again, a new message
    resp = node.produce(dedup_id="k", now=NOW + 2000)
    assert (resp["msg_id"], resp["duplicate"]) == (2, False)
    resp = node.produce(dedup_id="k", now=NOW + 3999)
    assert (resp["msg_id"], resp["duplicate"]) == (2, True)
    assert node.data() == [(1, "x"), (2, "x")]
    # tables per queue name: the same id on another queue is its own
    assert node.produce("r", dedup_id="k")["duplicate"] is False
    assert node.produce("r", dedup_id="k")["duplicate"] is True
    # window 0: off, every produce is stored and answers duplicate false
    node.configure(dedup_window=0)
    for msg_id in (3, 4):
        resp = node.produce(dedup_id="k", now=NOW + 4000)
        assert (resp["msg_id"], resp["duplicate"]) == (msg_id, False)
    # a fractional window
    assert node.configure("s", dedup_window=0.5)["dedup_window"] == 0.5
    node.produce("s", dedup_id="d")
    assert node.produce("s", dedup_id="d", now=NOW + 499)["duplicate"] is True
    assert node.produce("s", dedup_id="d", now=NOW + 500)["duplicate"] is False


def test_virtual_queue_single_produce_with_dedup_id():
    node = Node(virtual_queues={"v": ("a", "b")})
    req = {"action": 1, "queue": "v", "data": "fan", "dedup_id": "k", "seq": 1}
    first = node(dict(req))
    assert first == {"action": 1, "queue": "v", "dedup_id": "k", "seq": 1, "code": 0,
                     "msg_id": 1, "msg_ids": {"a": 1, "b": 1}, "duplicate": False}
    node.produce("a", "direct")  # the members move on
    again = node(dict(req), NOW + 1000)
    assert again == dict(first, duplicate=True)
    assert node.data("a") == [(1, "fan"), (2, "direct")] and node.data("b") == [(1, "fan")]
    # the virtual queue's table is its own: "k" on a member is new
    assert node.produce("a", dedup_id="k")["duplicate"] is False


# -- produce: batches ---------------------------------------------------------------


def test_batch_answers_msg_ids_in_input_order(node):
    req = {"action": 1, "queue": "q", "seq": 4, "colour": "red", "delay": 0, "ttl": 100,
           "retry": 5, "priority": 9,
           "messages": [{"data": "a"}, {"data": "b", "priority": 1}, {"data": "c"}]}
    assert node(dict(req)) == {"action": 1, "queue": "q", "seq": 4, "colour": "red",
                               "priority": 9, "code": 0, "msg_ids": [1, 2, 3],
                               "duplicates": []}
    assert node.data() == [(1, "a"), (2, "b"), (3, "c")]
    assert node.log.last_trans_id == 1  # one entry
    # top-level times and priority are defaults; an item's own win
    shown = [ok(node({"action": 11, "queue": "q", "msg_id": i}))["message"] for i in (1, 2)]
    assert [(s["priority"], s["retry"], s["ttl"]) for s in shown] == [
        (9, 5.0, (NOW + 100_000) / 1000), (1, 5.0, (NOW + 100_000) / 1000)]
    assert [node.consume()["data"] for _ in range(3)] == ["b", "a", "c"]
    # a batch of one, and the ids go on from the queue's max_id
    assert node.batch("q", [{"data": "d"}])["msg_ids"] == [4]


def test_batch_items_own_fields(node):
    resp = node.batch("q", [
        {"data": "late", "delay": 60, "ttl": 120, "retry": 7, "priority": 3},
        {"data": "now"}], delay=0, retry=0)
    assert resp["msg_ids"] == [1, 2]
    late = ok(node({"action": 11, "queue": "q", "msg_id": 1}))["message"]
    assert (late["state"], late["ready_at"], late["ttl"], late["retry"], late["priority"]) == (
        "delayed", NOW_S + 60, NOW_S + 120, 7.0, 3)
    assert node.consume()["data"] == "now"
    assert "msg_id" not in node.consume()
    assert node.consume(now=NOW + 60_000)["data"] == "late"


def test_batch_duplicates(node):
    node.produce(dedup_id="k")  # msg_id 1
    resp = node.batch("q", [{"data": "a"}, {"data": "b", "dedup_id": "k"},
                            {"data": "c", "dedup_id": "z"}, {"data": "d", "dedup_id": "z"},
                            {"data": "e", "dedup_id": "y"}], seq=9)
    # a duplicate's entry is the original id; "z" repeated in the batch: the
    # later one is a duplicate of the earlier one
    assert resp == {"action": 1, "queue": "q", "seq": 9, "code": 0,
                    "msg_ids": [2, 1, 3, 3, 4], "duplicates": [1, 3]}
    assert node.data() == [(1, "x"), (2, "a"), (3, "c"), (4, "e")]
    # every item a duplicate: nothing stored, no entry
    log_length = node.log.last_trans_id
    resp = node.batch("q", [{"data": "x", "dedup_id": "y"}, {"data": "x", "dedup_id": "k"},
                            {"data": "x", "dedup_id": "y"}])
    assert (resp["msg_ids"], resp["duplicates"]) == ([4, 1, 4], [0, 1, 2])
    assert node.log.last_trans_id == log_length
    # a single produce recognises ids a batch accepted
    assert node.produce(dedup_id="z")["msg_id"] == 3


def test_batch_into_a_virtual_queue_names_every_created_message():
    node = Node(virtual_queues={"v": ("a", "b")})
    node.produce("b", "b first")  # the members' ids differ
    req = {"action": 1, "queue": "v", "seq": 1,
           "messages": [{"data": "m1"}, {"data": "m2", "dedup_id": "k"},
                        {"data": "m3", "dedup_id": "k"}]}
    assert node(dict(req)) == {"action": 1, "queue": "v", "seq": 1, "code": 0,
                               "msg_ids": [{"a": 1, "b": 2}, {"a": 2, "b": 3},
                                           {"a": 2, "b": 3}],
                               "duplicates": [2]}
    assert node.data("a") == [(1, "m1"), (2, "m2")]
    assert node.data("b") == [(1, "b first"), (2, "m1"), (3, "m2")]
    # the resend: duplicates name the first produce's messages
    resp = node.batch("v", [{"data": "m2", "dedup_id": "k"}, {"data": "m4"}])
    assert resp["msg_ids"] == [{"a": 2, "b": 3}, {"a": 3, "b": 4}]
    assert resp["duplicates"] == [0]
    # and a single produce too
    resp = node.produce("v", dedup_id="k")
    assert (resp["msg_id"], resp["msg_ids"], resp["duplicate"]) == (2, {"a": 2, "b": 3}, True)


def test_a_full_queue_refuses_the_whole_batch(node):
    node.configure(max_size=3)
    node.produce(data="one")
    node.produce(data="two")
    before = node.state()
    req = {"action": 1, "queue": "q", "seq": 1,
           "messages": [{"data": "a"}, {"data": "b"}]}
    assert node(dict(req)) == {"action": 1, "queue": "q", "seq": 1, "code": -1,
                               "reason": "queue full: q"}
    assert node.state() == before
    # a duplicate takes no room: one new message fits
    node.produce(data="three", dedup_id="k")
    node.consume()
    resp = node.batch("q", [{"data": "dup", "dedup_id": "k"}, {"data": "four"}])
    assert (resp["msg_ids"], resp["duplicates"]) == ([3, 4], [0])
    assert node.data() == [(2, "two"), (3, "three"), (4, "four")]
    # a batch that fits exactly after a clear
    ok(node({"action": 6, "queue": "q"}))
    assert node.batch("q", [{"data": "a"}, {"data": "b"}, {"data": "c"}])["msg_ids"] == [5, 6, 7]


def test_a_full_member_refuses_a_virtual_batch_for_every_member():
    node = Node(virtual_queues={"v": ("a", "b")})
    node.configure("b", max_size=2)
    node.produce("b", "b1")
    before = node.state()
    resp = node({"action": 1, "queue": "v", "messages": [{"data": "1"}, {"data": "2"}]})
    error(resp, "queue full: b")
    assert node.state() == before and node.store.get("a") is None
    assert node.batch("v", [{"data": "1"}])["msg_ids"] == [{"a": 1, "b": 2}]


def test_a_bad_item_or_a_time_error_refuses_the_whole_batch(node):
    node.produce(data="kept")
    before = node.state()
    error(node({"action": 1, "queue": "q", "messages": [
        {"data": "a"}, {"data": "b"}, {"data": "c", "delay": 100, "ttl": 50}]}),
        "messages[2]: time error")
    error(node({"action": 1, "queue": "q", "messages": [
        {"data": "a"}, {"data": 5}]}), "messages[1]: data must be a string")
    assert node.state() == before
    still_fine(node)


def test_batch_of_a_thousand_messages(node):
    resp = node.batch("q", [{"data": f"m{i}"} for i in range(1000)])
    assert resp["msg_ids"] == list(range(1, 1001)) and resp["duplicates"] == []
    assert node.log.last_trans_id == 1 and len(node.store.get("q")) == 1000
    got = ok(node({"action": 2, "queue": "q", "count": 1000}))["messages"]
    assert [g["data"] for g in got] == [f"m{i}" for i in range(1000)]


# -- config: max_size, dedup_window, paused ----------------------------------------


def test_config_set_and_read_of_the_new_settings(node):
    req = {"action": 5, "queue": "q", "seq": 1,
           "set": {"max_size": 10, "dedup_window": 1.5, "paused": "in"}}
    settings = dict(DEFAULT_SETTINGS, max_size=10, dedup_window=1.5, paused="in")
    assert node(dict(req)) == dict(req, code=0, config=settings)
    assert node.log.last_trans_id == 1
    assert node.settings() == settings
    # each alone; the others stay
    assert node.configure(paused="out") == dict(settings, paused="out")
    assert node.configure(dedup_window=604800) == dict(settings, paused="out",
                                                       dedup_window=604800)
    assert node.configure(max_size=2**40)["max_size"] == 2**40
    # max_size 0: back to the node's queue_size
    assert node.configure(max_size=0, paused="none", dedup_window=0) == dict(
        DEFAULT_SETTINGS, dedup_window=0)
    assert node.log.last_trans_id == 5
    # an integral float window reads as an integer
    assert node.configure(dedup_window=60.0)["dedup_window"] == 60
    # a queue the config created holds no message
    assert node.data() == []


def test_max_size_bounds_the_queue(node):
    node.configure(max_size=2)
    node.produce()
    node.produce()
    before = node.state()
    error(node({"action": 1, "queue": "q", "data": "x"}), "queue full: q")
    error(node({"action": 1, "queue": "q", "data": "x", "priority": 1}), "queue full: q")
    assert node.state() == before
    mon = ok(node({"action": 4, "queue": "q"}))
    assert (mon["max_size"], mon["size"]) == (2, 2)
    node.configure(max_size=3)
    assert node.produce()["msg_id"] == 3
    # lowered below the size: nothing is dropped, produces are refused
    node.configure(max_size=1)
    assert len(node.store.get("q")) == 3
    error(node({"action": 1, "queue": "q", "data": "x"}), "queue full: q")
    assert node.consume()["msg_id"] == 1


def test_the_node_queue_size_is_the_default_max_size():
    node = Node(queue_size=2)
    assert node.settings()["max_size"] == 2
    node.produce()
    node.produce()
    error(node({"action": 1, "queue": "q", "data": "x"}), "queue full: q")
    assert node.configure(max_size=5)["max_size"] == 5
    node.produce()
    assert node.configure(max_size=0)["max_size"] == 2
    error(node({"action": 1, "queue": "q", "data": "x"}), "queue full: q")


# -- pause ------------------------------------------------------------------------


def test_paused_in_refuses_produce_and_still_delivers(node):
    node.produce(data="before", retry=30)
    node.configure(paused="in")
    before = node.state()
    for req in ({"action": 1, "queue": "q", "data": "x", "seq": 1},
                {"action": 1, "queue": "q", "data": "x", "priority": 3, "seq": 1},
                {"action": 1, "queue": "q", "data": "x", "dedup_id": "k", "seq": 1},
                {"action": 1, "queue": "q", "messages": [{"data": "x"}], "seq": 1}):
        resp = node(req)
        assert (resp["code"], resp["reason"], resp["seq"]) == (-1, "queue paused", 1)
        assert "msg_id" not in resp and "msg_ids" not in resp
    assert node.state() == before
    # a queue paused before it holds anything: refused too, nothing created
    node.configure("fresh", paused="all")
    error(node({"action": 1, "queue": "fresh", "data": "x"}), "queue paused")
    assert node.data("fresh") == []
    # consume, confirm, show still work
    delivery = node.consume()
    assert delivery["data"] == "before"
    assert ok(node({"action": 11, "queue": "q", "msg_id": 1}))["message"]["state"] == "in_flight"
    assert ok(node({"action": 3, "queue": "q", "msg_id": 1,
                    "receipt": delivery["receipt"]}))["found"] is True
    node.configure(paused="none")
    assert node.produce()["msg_id"] == 2


def test_paused_out_delivers_nothing_but_takes_produces(node):
    node.produce(data="a", retry=30)
    node.produce(data="b", retry=30)
    delivery = node.consume()
    node.configure(paused="out")
    assert node.produce(data="c")["msg_id"] == 3
    assert node.batch("q", [{"data": "d"}])["msg_ids"] == [4]
    assert ok(node({"action": 2, "queue": "q", "seq": 1})) == {
        "action": 2, "queue": "q", "seq": 1, "code": 0}
    assert ok(node({"action": 2, "queue": "q", "count": 5}))["messages"] == []
    assert ok(node({"action": 12, "queue": "q", "count": 5}))["messages"] == []
    # a consume of several queues skips it
    node.produce("r", "from r")
    assert ok(node({"action": 2, "queues": ["q", "r"]}))["data"] == "from r"
    # the delivery in flight: touch, nack, show, confirm work as usual
    receipt = delivery["receipt"]
    ok(node({"action": 10, "queue": "q", "msg_id": 1, "receipt": receipt, "lease": 60}))
    ok(node({"action": 9, "queue": "q", "msg_id": 1, "receipt": receipt}))
    assert ok(node({"action": 11, "queue": "q", "msg_id": 1}))["message"]["state"] == "ready"
    assert "msg_id" not in node.consume()  # nacked, ready, but paused
    assert ok(node({"action": 3, "queue": "q", "msg_id": 2}))["found"] is True
    node.configure(paused="none")
    assert [node.consume()["data"] for _ in range(3)] == ["a", "c", "d"]


def test_paused_all(node):
    node.produce(data="a")
    node.configure(paused="all")
    error(node({"action": 1, "queue": "q", "data": "x"}), "queue paused")
    assert "msg_id" not in node.consume()
    node.configure(paused="in")
    assert node.consume()["data"] == "a"


def test_a_virtual_produce_names_the_first_paused_member():
    node = Node(virtual_queues={"v": ("a", "b", "c")})
    node.configure("c", paused="in")
    node.configure("b", paused="all")
    before = node.state()
    error(node({"action": 1, "queue": "v", "data": "x"}), "queue paused: b")
    error(node({"action": 1, "queue": "v", "data": "x", "dedup_id": "k"}), "queue paused: b")
    error(node({"action": 1, "queue": "v", "messages": [{"data": "x"}]}), "queue paused: b")
    assert node.state() == before
    node.configure("b", paused="out")
    error(node({"action": 1, "queue": "v", "data": "x"}), "queue paused: c")
    node.configure("c", paused="none")
    assert node.produce("v")["msg_ids"] == {"a": 1, "b": 1, "c": 1}


def test_a_parked_consume_waits_while_paused_and_is_served_when_resumed(node):
    node.configure(paused="out")
    answers = node.park({"action": 2, "queue": "q", "wait": 20, "seq": "w"})
    node.produce(data="one", now=NOW + 1000)
    node.produce(data="later", delay=2, now=NOW + 1000)
    node.tick(NOW + 3000)  # "later" comes due: still paused
    assert answers == [] and node.service.parked == 1
    # paused for produce too: still nothing out
    node.configure(paused="all", now=NOW + 4000)
    assert answers == [] and node.service.parked == 1
    assert ok(node({"action": 4, "queue": "q"}, NOW + 4000))["waiting"] == 1
    node.configure(paused="in", now=NOW + 5000)  # out resumed (in stays paused)
    assert answers == [{"action": 2, "queue": "q", "wait": 20, "seq": "w", "code": 0,
                        "msg_id": 1, "data": "one", "deliveries": 1}]
    assert node.service.parked == 0
    assert node.consume(now=NOW + 5000)["data"] == "later"


def test_a_parked_consume_on_a_paused_queue_times_out_empty(node):
    node.configure(paused="all")
    answers = node.park({"action": 2, "queue": "q", "wait": 2, "count": 3})
    node.configure(paused="out")
    node.produce()
    node.tick(NOW + 2000)
    assert answers == [{"action": 2, "queue": "q", "wait": 2, "count": 3, "code": 0,
                        "messages": []}]
    assert len(node.store.get("q")) == 1


def test_dead_letters_go_into_a_paused_queue():
    node = Node()
    node.configure("q", max_deliveries=1, dead_letter="dlq")
    node.configure("dlq", paused="all")
    node.produce(retry=30, data="poison")
    receipt = node.consume()["receipt"]
    resp = ok(node({"action": 9, "queue": "q", "msg_id": 1, "receipt": receipt}))
    assert resp["dead_lettered"] is True
    assert node.data("dlq") == [(1, "poison")]


# -- clear --------------------------------------------------------------------------


def test_clear_removes_every_message_and_keeps_the_rest(node):
    node.configure(max_deliveries=3, max_size=10, dedup_window=60)
    node.produce(data="ready", dedup_id="k")
    node.produce(data="delayed", delay=100)
    node.produce(data="in flight", retry=30)
    node.consume()
    node.consume()  # "in flight" now
    node.produce(data="prio", priority=1)
    settings = node.settings()
    req = {"action": 6, "queue": "q", "seq": 3, "colour": "red"}
    assert node(dict(req)) == dict(req, code=0, cleared=3)
    assert node.log.last_trans_id == 8
    assert node.data() == [] and node.settings() == settings
    assert "msg_id" not in node.consume(now=NOW + 200_000)
    # ids never repeat, and the dedup table stays
    assert node.produce()["msg_id"] == 5
    resp = node.produce(dedup_id="k")
    assert (resp["msg_id"], resp["duplicate"]) == (1, True)
    mon = ok(node({"action": 4, "queue": "q"}))
    assert (mon["size"], mon["max_id"], mon["in_flight"]) == (1, 5, 0)


def test_clear_of_nothing_answers_zero_and_appends_nothing():
    node = Node(virtual_queues={"v": ("a", "b")})
    before = node.state()
    req = {"action": 6, "queue": "unknown", "seq": 1}
    assert node(dict(req)) == dict(req, code=0, cleared=0)
    assert node.state() == before and node.store.get("unknown") is None
    # an empty queue too
    node.produce()
    node.consume()
    before = node.state()
    assert ok(node({"action": 6, "queue": "q"}))["cleared"] == 0
    assert node.state() == before
    # a virtual queue is refused
    node.produce("v")
    before = node.state()
    req = {"action": 6, "queue": "v", "seq": 2}
    assert node(dict(req)) == dict(req, code=-1, reason="virtual queue only takes produce")
    assert node.state() == before
    assert ok(node({"action": 6, "queue": "a"}))["cleared"] == 1


def test_clear_of_a_paused_queue(node):
    node.produce()
    node.configure(paused="all")
    assert ok(node({"action": 6, "queue": "q"}))["cleared"] == 1
    assert node.settings()["paused"] == "all"


# -- monitor ----------------------------------------------------------------------


def test_monitor_shows_paused_and_max_size(node):
    for action in (4, 104):
        mon = ok(node({"action": action, "queue": "q"}))
        assert (mon["paused"], mon["max_size"]) == ("none", QUEUE_SIZE)
    node.configure(paused="out", max_size=7)
    for action in (4, 104):
        mon = ok(node({"action": action, "queue": "q"}))
        assert (mon["paused"], mon["max_size"], mon["size"]) == ("out", 7, 0)
    node.configure(paused="in", max_size=0)
    mon = ok(node({"action": 4, "queue": "q"}))
    assert (mon["paused"], mon["max_size"]) == ("in", QUEUE_SIZE)
    # node information alone has no queue fields
    assert "paused" not in ok(node({"action": 4}))


# -- XML queue defaults ---------------------------------------------------------------


def test_xml_queue_defaults_are_in_force_and_config_wins():
    defaults = {"q": {"max_size": 2, "max_deliveries": 5, "dead_letter": "q.dead",
                      "dedup_window_ms": 1500}}
    node = Node(queue_defaults=defaults)
    from_xml = {"max_deliveries": 5, "dead_letter": "q.dead", "max_size": 2,
                "dedup_window": 1.5, "paused": "none"}
    assert node.settings() == from_xml
    assert node.store.get("q") is None  # the read created nothing
    assert ok(node({"action": 4, "queue": "q"}))["max_size"] == 2
    assert node.settings("other") == DEFAULT_SETTINGS
    # in force: max_size, the dedup window
    node.produce(dedup_id="k")
    assert node.produce(dedup_id="k", now=NOW + 1499)["duplicate"] is True
    assert node.produce(dedup_id="k", now=NOW + 1500)["duplicate"] is False
    error(node({"action": 1, "queue": "q", "data": "x"}), "queue full: q")
    # a set wins over them, one by one
    assert node.configure(max_size=3) == dict(from_xml, max_size=3)
    assert node.configure(dead_letter=None, dedup_window=10) == dict(
        from_xml, max_size=3, dead_letter=None, dedup_window=10)
    assert node.produce()["msg_id"] == 3
    # max_size 0: the node's queue_size (not the XML's)
    assert node.configure(max_size=0)["max_size"] == QUEUE_SIZE


def test_xml_queue_defaults_from_a_config_file():
    cfg = parse_xml('<config><queue name="jobs" max_size="3" dedup_window="0"/>'
                    '<virtual_queue name="v"><queue name="jobs"/><queue name="x"/>'
                    '</virtual_queue></config>', "q.xml")
    node = Node(queue_defaults=cfg.queue_defaults, virtual_queues=cfg.virtual_queues)
    assert node.settings("jobs") == dict(DEFAULT_SETTINGS, max_size=3, dedup_window=0)
    assert node.produce("jobs", dedup_id="k")["duplicate"] is False
    assert node.produce("jobs", dedup_id="k")["duplicate"] is False  # window 0: off
    # a virtual queue uses its first real queue's window: off here too
    assert node.produce("v", dedup_id="k")["duplicate"] is False
    error(node({"action": 1, "queue": "v", "data": "x"}), "queue full: jobs")


# -- read index: answers that append no entry ------------------------------------


class _DeferringEngine(LocalEngine):
    """A master whose reads and writes wait until the test releases them,
    around a LocalEngine's store and log (what a cluster master does: the
    entry is applied to its store at once, committed later)."""

    commits_at_once = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reads: list = []
        self.writes: list = []

    def propose(self, entry, done) -> None:
        result = self.commit_now(entry)
        self.writes.append(lambda: done(result, None))

    def read_index(self, done) -> None:
        self.reads.append(done)


def _deferring(**overrides: Any) -> tuple[Service, _DeferringEngine]:
    cfg = Config(**overrides)
    store = Store(queue_size=cfg.queue_size, virtual_queues=cfg.virtual_queues)
    engine = _DeferringEngine(store=store, log=Log(), log_size=cfg.log_size,
                              me=LeaderInfo(node_id=1, host="127.0.0.1", port=1111))
    return Service(config=cfg, store=store, engine=engine), engine


def test_a_duplicate_answer_waits_for_the_read_index():
    service, engine = _deferring(virtual_queues={"v": ("a", "b")})
    out: list = []
    service.handle({"action": 1, "queue": "q", "data": "x", "dedup_id": "k", "seq": 1},
                   NOW, out.append)
    assert out == [] and len(engine.writes) == 1 and engine.reads == []
    log_length = engine.log.last_trans_id
    # the resend finds the (uncommitted) produce: it must not be acknowledged
    # before that produce commits
    requests = [
        {"action": 1, "queue": "q", "data": "x", "dedup_id": "k", "seq": 2},
        {"action": 1, "queue": "q", "messages": [{"data": "x", "dedup_id": "k"}], "seq": 3},
        {"action": 6, "queue": "unknown", "seq": 4},  # cleared: 0
    ]
    for req in requests:
        service.handle(req, NOW + 10, out.append)
    assert out == [] and len(engine.reads) == 3
    assert engine.log.last_trans_id == log_length  # nothing appended
    engine.writes.pop()()
    assert [r["seq"] for r in out] == [1]
    for done in engine.reads:
        done(None, None)
    assert out[1:] == [
        {"action": 1, "queue": "q", "dedup_id": "k", "seq": 2, "code": 0, "msg_id": 1,
         "duplicate": True},
        {"action": 1, "queue": "q", "seq": 3, "code": 0, "msg_ids": [1], "duplicates": [0]},
        {"action": 6, "queue": "unknown", "seq": 4, "code": 0, "cleared": 0},
    ]
    assert engine.log.last_trans_id == log_length


def test_full_and_paused_refusals_wait_for_the_read_index():
    # They rest on the queue's state (its size, a pause set by an entry): a
    # cut-off master must not refuse on what never commits.
    service, engine = _deferring(queue_size=1)
    out: list = []
    service.handle({"action": 1, "queue": "q", "data": "x"}, NOW, out.append)
    service.handle({"action": 5, "queue": "p", "set": {"paused": "in"}}, NOW, out.append)
    for write in engine.writes:
        write()
    assert [r["code"] for r in out] == [0, 0]
    requests = [
        {"action": 1, "queue": "q", "data": "y", "seq": 1},
        {"action": 1, "queue": "q", "messages": [{"data": "y"}], "seq": 2},
        {"action": 1, "queue": "p", "data": "y", "seq": 3},
        {"action": 1, "queue": "p", "data": "y", "priority": 1, "seq": 4},
    ]
    for req in requests:
        service.handle(req, NOW, out.append)
    assert len(out) == 2 and len(engine.reads) == 4
    engine.reads.pop()(None, OUTCOME_UNKNOWN)  # the master lost its role first
    for done in engine.reads:
        done(None, None)
    assert [(r["seq"], r["reason"]) for r in out[2:]] == [
        (4, OUTCOME_UNKNOWN), (1, "queue full: q"), (2, "queue full: q"),
        (3, "queue paused")]


def test_a_batch_with_new_messages_is_a_write_not_a_read():
    service, engine = _deferring()
    out: list = []
    service.handle({"action": 1, "queue": "q", "data": "x", "dedup_id": "k"}, NOW, out.append)
    engine.writes.pop()()
    service.handle({"action": 1, "queue": "q", "messages": [
        {"data": "x", "dedup_id": "k"}, {"data": "y"}]}, NOW, out.append)
    service.handle({"action": 6, "queue": "q"}, NOW, out.append)
    assert engine.reads == [] and len(engine.writes) == 2
    for write in engine.writes:
        write()
    assert (out[1]["msg_ids"], out[1]["duplicates"]) == ([1, 2], [0])
    assert out[2]["cleared"] == 2


def test_duplicate_and_cleared_answers_when_the_master_loses_its_role():
    service, engine = _deferring(virtual_queues={"v": ("a", "b")})
    out: list = []
    service.handle({"action": 1, "queue": "q", "data": "x", "dedup_id": "k"}, NOW, out.append)
    service.handle({"action": 1, "queue": "v", "data": "x", "dedup_id": "k"}, NOW, out.append)
    requests = [
        {"action": 1, "queue": "q", "dedup_id": "k", "seq": 1},
        {"action": 1, "queue": "v", "dedup_id": "k", "seq": 2},
        {"action": 1, "queue": "q", "messages": [{"data": "x", "dedup_id": "k"}], "seq": 3},
        {"action": 6, "queue": "r", "seq": 4},
    ]
    for req in requests:
        service.handle(dict(req, data="resent") if "messages" not in req else dict(req), NOW,
                       out.append)
    assert out == [] and len(engine.reads) == 4
    for done in engine.reads:
        done(None, OUTCOME_UNKNOWN)
    # the error echoes the request (minus what a produce answer drops), never
    # what was read: no msg_id, no duplicate, no cleared
    assert out == [
        {"action": 1, "queue": "q", "dedup_id": "k", "seq": 1, "code": -1,
         "reason": OUTCOME_UNKNOWN},
        {"action": 1, "queue": "v", "dedup_id": "k", "seq": 2, "code": -1,
         "reason": OUTCOME_UNKNOWN},
        {"action": 1, "queue": "q", "seq": 3, "code": -1, "reason": OUTCOME_UNKNOWN},
        {"action": 6, "queue": "r", "seq": 4, "code": -1, "reason": OUTCOME_UNKNOWN},
    ]


# -- every bad input of the new fields ------------------------------------------------

PRIORITY = "priority must be an integer from 0 to 2147483647"
DEDUP = "dedup_id must be a string of 1 to 128 characters"
MESSAGES = "messages must be a list of 1 to 1000 messages"
MAX_SIZE = ("bad value for max_size: must be an integer from 1 to 1099511627776, or 0 for the "
            "node's queue_size")
WINDOW = "bad value for dedup_window: must be a number of seconds from 0 (off) to 604800"
PAUSED = "bad value for paused: must be one of none, in, out, all"


def _p(**fields: Any) -> dict:
    return {"action": 1, "queue": "q", "data": "d", **fields}


def _b(messages: Any, **fields: Any) -> dict:
    return {"action": 1, "queue": "q", "messages": messages, **fields}


def _set(**settings: Any) -> dict:
    return {"action": 5, "queue": "q", "set": settings}


BAD = [
    (_p(priority=-1), PRIORITY),
    (_p(priority=2**31), PRIORITY),
    (_p(priority=2**63), PRIORITY),
    (_p(priority="1"), PRIORITY),
    (_p(priority=1.5), PRIORITY),
    (_p(priority=1.0), PRIORITY),
    (_p(priority=True), PRIORITY),
    (_p(priority=[1]), PRIORITY),
    (_p(priority=-1, dedup_id="k"), PRIORITY),
    (_p(dedup_id=""), DEDUP),
    (_p(dedup_id="k" * 129), DEDUP),
    (_p(dedup_id=5), DEDUP),
    (_p(dedup_id=True), DEDUP),
    (_p(dedup_id=["k"]), DEDUP),
    (_p(dedup_id={"k": 1}), DEDUP),
    (_p(dedup_id="k", data=None), "missing field: data"),
    (_p(dedup_id="k", data=7), "data must be a string"),
    (_p(dedup_id="k", delay="soon"), "delay must be a number"),
    (_p(priority=1, ttl=-1), "ttl must not be negative"),
    (_p(priority=1, retry="x"), "retry must be a number"),
    (_p(priority=1, delay=100, ttl=50), "time error"),
    (_b([]), MESSAGES),
    (_b([{"data": "x"}] * 1001), MESSAGES),
    (_b("x"), MESSAGES),
    (_b({"data": "x"}), MESSAGES),
    (_b(5), MESSAGES),
    (_b(True), MESSAGES),
    (_b(["x"]), "messages[0]: must be an object"),
    (_b([{"data": "a"}] * 3 + [None]), "messages[3]: must be an object"),
    (_b([{"data": "a"}, [{"data": "b"}]]), "messages[1]: must be an object"),
    (_b([{"data": "a"}, {}]), "messages[1]: missing field: data"),
    (_b([{"data": "a"}, {"data": None}]), "messages[1]: missing field: data"),
    (_b([{"data": "a"}] * 3 + [{"data": 5}]), "messages[3]: data must be a string"),
    (_b([{"data": "a", "delay": "1"}]), "messages[0]: delay must be a number"),
    (_b([{"data": "a"}, {"data": "a", "delay": -1}]), "messages[1]: delay must not be negative"),
    (_b([{"data": "a", "delay": 10**12}]), "messages[0]: delay out of range"),
    (_b([{"data": "a", "ttl": []}]), "messages[0]: ttl must be a number"),
    (_b([{"data": "a", "ttl": -0.5}]), "messages[0]: ttl must not be negative"),
    (_b([{"data": "a", "retry": "5"}]), "messages[0]: retry must be a number"),
    (_b([{"data": "a", "retry": -5}]), "messages[0]: retry must not be negative"),
    (_b([{"data": "a"}, {"data": "a", "priority": -1}]), "messages[1]: " + PRIORITY),
    (_b([{"data": "a", "priority": 2**31}]), "messages[0]: " + PRIORITY),
    (_b([{"data": "a", "priority": "1"}]), "messages[0]: " + PRIORITY),
    (_b([{"data": "a", "priority": 1.5}]), "messages[0]: " + PRIORITY),
    (_b([{"data": "a", "priority": True}]), "messages[0]: " + PRIORITY),
    (_b([{"data": "a", "dedup_id": ""}]), "messages[0]: " + DEDUP),
    (_b([{"data": "a"}, {"data": "a", "dedup_id": "k" * 129}]), "messages[1]: " + DEDUP),
    (_b([{"data": "a", "dedup_id": 5}]), "messages[0]: " + DEDUP),
    (_b([{"data": "a"}, {"data": "b"}, {"data": "c", "delay": 100, "ttl": 50}]),
     "messages[2]: time error"),
    (_b([{"data": "a", "delay": 100}], ttl=50), "messages[0]: time error"),
    (_b([{"data": "a"}], priority=-1), PRIORITY),
    (_b([{"data": "a"}], priority="1"), PRIORITY),
    (_b([{"data": "a"}], delay="x"), "delay must be a number"),
    (_b([{"data": "a"}], retry=-1), "retry must not be negative"),
    # (a single node's fast path took the first as a produce of "x" once)
    (_b([{"data": "a"}], data="x"), "give data or messages, not both"),
    (_b([{"data": "a"}], data=""), "give data or messages, not both"),
    (_b([{"data": "a"}], data=5), "give data or messages, not both"),
    (_b([{"data": "a"}], dedup_id="k"), "dedup_id goes on each message of a batch"),
    (_b([{"data": "a"}], dedup_id=""), "dedup_id goes on each message of a batch"),
    (_b(None), "missing field: data"),  # null is absent: a single produce without data
    (_b([{"data": "a"}], queue=None), "missing field: queue"),
    (_set(max_size=-1), MAX_SIZE),
    (_set(max_size=2**40 + 1), MAX_SIZE),
    (_set(max_size="3"), MAX_SIZE),
    (_set(max_size=1.5), MAX_SIZE),
    (_set(max_size=3.0), MAX_SIZE),
    (_set(max_size=True), MAX_SIZE),
    (_set(max_size=None), MAX_SIZE),
    (_set(dedup_window=-1), WINDOW),
    (_set(dedup_window=-0.001), WINDOW),
    (_set(dedup_window=604800.001), WINDOW),
    (_set(dedup_window=10**12), WINDOW),
    (_set(dedup_window="5"), WINDOW),
    (_set(dedup_window=True), WINDOW),
    (_set(dedup_window=None), WINDOW),
    (_set(dedup_window=[5]), WINDOW),
    (_set(paused="yes"), PAUSED),
    (_set(paused="IN"), PAUSED),
    (_set(paused=""), PAUSED),
    (_set(paused=None), PAUSED),
    (_set(paused=1), PAUSED),
    (_set(paused=True), PAUSED),
    (_set(paused=["in"]), PAUSED),
    (_set(max_size=5, paused="sideways"), PAUSED),
    (_set(paused="in", max_size=-1), MAX_SIZE),
    (_set(paused="in", dedup_window=1, colour="red"), "unknown setting: colour"),
    (_set(pause="in"), "unknown setting: pause"),
    (_set(dedup_window_ms=1000), "unknown setting: dedup_window_ms"),
    (_set(queue_size=1), "unknown setting: queue_size"),
    ({"action": 5, "queue": "v", "set": {"paused": "in"}}, "virtual queue only takes produce"),
    ({"action": 5, "queue": "v", "set": {"max_size": 1}}, "virtual queue only takes produce"),
    ({"action": 6}, "missing field: queue"),
    ({"action": 6, "queue": ""}, "queue must not be empty"),
    ({"action": 6, "queue": 5}, "queue must be a string"),
    ({"action": 6, "queue": "v"}, "virtual queue only takes produce"),
]


# The same, as a cluster master takes them: without the single node's fast path.
BAD_GENERAL = [p.values if hasattr(p, "values") else p for p in BAD]


@pytest.mark.parametrize("req,reason", BAD, ids=lambda v: str(v)[:60])
def test_bad_input_is_refused_with_its_reason_and_stores_nothing(req, reason):
    _refused(req, reason, general=False)


@pytest.mark.parametrize("req,reason", BAD_GENERAL, ids=lambda v: str(v)[:60])
def test_bad_input_is_refused_on_the_general_path_too(req, reason):
    _refused(req, reason, general=True)


def _refused(req: dict, reason: str, *, general: bool) -> None:
    node = Node(virtual_queues={"v": ("a", "b")})
    node.produce("q", "kept", dedup_id="k", retry=30)
    node.produce("a", "kept")
    node.configure("q", max_size=50, dedup_window=60)
    before = node.state()
    if general:
        out: list[dict] = []
        node.service.handle_general(dict(req, seq="s"), NOW, out.append)
        (resp,) = out
    else:
        resp = node(dict(req, seq="s"))
    assert (resp["code"], resp["reason"], resp["seq"]) == (-1, reason, "s"), resp
    assert "msg_id" not in resp and "msg_ids" not in resp and "config" not in resp
    assert "cleared" not in resp and "duplicate" not in resp
    assert node.state() == before
    assert node.settings("q") == dict(DEFAULT_SETTINGS, max_size=50, dedup_window=60)
    # the node is still fine: the dedup table, the settings and every form of produce
    resp = node.produce("q", dedup_id="k")
    assert (resp["msg_id"], resp["duplicate"]) == (1, True)
    still_fine(node)
    assert node.produce("v")["msg_ids"] == {"a": 2, "b": 1}
