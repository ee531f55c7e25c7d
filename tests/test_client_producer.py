"""The Python client's producer and queue controls (issue 15, point 6):
produce with priority and dedup_id, produce_batch (split by count and by
bytes, ids in input order, batch-wide defaults, duplicates), produce_many's
batches and its fallback to single produces, clear, pause/resume and
QueuePaused, the new settings of config, and the server's reasons for bad
values.

Three parts: the sans-I/O core (requests, splitting, reading answers,
the exchange's batch window), with no server; produce_many against a
scripted node that predates batch produce; and the whole against a real
node, with the blocking and the asyncio client.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import orjson
import pytest

from procs import wait_until
from qserver.client import (
    BATCH_MAX_BYTES,
    MAX_BATCH,
    AsyncClient,
    BatchResult,
    Client,
    Message,
    QueueFull,
    QueuePaused,
)
from qserver.client.core import (
    SEQ_ALLOWANCE,
    _batch_spans,
    _Exchange,
    _ProducePlan,
    batch_message,
    clear_request,
    pause_request,
    produce_request,
    server_error,
)
from qserver.errors import InvalidArgument, ServerError
from test_client import VIRTUAL, start_node
from test_client_v2 import fake_node  # noqa: F401 (a fixture)

DEADLINE_S = 30.0  # generous: CI is a shared, noisy 2-core machine
NOW = 1_700_000_000.25
PRIORITY_REASON = "priority must be an integer from 0 to 2147483647"
DEDUP_REASON = "dedup_id must be a string of 1 to 128 characters"


def run(coro):
    return asyncio.run(coro)


# -- requests (no server) ------------------------------------------------------------


def test_a_produce_without_the_new_fields_is_todays_request_byte_for_byte():
    old = b'{"action":1,"queue":"q","data":"d","delay":1700000031,"retry":60}'
    assert orjson.dumps(produce_request("q", "d", 30, None, 60, NOW)) == old
    assert orjson.dumps(produce_request("q", "d", 30, None, 60, NOW, priority=None,
                                        dedup_id=None)) == old
    assert produce_request("q", "d", retry=None, now_s=NOW) == {
        "action": 1, "queue": "q", "data": "d"}
    assert produce_request("q", "d", now_s=NOW, priority=0, dedup_id="k") == {
        "action": 1, "queue": "q", "data": "d", "priority": 0, "dedup_id": "k"}
    # ranges and lengths are the server's to judge: sent as given
    assert produce_request("q", "d", priority=-1, dedup_id="")["priority"] == -1
    assert produce_request("q", "d", dedup_id="x" * 500)["dedup_id"] == "x" * 500


@pytest.mark.parametrize("kwargs, match", [
    ({"priority": "1"}, "priority must be an integer"),
    ({"priority": True}, "priority must be an integer"),
    ({"priority": 1.0}, "priority must be an integer"),
    ({"dedup_id": 5}, "dedup_id must be a string"),
    ({"dedup_id": b"k"}, "dedup_id must be a string"),
])
def test_wrong_types_raise_before_sending(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        produce_request("q", "d", **kwargs)


def test_batch_messages_and_their_defaults():
    assert batch_message("plain", 0, NOW, {}) == {"data": "plain"}
    assert batch_message({"data": "x", "delay": 30, "ttl": 60, "retry": 5, "priority": 2,
                          "dedup_id": "k"}, 0, NOW, {}) == {
        "data": "x", "delay": 1_700_000_031, "ttl": 1_700_000_061, "retry": 5, "priority": 2,
        "dedup_id": "k"}
    # an item's own delay past and retry 0 say nothing alone, but beside a
    # batch-wide default they must be said, or the default would apply
    defaults = {"delay": 1_700_000_600, "retry": 60}
    assert batch_message({"data": "x", "delay": 0, "retry": 0}, 0, NOW, defaults) == {
        "data": "x", "delay": 0, "retry": 0}
    assert batch_message({"data": "x", "delay": 0, "retry": 0}, 0, NOW, {}) == {"data": "x"}
    # None is "not given": the default applies
    assert batch_message({"data": "x", "delay": None, "priority": None}, 0, NOW,
                         defaults) == {"data": "x"}
    for item, match in ((5, "item 3: must be a string or a dict"),
                        ({"delay": 1}, "item 3: needs 'data'"),
                        ({"data": "x", "queue": "q"}, "item 3: unknown key"),
                        ({"data": b"x"}, "item 3: data must be a string"),
                        ({"data": "x", "priority": "0"}, "item 3: priority must be an integer"),
                        ({"data": "x", "ttl": "soon"}, "item 3: ttl must be seconds")):
        with pytest.raises(InvalidArgument, match=match):
            batch_message(item, 3, NOW, {})


def test_a_batch_is_split_by_count_and_by_bytes():
    assert MAX_BATCH == 1000  # the protocol's limit
    base = {"action": 1, "queue": "q", "retry": 60}
    assert list(_batch_spans(base, [{"data": "x"}] * 2500, BATCH_MAX_BYTES)) == [
        (0, 1000), (1000, 2000), (2000, 2500)]
    assert list(_batch_spans(base, [{"data": "x"}] * 1000, BATCH_MAX_BYTES)) == [(0, 1000)]
    assert list(_batch_spans(base, [], BATCH_MAX_BYTES)) == []
    messages = [{"data": "y" * 1000} for _ in range(2500)]
    spans = list(_batch_spans(base, messages, BATCH_MAX_BYTES))
    assert [s for s, _ in spans] == [0, 889, 1778] and spans[-1][1] == 2500
    for start, end in spans:  # every request, its seq included, fits
        encoded = orjson.dumps(dict(base, messages=messages[start:end], seq=2**63))
        assert len(encoded) <= BATCH_MAX_BYTES
        assert len(encoded) + 1010 > BATCH_MAX_BYTES or end == 2500  # and is full
    assert SEQ_ALLOWANCE >= len(b',"seq":') + len(str(2**64))
    # a message larger than the limit goes alone (the server says whether it fits)
    big = [{"data": "s"}, {"data": "b" * 5000}, {"data": "s"}]
    assert list(_batch_spans(base, big, 1000)) == [(0, 1), (1, 2), (2, 3)]


def test_produce_batch_requests():
    plan = _ProducePlan.batch("q", ["a", {"data": "b", "priority": 0}] * 1250, 30, None, 60,
                              7, NOW, BATCH_MAX_BYTES)
    assert [len(r["messages"]) for r in plan.requests] == [1000, 1000, 500]
    assert plan.spans == [(0, 1000), (1000, 2000), (2000, 2500)]
    for request in plan.requests:
        assert {k: v for k, v in request.items() if k != "messages"} == {
            "action": 1, "queue": "q", "delay": 1_700_000_031, "retry": 60, "priority": 7}
        assert request["messages"][:2] == [{"data": "a"}, {"data": "b", "priority": 0}]
    assert _ProducePlan.batch("q", [], None, None, None, None, NOW, 100).requests == []
    for bad in ("abc", {"data": "x"}, b"ab", 5):
        with pytest.raises(InvalidArgument, match="items must be a list"):
            _ProducePlan.batch("q", bad, None, None, None, None, NOW, 100)
    with pytest.raises(InvalidArgument, match="queue must be a string"):
        _ProducePlan.batch(None, ["x"], None, None, None, None, NOW, 100)


def test_batch_answers_become_ids_in_input_order():
    plan = _ProducePlan.batch("q", [str(i) for i in range(2500)], None, None, None, None, NOW,
                              BATCH_MAX_BYTES)
    answers = [{"code": 0, "msg_ids": list(range(1, 1001)), "duplicates": []},
               {"code": 0, "msg_ids": list(range(1001, 2001)), "duplicates": [0, 999]},
               {"code": 0, "msg_ids": list(range(2001, 2501)), "duplicates": [3]}]
    plan.settle_batch(answers)
    assert plan.result() == BatchResult(msg_ids=list(range(1, 2501)),
                                        duplicates=[1000, 1999, 2003])
    # a virtual queue: every message created, by real queue
    plan = _ProducePlan.batch("fan", ["a", "b"], None, None, None, None, NOW, BATCH_MAX_BYTES)
    plan.settle_batch([{"code": 0, "msg_ids": [{"x": 1, "y": 4}, {"x": 2, "y": 5}],
                        "duplicates": []}])
    assert plan.result().msg_ids == [{"x": 1, "y": 4}, {"x": 2, "y": 5}]


def test_a_refused_batch_names_the_input_index():
    def refused(reason: str, r: int = 1) -> ServerError:
        plan = _ProducePlan.batch("q", ["x"] * 2500, None, None, None, None, NOW,
                                  BATCH_MAX_BYTES)
        answers: list[dict | None] = [{"code": 0, "msg_ids": list(range(1000)),
                                       "duplicates": []}, None, None]
        answers[r] = {"code": -1, "reason": reason}
        with pytest.raises(ServerError) as info:
            plan.settle_batch(answers)
        return info.value

    error = refused("messages[3]: priority must be an integer from 0 to 2147483647")
    assert (type(error), error.index) == (ServerError, 1003)
    assert error.reason == "messages[3]: priority must be an integer from 0 to 2147483647"
    assert str(error).endswith("(item 1003)")
    assert refused("messages[999]: time error", r=2).index == 2000  # past the request: first
    assert (type(refused("queue full: q")), refused("queue full: q").index) == (QueueFull, 1000)
    assert type(refused("queue paused")) is QueuePaused
    assert refused("queue paused", r=0).index == 0


def test_produce_many_plans_batches_for_runs_of_one_queue():
    items = [{"queue": q, "data": str(i)} for i, q in enumerate("aaabaa")]
    items[1]["priority"] = 3
    plan = _ProducePlan.many(items, NOW, BATCH_MAX_BYTES, batches=True)
    assert plan.requests == [
        {"action": 1, "queue": "a",
         "messages": [{"data": "0"}, {"data": "1", "priority": 3}, {"data": "2"}]},
        {"action": 1, "queue": "b", "data": "3"},
        {"action": 1, "queue": "a", "messages": [{"data": "4"}, {"data": "5"}]}]
    assert plan.spans == [(0, 3), (3, 4), (4, 6)]
    plan.settle_many([{"code": 0, "msg_ids": [1, 2, 3]}, {"code": 0, "msg_id": 1},
                      {"code": 0, "msg_ids": [{"a1": 4, "a2": 9}, 5]}])
    assert plan.first_ids() == [1, 2, 3, 1, 4, 5]
    singles = _ProducePlan.many(items, NOW, BATCH_MAX_BYTES, batches=False)
    assert [r.get("data") for r in singles.requests] == [str(i) for i in range(6)]
    big = _ProducePlan.many([{"queue": "a", "data": "x"}] * 2001, NOW, BATCH_MAX_BYTES, True)
    assert [len(r["messages"]) for r in big.requests] == [1000, 1000, 1]


def test_produce_many_sends_a_refused_batch_again_one_by_one():
    items = [{"queue": q, "data": str(i)} for i, q in enumerate("aaabcc")]
    plan = _ProducePlan.many(items, NOW, BATCH_MAX_BYTES, batches=True)
    # the first batch refused (stored nothing), the single after it stored,
    # the last batch not answered (the exchange stopped)
    again = plan.settle_many([{"code": -1, "reason": "queue full: a"},
                              {"code": 0, "msg_id": 7}, None])
    assert again is False and not plan.old_server
    assert plan.requests == [{"action": 1, "queue": q, "data": str(i)}
                             for i, q in enumerate("aaabcc") if q != "b"]
    assert plan.spans == [(0, 1), (1, 2), (2, 3), (4, 5), (5, 6)]
    # one by one, the first refusal raises with its item's index
    with pytest.raises(QueueFull) as info:
        plan.settle_many([{"code": 0, "msg_id": 1}, {"code": 0, "msg_id": 2},
                          {"code": -1, "reason": "queue full: a"}, None, None])
    assert info.value.index == 2 and info.value.reason == "queue full: a"
    # a node that predates batches says it wants data
    plan = _ProducePlan.many(items, NOW, BATCH_MAX_BYTES, batches=True)
    assert plan.settle_many([{"code": -1, "reason": "missing field: data"}, None, None]) is False
    assert plan.old_server and len(plan.requests) == 6
    assert plan.settle_many([{"code": 0, "msg_id": i} for i in range(6)]) is True
    assert plan.first_ids() == list(range(6))
    # a single refused before any batch: raised at once
    plan = _ProducePlan.many(items, NOW, BATCH_MAX_BYTES, batches=True)
    with pytest.raises(ServerError) as info:
        plan.settle_many([{"code": 0, "msg_ids": [1, 2, 3]}, {"code": -1, "reason": "no"},
                          {"code": -1, "reason": "queue full: c"}])
    assert (info.value.index, info.value.reason) == (3, "no")


def test_the_exchange_keeps_few_batches_in_flight():
    batch = {"action": 1, "queue": "q", "messages": [{"data": "x"}]}
    single = {"action": 1, "queue": "q", "data": "x"}
    requests = [batch] * 3 + [single] * 2 + [batch] * 3
    ex = _Exchange(requests, 200, itertools.count(1), stop_on_error=True, batch_window=2)
    assert ex.take().count(b'"messages"') == 2  # in order: the third batch waits
    assert ex.take() == b""
    ex.feed({"code": 0, "seq": 1})
    sent = ex.take()
    assert sent.count(b'"messages"') == 1 and sent.count(b'"data":"x"') == 3  # batch, 2 singles
    ex.feed({"code": 0, "seq": 2})
    assert ex.take().count(b'"messages"') == 1
    ex.connection_lost()  # everything in flight goes back, the count with it
    assert ex.take().count(b'"messages"') == 2
    # without batch_window, only the window counts
    ex = _Exchange([batch] * 5, 3, itertools.count(1), stop_on_error=True)
    assert ex.take().count(b'"messages"') == 3


def test_queue_controls_requests_and_errors():
    assert clear_request("q") == {"action": 6, "queue": "q"}
    assert pause_request("q") == {"action": 5, "queue": "q", "set": {"paused": "all"}}
    assert pause_request("q", "in")["set"] == {"paused": "in"}
    for bad in ("none", "both", None, "IN"):
        with pytest.raises(InvalidArgument, match="pause what"):
            pause_request("q", bad)
    with pytest.raises(InvalidArgument):
        clear_request(["q"])
    for reason in ("queue paused", "queue paused: fan_b"):
        error = server_error({"code": -1, "reason": reason})
        assert type(error) is QueuePaused and isinstance(error, ServerError)
    for reason in ("queue pausedx", "Queue paused", "bad value for paused: x"):
        assert type(server_error({"code": -1, "reason": reason})) is ServerError
    import qserver.errors
    assert qserver.errors.QueuePaused is QueuePaused and "QueuePaused" in qserver.errors.__all__


# -- produce_many against a node that predates batch produce -----------------------


def old_node(request: dict):
    """A node before issue 15: a produce needs `data`."""
    if request["action"] != 1:
        return {"code": -1, "reason": "invalid action"}
    if "data" not in request:
        return {"code": -1, "reason": "missing field: data"}
    old_node.max_id += 1  # type: ignore[attr-defined]
    return {"msg_id": old_node.max_id}  # type: ignore[attr-defined]


def test_produce_many_falls_back_to_single_produces(fake_node):  # noqa: F811
    old_node.max_id = 0  # type: ignore[attr-defined]
    node = fake_node(old_node)
    items = [{"queue": "q", "data": str(i)} for i in range(5)]
    with Client([("127.0.0.1", node.port)], retry_for=5) as c:
        assert c.produce_many(items) == [1, 2, 3, 4, 5]
        assert ["messages" in r for r in node.requests] == [True] + [False] * 5
        del node.requests[:]
        assert c.produce_many(items) == [6, 7, 8, 9, 10]  # remembered: singles at once
        assert not any("messages" in r for r in node.requests)
        with pytest.raises(ServerError, match="missing field: data"):
            c.produce_batch("q", ["x"])  # asked for batches: no fallback

    async def main() -> None:
        async with AsyncClient([("127.0.0.1", node.port)], retry_for=5) as ac:
            assert await ac.produce_many(items) == [11, 12, 13, 14, 15]
            assert await ac.produce_many(items) == [16, 17, 18, 19, 20]

    del node.requests[:]
    run(main())
    assert ["messages" in r for r in node.requests] == [True] + [False] * 10


# -- one real node -------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = start_node(tmp_path_factory.mktemp("client_producer"), VIRTUAL)
    yield n
    n.kill()


@pytest.fixture
def client(node):
    with Client([f"127.0.0.1:{node.port}"], timeout=10, retry_for=DEADLINE_S) as c:
        yield c


def spy(client) -> list[list[dict]]:
    """The requests of every exchange `client` runs from now on."""
    sent: list[list[dict]] = []
    real = client._exchange

    def exchange(requests, window, **kw):
        sent.append(list(requests))
        return real(requests, window, **kw)

    client._exchange = exchange
    return sent


def drain(client, queue: str) -> list[Message]:
    """Every message of `queue`, in delivery order, confirmed."""
    got = []
    for delivery in client.messages(queue, count=100, stop_when_empty=True):
        got.append(delivery)
        if delivery.receipt:
            delivery.confirm()
    return got


def test_priority_order(client):
    for data, priority in (("p5", 5), ("default", None), ("p0", 0), ("p5b", 5),
                           ("p2000", 2000), ("p1024", 1024), ("max", 2**31 - 1)):
        client.produce("pr", data, priority=priority)
    assert [m.data for m in drain(client, "pr")] == [
        "p0", "p5", "p5b", "default", "p1024", "p2000", "max"]
    # a message's priority shows; in a batch too, and with the batch's default
    msg_id = client.produce("pr", "x", priority=7, retry=60)
    assert client.show("pr", msg_id)["priority"] == 7
    ids = client.produce_batch("pr", ["d", {"data": "own", "priority": 1}], priority=9)
    assert [client.show("pr", i)["priority"] for i in ids] == [9, 1]
    assert [m["data"] for m in client.peek("pr", 3)] == ["own", "x", "d"]


def test_dedup_answers_the_first_id(client):
    first = client.produce("dd", "charge 42", dedup_id="charge-42", retry=60)
    assert client.produce("dd", "charge 42 again", dedup_id="charge-42") == first
    assert client.produce_ids("dd", "again", dedup_id="charge-42") == {"dd": first}
    other = client.produce("dd", "charge 43", dedup_id="charge-43")
    assert other == first + 1
    assert client.monitor("dd")["size"] == 2  # nothing stored for the duplicates
    # in a batch: an id seen before, and one repeated within the batch
    got = client.produce_batch_result("dd", [{"data": "a", "dedup_id": "k1"},
                                             {"data": "b", "dedup_id": "k1"},
                                             {"data": "c", "dedup_id": "charge-43"},
                                             "no id"])
    k1 = other + 1
    assert got == BatchResult(msg_ids=[k1, k1, other, k1 + 1], duplicates=[1, 2])
    assert client.produce_batch("dd", [{"data": "a", "dedup_id": "k1"}]) == [k1]
    assert [m.data for m in drain(client, "dd")] == ["charge 42", "charge 43", "a", "no id"]
    # confirmed and gone: still a duplicate within the window (the table is by id)
    assert client.produce("dd", "late", dedup_id="charge-42") == first
    # a virtual queue has its own table, by its name
    fan = client.produce_ids("fan", "once", dedup_id="f1")
    assert client.produce_ids("fan", "twice", dedup_id="f1") == fan
    assert client.produce_batch("fan", [{"data": "x", "dedup_id": "f1"}]) == [fan]


def test_dedup_window_setting(client):
    assert client.config("dw")["dedup_window"] == 300
    assert client.set_config("dw", dedup_window=0)["dedup_window"] == 0
    a = client.produce("dw", "x", dedup_id="k")
    assert client.produce("dw", "x", dedup_id="k") == a + 1  # off: every produce stored
    assert client.set_config("dw", dedup_window=1)["dedup_window"] == 1
    b = client.produce("dw", "y", dedup_id="j")
    assert client.produce("dw", "y", dedup_id="j") == b
    # the window ends: the same id is stored again (waited for, not slept)
    later = wait_until(lambda: (i := client.produce("dw", "y", dedup_id="j")) != b and i,
                       DEADLINE_S, step_s=0.2)
    assert later == b + 1
    assert client.monitor("dw")["size"] == 4


def test_produce_batch_ids_in_order_split_into_requests(client):
    sent = spy(client)
    items = [f"m{i}" for i in range(2500)]
    ids = client.produce_batch("pb", items, retry=60)
    assert [len(r["messages"]) for r in sent[-1]] == [1000, 1000, 500]
    assert ids == list(range(ids[0], ids[0] + 2500))
    got = drain(client, "pb")
    assert [(m.msg_id, m.data) for m in got] == list(zip(ids, items))
    # split by bytes too: 50 KB messages, 17 to a 900,000-byte request
    big = [f"{i:05}" + "x" * 50_000 for i in range(40)]
    ids = client.produce_batch("pb", big)
    assert [len(r["messages"]) for r in sent[-1]] == [17, 17, 6]
    assert [len(orjson.dumps(r)) <= BATCH_MAX_BYTES for r in sent[-1]] == [True] * 3
    ids2 = client.produce_batch("pb", big[:10], max_request_bytes=120_000, window=1)
    assert [len(r["messages"]) for r in sent[-1]] == [2] * 5
    got = drain(client, "pb")
    assert [(m.msg_id, m.data) for m in got] == list(zip(ids + ids2, big + big[:10]))
    exchanges = len(sent)
    assert client.produce_batch("pb", []) == [] and len(sent) == exchanges  # nothing sent
    assert client.produce_batch("pb", iter(["gen"])) == [ids2[-1] + 1]


def test_batch_defaults_and_each_items_own(client):
    before = time.time()
    own, default = client.produce_batch(
        "bd", [{"data": "own", "delay": 0, "retry": 0, "priority": 3, "ttl": 3600}, "default"],
        delay=600, retry=60, priority=7)
    shown = client.show("bd", own)
    assert (shown["state"], shown["retry"], shown["priority"]) == ("ready", 0, 3)
    assert before + 3590 < shown["ttl"] < time.time() + 3601
    shown = client.show("bd", default)
    assert (shown["state"], shown["retry"], shown["priority"]) == ("delayed", 60, 7)
    assert shown["ready_at"] >= before + 600
    # a virtual queue: every message created, by real queue, in input order
    fan = client.produce_batch("fan", ["x", "y"])
    assert [set(i) for i in fan] == [{"fan_a", "fan_b"}] * 2
    assert fan[1]["fan_a"] == fan[0]["fan_a"] + 1 and fan[1]["fan_b"] == fan[0]["fan_b"] + 1


def test_produce_many_sends_batches(client):
    sent = spy(client)
    items = [{"queue": q, "data": f"{q}{i}", "retry": 60} for i, q in enumerate("aaabaa")]
    items = [dict(item, queue="pm_" + item["queue"]) for item in items]
    ids = client.produce_many(items)
    assert [len(r["messages"]) if "messages" in r else r["data"] for r in sent[-1]] == [
        3, "b3", 2]
    by_queue: dict[str, list] = {"pm_a": [], "pm_b": []}
    for msg_id, item in zip(ids, items):
        by_queue[item["queue"]].append((msg_id, item["data"]))
    for queue, expected in by_queue.items():
        assert [(m.msg_id, m.data) for m in drain(client, queue)] == expected
    many = client.produce_many({"queue": "pm_c", "data": str(i)} for i in range(2500))
    assert many == list(range(1, 2501))
    assert [len(r["messages"]) for r in sent[-1]] == [1000, 1000, 500]
    # a virtual queue: the msg_id in its first real queue, as produce
    fan = client.produce_many([{"queue": "fan", "data": "m"}] * 2)
    assert fan[1] == fan[0] + 1 and client.monitor("fan_a")["max_id"] == fan[1]


def test_produce_many_refused_batches_go_one_by_one(client):
    assert client.set_config("pm_full", max_size=3)["max_size"] == 3
    sent = spy(client)
    with pytest.raises(QueueFull) as info:
        client.produce_many([{"queue": "pm_full", "data": str(i)} for i in range(5)])
    assert info.value.index == 3 and info.value.reason == "queue full: pm_full"
    assert [len(r) for r in sent] == [1, 5]  # the batch, then one by one
    assert [m.data for m in drain(client, "pm_full")] == ["0", "1", "2"]
    # a bad message in a batch: the reason of that item, as without batches
    with pytest.raises(ServerError) as info:
        client.produce_many([{"queue": "pm_bad", "data": "ok"},
                             {"queue": "pm_bad", "data": "x", "priority": -1},
                             {"queue": "pm_bad", "data": "after"}])
    assert (info.value.index, info.value.reason) == (1, PRIORITY_REASON)
    client.pause("pm_paused", "in")
    with pytest.raises(QueuePaused) as info:
        client.produce_many([{"queue": "pm_paused", "data": str(i)} for i in range(3)])
    assert info.value.index == 0
    assert client.monitor("pm_paused")["size"] == 0


def test_clear(client):
    ids = client.produce_batch("cl", [str(i) for i in range(5)], retry=60)
    client.produce("cl", "later", delay=600)
    client.set_config("cl", max_deliveries=3)
    assert len(client.consume("cl", count=2)) == 2  # in flight: cleared too
    assert client.clear("cl") == 6
    mon = client.monitor("cl")
    assert (mon["size"], mon["in_flight"]) == (0, 0)
    assert client.consume("cl") is None and client.peek("cl") == []
    assert client.config("cl")["max_deliveries"] == 3  # settings stay
    assert client.produce("cl", "new") == ids[-1] + 2  # ids never repeat
    assert client.clear("cl") == 1 and client.clear("cl") == 0
    assert client.clear("cl_never_seen") == 0
    with pytest.raises(ServerError) as info:
        client.clear("fan")
    assert info.value.reason == "virtual queue only takes produce"


def test_pause_and_resume(client, node):
    a = client.produce("pz", "before", retry=60)
    config = client.pause("pz", "in")
    assert config["paused"] == "in" and client.config("pz")["paused"] == "in"
    with pytest.raises(QueuePaused) as info:
        client.produce("pz", "refused")
    assert info.value.reason == "queue paused" and info.value.code == -1
    with pytest.raises(QueuePaused) as info:
        client.produce_batch("pz", ["x"] * 3)
    assert info.value.index == 0
    d = client.consume("pz")  # consumers go on
    assert d.msg_id == a and d.nack() and client.show("pz", a)["state"] == "ready"
    assert client.resume("pz")["paused"] == "none"
    b = client.produce("pz", "after")
    # out: nothing delivered, a long poll waits and is served on resume
    assert client.pause("pz", "out")["paused"] == "out"
    assert client.consume("pz") is None and client.peek("pz") == []
    assert client.monitor("pz")["paused"] == "out"
    got: list = []
    with Client([f"127.0.0.1:{node.port}"], retry_for=DEADLINE_S) as other:
        poll = threading.Thread(
            target=lambda: got.append(other.consume("pz", count=5, wait=DEADLINE_S)))
        poll.start()
        wait_until(lambda: client.monitor("pz")["waiting"] == 1, DEADLINE_S)
        client.resume("pz")
        poll.join(DEADLINE_S)
    assert [m.msg_id for m in got[0]] == [a, b]
    # all: both; a virtual queue with a paused member refuses the produce
    c = client.produce("pz", "c")
    assert client.pause("pz")["paused"] == "all"
    with pytest.raises(QueuePaused):
        client.produce("pz", "x")
    assert client.consume("pz") is None
    assert client.confirm("pz", a) is True  # settling goes on
    client.resume("pz")
    assert client.consume("pz").msg_id == c
    client.pause("fan_b", "in")
    try:
        with pytest.raises(QueuePaused) as info:
            client.produce("fan", "x")
        assert info.value.reason == "queue paused: fan_b"
    finally:
        client.resume("fan_b")
    assert client.produce_ids("fan", "x").keys() == {"fan_a", "fan_b"}


def test_config_has_the_new_settings(client):
    config = client.config("cfg")
    assert config == {"max_deliveries": 0, "dead_letter": None, "max_size": config["max_size"],
                      "dedup_window": 300, "paused": "none"}
    node_default = config["max_size"]
    assert node_default > 0
    changed = client.set_config("cfg", max_size=10, dedup_window=1.5, paused="all")
    assert changed == dict(config, max_size=10, dedup_window=1.5, paused="all")
    assert client.set_config("cfg", max_size=0, paused="none") == dict(config,
                                                                          dedup_window=1.5)
    assert client.config("cfg")["max_size"] == node_default


@pytest.mark.parametrize("call, reason", [
    (lambda c: c.produce("bad", "x", priority=-1), PRIORITY_REASON),
    (lambda c: c.produce("bad", "x", priority=2**31), PRIORITY_REASON),
    (lambda c: c.produce("bad", "x", dedup_id=""), DEDUP_REASON),
    (lambda c: c.produce("bad", "x", dedup_id="x" * 129), DEDUP_REASON),
    (lambda c: c.produce_batch("bad", ["x", {"data": "y", "dedup_id": ""}]),
     "messages[1]: " + DEDUP_REASON),
    (lambda c: c.produce_batch("bad", [{"data": "y", "delay": 60, "ttl": 30}]),
     "messages[0]: time error"),
    (lambda c: c.produce_batch("bad", ["x"], priority=2**31), PRIORITY_REASON),
    (lambda c: c.set_config("bad", colour="blue"), "unknown setting: colour"),
])
def test_bad_values_give_the_servers_reason(client, call, reason):
    with pytest.raises(ServerError) as info:
        call(client)
    assert (type(info.value), info.value.code, info.value.reason) == (ServerError, -1, reason)
    assert client.monitor("bad")["size"] == 0


@pytest.mark.parametrize("setting, value", [
    ("max_size", -1), ("max_size", 2**40 + 1), ("max_size", "10"), ("dedup_window", -1),
    ("dedup_window", 604_801), ("paused", "sideways"), ("paused", None)])
def test_bad_settings_give_the_servers_reason(client, setting, value):
    with pytest.raises(ServerError) as info:
        client.set_config("bad", **{setting: value})
    assert info.value.reason.startswith(f"bad value for {setting}: ")


def test_a_bad_message_past_the_first_request(client):
    items: list = ["x"] * 1003
    items[1002] = {"data": "y", "priority": -1}
    with pytest.raises(ServerError) as info:
        client.produce_batch("bad_late", items)
    assert info.value.index == 1002
    assert info.value.reason == "messages[2]: " + PRIORITY_REASON
    assert client.monitor("bad_late")["size"] == 1000  # the first request was stored


def test_wrong_arguments_send_nothing(client):
    sent = spy(client)
    for call in (lambda: client.produce("q", "x", priority="1"),
                 lambda: client.produce("q", "x", dedup_id=7),
                 lambda: client.produce_batch("q", "abc"),
                 lambda: client.produce_batch("q", ["ok", 5]),
                 lambda: client.produce_batch("q", [{"data": "x", "queue": "q"}]),
                 lambda: client.produce_batch("q", ["x"], window=0),
                 lambda: client.produce_batch("q", ["x"], max_request_bytes=0),
                 lambda: client.produce_many([{"queue": "q", "data": "x", "priority": None},
                                              {"queue": "q", "data": "x", "dedup": "k"}]),
                 lambda: client.pause("q", "none")):
        with pytest.raises(InvalidArgument):
            call()
    assert sent == []


def test_async_client(node):
    async def main() -> None:
        async with AsyncClient(f"127.0.0.1:{node.port}", retry_for=DEADLINE_S) as c:
            sent = spy_async(c)
            assert await c.produce("a_pr", "low", priority=2000) == 1
            assert await c.produce("a_pr", "high", priority=0, dedup_id="h") == 2
            assert await c.produce("a_pr", "high again", dedup_id="h") == 2
            assert await c.produce_ids("a_pr", "mid", priority=5) == {"a_pr": 3}
            assert [(await c.consume("a_pr")).data for _ in range(3)] == ["high", "mid", "low"]
            ids = await c.produce_batch("a_pb", [str(i) for i in range(2001)], retry=60)
            assert ids == list(range(1, 2002))
            assert [len(r["messages"]) for r in sent[-1]] == [1000, 1000, 1]
            got = await c.produce_batch_result("a_pb", [{"data": "d", "dedup_id": "k"}] * 2)
            assert got == BatchResult(msg_ids=[2002, 2002], duplicates=[1])
            many = await c.produce_many([{"queue": "a_pm", "data": str(i)} for i in range(3)])
            assert many == [1, 2, 3] and len(sent[-1]) == 1
            assert await c.clear("a_pb") == 2002
            assert await c.clear("a_pm") == 3
            assert (await c.pause("a_pz", "in"))["paused"] == "in"
            with pytest.raises(QueuePaused):
                await c.produce("a_pz", "x")
            with pytest.raises(QueuePaused) as info:
                await c.produce_many([{"queue": "a_pz", "data": "x"}] * 2)
            assert info.value.index == 0
            assert (await c.resume("a_pz"))["paused"] == "none"
            assert await c.produce("a_pz", "x") == 1
            config = await c.set_config("a_pz", dedup_window=60)
            assert config["dedup_window"] == 60 and (await c.config("a_pz")) == config
            with pytest.raises(ServerError) as info:
                await c.produce("a_pz", "x", priority=-1)
            assert info.value.reason == PRIORITY_REASON
            with pytest.raises(ServerError) as info:
                await c.produce_batch("a_pz", ["x"] * 1001 + [{"data": "x", "dedup_id": ""}])
            assert (info.value.index, info.value.reason) == (1001, "messages[1]: " + DEDUP_REASON)
            with pytest.raises(InvalidArgument):
                await c.pause("a_pz", "sideways")
            with pytest.raises(InvalidArgument):
                await c.produce_batch("a_pz", [None])

    run(main())


# -- three nodes: through a slave ------------------------------------------------------


@pytest.mark.parametrize("engine", ["native", "raft"])
def test_through_a_slave(cluster, engine):
    """Every call relayed by a slave: batches of the largest size the client
    sends (the relay must carry them), dedup, produce_many, clear, pause."""
    c = cluster(engine=engine)
    m = c.wait_master()
    slave = next(i for i in (1, 2, 3) if i != m)
    with Client([f"127.0.0.1:{c.port(slave)}"], retry_for=DEADLINE_S) as client:
        big = [f"{i:05}" + "x" * 50_000 for i in range(40)]  # 17 to a request
        ids = client.produce_batch("s_big", big, retry=60)
        assert ids == list(range(1, 41))
        assert [m.data for m in drain(client, "s_big")] == big
        assert client.produce_batch("s_pb", [str(i) for i in range(2500)])[-1] == 2500
        first = client.produce("s_dd", "x", dedup_id="k")
        assert client.produce("s_dd", "again", dedup_id="k") == first
        assert client.produce_batch_result("s_dd", [{"data": "y", "dedup_id": "k"}]) == \
            BatchResult(msg_ids=[first], duplicates=[0])
        many = client.produce_many([{"queue": "s_pm", "data": str(i)} for i in range(1500)])
        assert many == list(range(1, 1501))
        assert client.clear("s_pb") == 2500
        assert client.pause("s_dd", "in")["paused"] == "in"
        with pytest.raises(QueuePaused):
            client.produce("s_dd", "x")
        assert client.resume("s_dd")["paused"] == "none"
        assert client.produce("s_dd", "x") == first + 1
    # the master sees what the slave relayed
    with Client([f"127.0.0.1:{c.port(m)}"], retry_for=DEADLINE_S) as master:
        assert master.monitor("s_pm")["size"] == 1500
        assert master.monitor("s_dd")["size"] == 2


def spy_async(client) -> list[list[dict]]:
    sent: list[list[dict]] = []
    real = client._exchange

    async def exchange(requests, window, **kw):
        sent.append(list(requests))
        return await real(requests, window, **kw)

    client._exchange = exchange
    return sent
