"""The Python client's consumer controls (issue 14, point 5): consume with
queues/count/wait/lease, Delivery objects and their receipts, nack, touch,
show, peek, config, the typed errors, and long polls.

Three parts: the sans-I/O core (request building, answer reading, error
typing, the long-poll policy, Delivery against a recording client), with no
server; the drivers against a scripted TCP node (`FakeNode`: the socket
timeout of a long poll, the connection of its own, "wait out of range");
and the whole against real nodes (one node for the API, sync and async; a
three-node cluster for long polls through a slave and across the loss of
the master).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from datetime import datetime, timedelta

import pytest

from procs import wait_until
from qserver.client import (
    LONG_POLL_S,
    AsyncClient,
    AsyncDelivery,
    Client,
    Delivery,
    Message,
    NotInFlight,
    StaleReceipt,
    consume_request,
)
from qserver.client.core import (
    MIN_LONG_POLL_S,
    POLL_MAX_S,
    POLL_MIN_S,
    _consumed,
    _found,
    _new_fields,
    _Polling,
    _shown,
    config_request,
    confirm_request,
    nack_request,
    peek_request,
    request_wait_s,
    server_error,
    shorter_long_poll,
    show_request,
    touch_request,
)
from qserver.errors import InvalidArgument, QServerClientError, ServerError
from test_client import start_node

DEADLINE_S = 30.0  # generous: CI is a shared, noisy 2-core machine
# How much earlier than asked a timer may fire: the node keeps deadlines in
# whole ms, and an event loop runs a timer within its clock's resolution.
EARLY_S = 0.005


def run(coro):
    return asyncio.run(coro)


# -- requests (no server) ------------------------------------------------------------


def test_consume_requests():
    assert consume_request("q") == {"action": 2, "queue": "q"}  # today's request, byte for byte
    assert consume_request(queues=["a", "b"]) == {"action": 2, "queues": ["a", "b"]}
    assert consume_request(queues=("a",)) == {"action": 2, "queues": ["a"]}
    assert consume_request("q", count=10, wait=2.5, lease=30) == {
        "action": 2, "queue": "q", "count": 10, "wait": 2.5, "lease": 30}
    assert consume_request("q", wait=timedelta(seconds=20), lease=timedelta(minutes=1)) == {
        "action": 2, "queue": "q", "wait": 20.0, "lease": 60.0}
    # no wait, or 0: answered at once, and the field is left out
    assert consume_request("q", wait=0) == consume_request("q", wait=None) == {
        "action": 2, "queue": "q"}
    # names, upper bounds and max_wait are the server's to judge
    assert consume_request("", count=5000, wait=3600)["count"] == 5000


@pytest.mark.parametrize("kwargs, match", [
    ({}, "give a queue"),
    ({"queue": "q", "queues": ["a"]}, "not both"),
    ({"queue": ["a", "b"]}, "queues=\\[...\\]"),
    ({"queues": "ab"}, "list of queue names"),
    ({"queues": []}, "at least one"),
    ({"queues": ["a", 1]}, "queue must be a string"),
    ({"queue": "q", "count": 0}, "count"),
    ({"queue": "q", "count": True}, "count"),
    ({"queue": "q", "count": 2.0}, "count"),
    ({"queue": "q", "wait": -1}, "wait must be at least 0"),
    ({"queue": "q", "wait": float("nan")}, "wait must be seconds"),
    ({"queue": "q", "wait": "5"}, "wait must be seconds"),
    ({"queue": "q", "lease": 0}, "lease must be positive"),
    ({"queue": "q", "lease": timedelta(seconds=-1)}, "lease must be positive"),
])
def test_bad_consume_arguments_raise_before_sending(kwargs, match):
    with pytest.raises(InvalidArgument, match=match) as info:
        consume_request(**kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, QServerClientError)


def test_receipt_requests():
    assert confirm_request("q", 5) == {"action": 3, "queue": "q", "msg_id": 5}
    assert confirm_request("q", 5, "1.5.2") == {"action": 3, "queue": "q", "msg_id": 5,
                                                "receipt": "1.5.2"}
    assert nack_request("q", 5) == {"action": 9, "queue": "q", "msg_id": 5}
    assert nack_request("q", 5, "1.5.2", 30) == {"action": 9, "queue": "q", "msg_id": 5,
                                                 "receipt": "1.5.2", "delay": 30}
    # a relative delay goes as given (the server times it), an absolute one too
    assert nack_request("q", 5, delay=timedelta(seconds=1.5))["delay"] == 1.5
    assert nack_request("q", 5, delay=1_800_000_000)["delay"] == 1_800_000_000
    when = datetime.fromtimestamp(1_800_000_000.5)
    assert nack_request("q", 5, delay=when)["delay"] == 1_800_000_000.5
    assert "delay" not in nack_request("q", 5, delay=0)
    assert touch_request("q", 5, "1.5.2", 60) == {"action": 10, "queue": "q", "msg_id": 5,
                                                  "receipt": "1.5.2", "lease": 60}
    assert touch_request("q", 5) == {"action": 10, "queue": "q", "msg_id": 5}
    for bad in (lambda: confirm_request("q", 5, 7), lambda: nack_request("q", 5, delay=-1),
                lambda: nack_request("q", 5, delay="soon"), lambda: touch_request("q", 5, None, 0),
                lambda: touch_request(5, 5), lambda: nack_request("q", 5, b"1.1.1")):
        with pytest.raises(InvalidArgument):
            bad()


def test_show_peek_config_requests():
    assert show_request("q", 3) == {"action": 11, "queue": "q", "msg_id": 3}
    assert peek_request("q") == {"action": 12, "queue": "q", "count": 1}
    assert peek_request("q", 50) == {"action": 12, "queue": "q", "count": 50}
    assert config_request("q") == {"action": 5, "queue": "q"}
    assert config_request("q", {"max_deliveries": 3, "dead_letter": None}) == {
        "action": 5, "queue": "q", "set": {"max_deliveries": 3, "dead_letter": None}}
    for bad in (lambda: peek_request("q", 0), lambda: config_request("q", {"x": object()})):
        with pytest.raises(InvalidArgument):
            bad()


def test_the_wait_a_request_carries():
    assert request_wait_s(consume_request("q", wait=12)) == 12.0
    assert request_wait_s(consume_request("q")) == 0.0
    assert request_wait_s({"action": 2, "queue": "q", "wait": "x"}) == 0.0
    assert request_wait_s({"action": 1, "queue": "q", "data": "d", "wait": 5}) == 0.0


# -- answers (no server) --------------------------------------------------------------


def test_consume_answers_in_both_forms():
    single = consume_request("q")
    # the single form, with receipt and count of deliveries
    assert _consumed(single, {"code": 0, "action": 2, "queue": "q", "msg_id": 4, "data": "x",
                              "deliveries": 2, "receipt": "3.4.2"}) == [
        {"queue": "q", "msg_id": 4, "data": "x", "deliveries": 2, "receipt": "3.4.2"}]
    # an at-most-once message has no receipt; an older server sends neither
    assert _consumed(single, {"code": 0, "queue": "q", "msg_id": 4, "data": "x",
                              "deliveries": 1})[0]["receipt"] is None
    assert _consumed(single, {"code": 0, "queue": "q", "msg_id": 4, "data": "x"}) == [
        {"queue": "q", "msg_id": 4, "data": "x", "deliveries": None, "receipt": None}]
    assert _consumed(single, {"code": 0, "queue": "q"}) == []
    # several queues: the answer names the message's queue
    many = consume_request(queues=["a", "b"])
    assert _consumed(many, {"code": 0, "queues": ["a", "b"], "queue": "b", "msg_id": 1,
                            "data": "y", "deliveries": 1})[0]["queue"] == "b"
    # the list form, in delivery order
    batch = consume_request(queues=["a", "b"], count=5)
    items = [{"queue": "b", "msg_id": 9, "data": "1", "deliveries": 1, "receipt": "1.9.1"},
             {"queue": "a", "msg_id": 2, "data": "2", "deliveries": 3}]
    got = _consumed(batch, {"code": 0, "messages": items})
    assert [(g["queue"], g["msg_id"], g["receipt"]) for g in got] == [
        ("b", 9, "1.9.1"), ("a", 2, None)]
    assert _consumed(batch, {"code": 0, "messages": []}) == []
    # a server that predates count answers the single form: read as a list of one
    assert len(_consumed(consume_request("q", count=5),
                         {"code": 0, "queue": "q", "msg_id": 1, "data": "z"})) == 1
    with pytest.raises(ServerError) as info:
        _consumed(single, {"code": -1, "reason": "wait out of range"})
    assert info.value.reason == "wait out of range"


def test_errors_are_typed_by_exact_reason():
    for reason, cls in (("stale receipt", StaleReceipt), ("not in flight", NotInFlight)):
        error = server_error({"code": -1, "reason": reason, "msg_id": 3})
        assert type(error) is cls and isinstance(error, ServerError)
        assert (error.code, error.reason, error.response["msg_id"]) == (-1, reason, 3)
    for reason in ("stale receipt: x", "Not in flight", "no such message"):
        assert type(server_error({"code": -1, "reason": reason})) is ServerError
    import qserver.errors
    assert qserver.errors.StaleReceipt is StaleReceipt
    assert {"StaleReceipt", "NotInFlight"} <= set(qserver.errors.__all__)


def test_other_answers():
    assert _found({"code": 0, "found": True}) is True
    assert _found({"code": 0, "found": False}) is False
    assert _found({"code": 0}) is True  # a server that does not say
    request = nack_request("q", 5, "1.5.1", 10)
    answer = dict(request, code=0, seq=7, ready_at=1_700_000_010.0)
    assert _new_fields(request, answer) == {"ready_at": 1_700_000_010.0}
    answer = dict(request, code=0, dead_lettered=True, dead_letter="dlq")
    assert _new_fields(request, answer) == {"dead_lettered": True, "dead_letter": "dlq"}
    with pytest.raises(NotInFlight):
        _new_fields(request, dict(request, code=-1, reason="not in flight"))
    assert _shown({"code": -1, "reason": "no such message"}) is None
    assert _shown({"code": 0, "message": {"msg_id": 1, "state": "ready"}}) == {
        "msg_id": 1, "state": "ready"}
    with pytest.raises(ServerError, match="queue must not be empty"):
        _shown({"code": -1, "reason": "queue must not be empty"})


# -- the long-poll policy (no server) ---------------------------------------------------


def test_a_refused_long_poll_is_halved_then_dropped():
    refused = ServerError(-1, "wait out of range")
    assert shorter_long_poll(20.0, refused) == 10.0
    assert shorter_long_poll(2.0, refused) == MIN_LONG_POLL_S
    assert shorter_long_poll(1.5, refused) == 0.0  # plain polls from here
    assert shorter_long_poll(0.0, refused) is None  # nothing left to shorten: raise
    assert shorter_long_poll(20.0, ServerError(-1, "queue must not be empty")) is None


def test_polling_pauses_only_after_early_empty_answers():
    p = _Polling()
    # a long poll that waited its time, or that delivered: the next at once
    assert p.pause_after(False, 20.0, 20.01) == 0.0
    assert p.pause_after(True, 20.0, 0.001) == 0.0
    # empty at once (a master that lost its role, a server without long
    # polls): the first goes again at once, then pauses double to a ceiling
    pauses = [p.pause_after(False, 20.0, 0.001) for _ in range(10)]
    assert pauses[:3] == [0.0, POLL_MIN_S, 2 * POLL_MIN_S]
    assert max(pauses) == POLL_MAX_S and pauses[-1] == POLL_MAX_S
    assert p.pause_after(True, 20.0, 0.001) == 0.0  # a delivery starts over
    assert p.pause_after(False, 0.0, 0.0) == 0.0  # no wait asked: every empty is early
    assert p.pause_after(False, 0.0, 0.0) == POLL_MIN_S


# -- Message and Delivery (a recording client, no server) --------------------------------


class Recorder:
    """Stands in for a Client: records what a Delivery asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def confirm(self, queue, msg_id, *, receipt=None):
        self.calls.append(("confirm", queue, msg_id, receipt))
        return True

    def nack(self, queue, msg_id, *, receipt=None, delay=None):
        self.calls.append(("nack", queue, msg_id, receipt, delay))
        return {"ready_at": 1.0}

    def touch(self, queue, msg_id, *, receipt=None, lease=None):
        self.calls.append(("touch", queue, msg_id, receipt, lease))
        return 2.0


class AsyncRecorder(Recorder):
    async def confirm(self, queue, msg_id, *, receipt=None):
        return Recorder.confirm(self, queue, msg_id, receipt=receipt)

    async def nack(self, queue, msg_id, *, receipt=None, delay=None):
        return Recorder.nack(self, queue, msg_id, receipt=receipt, delay=delay)

    async def touch(self, queue, msg_id, *, receipt=None, lease=None):
        return Recorder.touch(self, queue, msg_id, receipt=receipt, lease=lease)


def test_a_delivery_is_a_message_and_equals_it():
    rec = Recorder()
    d = Delivery(client=rec, queue="q", msg_id=3, data="x", deliveries=2, receipt="1.3.2")
    plain = Message(queue="q", msg_id=3, data="x")
    assert isinstance(d, Message) and d == plain and plain == d and hash(d) == hash(plain)
    assert d.message is d and (d.queue, d.msg_id, d.data) == ("q", 3, "x")
    assert d != Message(queue="q", msg_id=4, data="x") and d != ("q", 3, "x")
    assert "client" not in repr(d) and "1.3.2" in repr(d)
    assert len({d, plain, Message(queue="q", msg_id=3, data="x", receipt="9.9.9")}) == 1
    with pytest.raises(AttributeError):
        d.receipt = "other"  # frozen


def test_delivery_settles_with_its_receipt():
    rec = Recorder()
    d = Delivery(client=rec, queue="q", msg_id=3, data="x", deliveries=2, receipt="1.3.2")
    assert d.confirm() is True
    assert d.nack(delay=5) == {"ready_at": 1.0}
    assert d.touch(lease=60) == 2.0
    assert rec.calls == [("confirm", "q", 3, "1.3.2"), ("nack", "q", 3, "1.3.2", 5),
                         ("touch", "q", 3, "1.3.2", 60)]
    rec.calls.clear()
    with d as msg:  # confirmed when the block ends normally
        assert msg is d
    assert rec.calls == [("confirm", "q", 3, "1.3.2")]
    rec.calls.clear()
    with pytest.raises(KeyError), d:  # left to the server's retry when it raises
        raise KeyError
    assert rec.calls == []
    # without a receipt (at-most-once, an older server): by id
    Delivery(client=rec, queue="q", msg_id=4, data="y").confirm()
    assert rec.calls == [("confirm", "q", 4, None)]


def test_async_delivery_settles_with_its_receipt():
    rec = AsyncRecorder()
    d = AsyncDelivery(client=rec, queue="q", msg_id=3, data="x", deliveries=1, receipt="1.3.1")
    assert d == Message(queue="q", msg_id=3, data="x")

    async def main() -> None:
        assert await d.confirm() is True
        assert await d.nack(delay=5) == {"ready_at": 1.0}
        assert await d.touch(lease=9) == 2.0
        async with d as msg:
            assert msg is d
        with pytest.raises(KeyError):
            async with d:
                raise KeyError

    run(main())
    assert rec.calls == [("confirm", "q", 3, "1.3.1"), ("nack", "q", 3, "1.3.1", 5),
                         ("touch", "q", 3, "1.3.1", 9), ("confirm", "q", 3, "1.3.1")]


# -- the drivers against a scripted node ---------------------------------------------------


class FakeNode:
    """A TCP server on a free loopback port that answers as `respond(request)`
    says: a dict of answer fields (echoed with the request, code 0 unless
    given), or HOLD: the answer (`held(request)`) waits until `release` is
    set, as a node holds a long poll. One thread per connection, so a held
    request holds only its own connection. Records every request and the
    connections clients closed."""

    HOLD = object()

    def __init__(self, respond, held=None) -> None:
        self.respond = respond
        self.held = held or (lambda request: {"queue": request.get("queue")})
        self.requests: list[dict] = []
        self.holding = threading.Event()  # a request is held
        self.release = threading.Event()
        self.client_closed = threading.Event()  # a client closed a connection
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        decoder = json.JSONDecoder()
        buf = ""
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    self.client_closed.set()
                    return
                buf += data.decode()
                while buf.strip():
                    request, end = decoder.raw_decode(buf.lstrip())
                    buf = buf.lstrip()[end:]
                    self.requests.append(request)
                    fields = self.respond(request)
                    if fields is FakeNode.HOLD:
                        self.holding.set()
                        if not self.release.wait(DEADLINE_S):
                            return
                        fields = self.held(request)
                    answer = {**request, "code": 0, **fields}
                    conn.sendall(json.dumps(answer).encode() + b"\n")
        except OSError:
            return  # closed at the end of the test

    def close(self) -> None:
        self.release.set()
        # shutdown, not only close: a thread blocked in accept() or recv()
        # on a socket another thread closes is not woken (Linux).
        for sock in [self._listener, *self._conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected any more
            sock.close()
        for t in self._threads:
            t.join(DEADLINE_S)
            assert not t.is_alive()


@pytest.fixture
def fake_node():
    nodes: list[FakeNode] = []

    def make(respond, held=None) -> FakeNode:
        node = FakeNode(respond, held)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.close()


def hold_consumes(request: dict):
    """A node that holds every consume with a wait, and answers the rest."""
    if request["action"] == 2 and request.get("wait"):
        return FakeNode.HOLD
    if request["action"] == 1:
        return {"msg_id": 1}
    return {}


def delivered(request: dict) -> dict:
    return {"queue": request["queue"], "msg_id": 7, "data": "late", "deliveries": 1,
            "receipt": "1.7.1"}


def test_a_long_poll_waits_timeout_plus_wait_on_a_connection_of_its_own(fake_node):
    node = fake_node(hold_consumes, delivered)
    got: list = []
    with Client([("127.0.0.1", node.port)], timeout=0.2, retry_for=0) as client:
        poller = threading.Thread(target=lambda: got.append(client.consume("q", wait=10)))
        poller.start()
        assert node.holding.wait(DEADLINE_S)
        # the client's timeout (0.2 s) passes many times over: it keeps waiting
        assert not node.client_closed.wait(1.0)
        # meanwhile the client's other calls go on, on its other connection
        assert client.produce("q", "x") == 1
        node.release.set()
        poller.join(DEADLINE_S)
    assert got == [Message(queue="q", msg_id=7, data="late")]
    assert (got[0].receipt, got[0].deliveries) == ("1.7.1", 1)
    assert [r["action"] for r in node.requests] == [2, 1]
    assert node.requests[0]["wait"] == 10


def test_a_long_poll_gives_up_after_timeout_plus_wait(fake_node):
    node = fake_node(hold_consumes)
    with Client([("127.0.0.1", node.port)], timeout=0.2, retry_for=0) as client:
        start = time.monotonic()
        with pytest.raises(QServerClientError, match="no answer within 0.7"):
            client.consume("q", wait=0.5)
        assert time.monotonic() - start >= 0.7 - EARLY_S


def test_async_long_poll_leaves_other_calls_free(fake_node):
    node = fake_node(hold_consumes, delivered)

    async def main() -> None:
        async with AsyncClient([("127.0.0.1", node.port)], timeout=0.2, retry_for=0) as c:
            poll = asyncio.create_task(c.consume("q", wait=10, count=5))
            await asyncio.to_thread(node.holding.wait, DEADLINE_S)
            assert not await asyncio.to_thread(node.client_closed.wait, 1.0)
            assert await c.produce("q", "x") == 1  # not behind the long poll
            assert not poll.done()
            node.release.set()
            got = await poll
            # a server that predates count answers the single form: a list of one
            assert [(d.msg_id, d.receipt) for d in got] == [(7, "1.7.1")]
            assert isinstance(got[0], AsyncDelivery)
            # a cancelled long poll's connection is closed, not kept: the
            # next long poll does not read the answer it was owed
            node.release.clear()
            poll = asyncio.create_task(c.consume("q", wait=10))
            await asyncio.to_thread(wait_until, lambda: len(node.requests) == 3, DEADLINE_S)
            poll.cancel()
            with pytest.raises(asyncio.CancelledError):
                await poll
            node.release.set()
            again = await c.consume("q2", wait=10)
            assert again is not None and again.queue == "q2"

    run(main())


def test_messages_halve_a_long_poll_the_node_refuses(fake_node):
    max_wait = 6

    def respond(request: dict):
        if request["action"] == 2 and request.get("wait", 0) > max_wait:
            return {"code": -1, "reason": "wait out of range"}
        if request["action"] == 2:
            return {"msg_id": len(node.requests), "data": "m", "deliveries": 1}
        return {}

    node = fake_node(respond)
    with Client([("127.0.0.1", node.port)], retry_for=0) as client:
        assert client.long_poll == LONG_POLL_S
        it = client.messages("q")
        first = next(it)
        assert first.data == "m" and client.long_poll == LONG_POLL_S / 4
        next(it)
        it.close()
        waits = [r.get("wait") for r in node.requests if r["action"] == 2]
        assert waits == [20.0, 10.0, 5.0, 5.0]
        # a consume with an explicit wait is the caller's: refused, raised
        with pytest.raises(ServerError, match="wait out of range"):
            client.consume("q", wait=7)
    with pytest.raises(InvalidArgument):
        Client("127.0.0.1:1", long_poll=-1)


# -- one real node ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = start_node(tmp_path_factory.mktemp("client_v2"))
    yield n
    n.kill()


@pytest.fixture
def client(node):
    with Client([f"127.0.0.1:{node.port}"], timeout=10, retry_for=DEADLINE_S) as c:
        yield c


def test_receipts_confirm_only_their_delivery(client):
    msg_id = client.produce("r1", "job", retry=60)
    d = client.consume("r1", lease=0.5)
    assert isinstance(d, Delivery) and d == Message(queue="r1", msg_id=msg_id, data="job")
    assert d.deliveries == 1 and isinstance(d.receipt, str) and d.receipt
    # the lease runs out: delivered again, with a new receipt
    again = client.consume("r1", wait=DEADLINE_S)
    assert again == d and again.deliveries == 2 and again.receipt != d.receipt
    with pytest.raises(StaleReceipt) as info:
        d.confirm()  # too late: not this consumer's delivery any more
    assert info.value.reason == "stale receipt"
    assert client.show("r1", msg_id)["state"] == "in_flight"  # nothing changed
    assert again.confirm() is True
    assert client.show("r1", msg_id) is None
    with pytest.raises(StaleReceipt):
        again.confirm()  # confirmed already
    assert client.confirm("r1", msg_id) is False  # by id: not an error, nothing found
    assert client.confirm("r1", 10**9) is False


def test_nack_and_touch(client):
    msg_id = client.produce("r2", "job", retry=60)
    d = client.consume("r2")
    before = time.time()
    retry_at = d.touch(lease=120)
    assert before + 119 <= retry_at <= time.time() + 121
    shown = client.show("r2", msg_id)
    assert shown["state"] == "in_flight" and shown["deliveries"] == 1
    assert math.isclose(shown["retry_at"], retry_at, abs_tol=0.01)
    result = d.nack()
    assert set(result) == {"ready_at"} and result["ready_at"] <= time.time() + 1
    with pytest.raises(NotInFlight):
        d.nack()  # the delivery ended with the nack: the message is ready
    with pytest.raises(NotInFlight):
        client.nack("r2", msg_id)  # ready, not in flight
    with pytest.raises(NotInFlight) as info:
        client.touch("r2", 10**9, lease=5)
    assert info.value.reason == "not in flight"
    d2 = client.consume("r2")
    assert d2.deliveries == 2 and client.show("r2", msg_id)["nacks"] == 1
    ready_at = d2.nack(delay=timedelta(minutes=1))["ready_at"]
    assert time.time() + 55 < ready_at
    shown = client.show("r2", msg_id)
    assert shown["state"] == "delayed" and math.isclose(shown["ready_at"], ready_at,
                                                        abs_tol=0.01)
    assert client.consume("r2") is None


def test_count_and_queues(client):
    ids = client.produce_many([{"queue": "r3b", "data": str(i), "retry": 60} for i in range(5)])
    got = client.consume("r3b", count=3)
    assert [d.msg_id for d in got] == ids[:3] and all(d.queue == "r3b" for d in got)
    assert all(isinstance(d, Delivery) and d.deliveries == 1 and d.receipt for d in got)
    assert len({d.receipt for d in got}) == 3
    rest = client.consume(queues=["r3a", "r3b"], count=10)
    assert [d.msg_id for d in rest] == ids[3:]
    assert client.consume(queues=["r3a", "r3b"], count=10) == []
    assert client.consume(queues=["r3a", "r3b"]) is None
    client.produce("r3b", "b")
    a_id = client.produce("r3a", "a")
    first = client.consume(queues=["r3a", "r3b"])  # the first listed queue with a message
    assert (first.queue, first.msg_id, first.data) == ("r3a", a_id, "a")
    assert first.receipt is None  # at-most-once: gone once delivered
    assert client.consume(queues=["r3a", "r3b"]).queue == "r3b"
    for d in got + rest:
        assert d.confirm() is True
    assert client.monitor("r3b")["size"] == 0
    with pytest.raises(ServerError, match="count"):
        client.consume("r3b", count=1001)


def test_show_peek_config(client):
    assert client.show("r4", 1) is None
    ids = client.produce_many([{"queue": "r4", "data": f"m{i}", "retry": 30} for i in range(3)])
    delayed = client.produce("r4", "later", delay=600)
    shown = client.show("r4", ids[0])
    assert shown["msg_id"] == ids[0] and shown["state"] == "ready" and shown["data"] == "m0"
    assert (shown["deliveries"], shown["nacks"], shown["retry"]) == (0, 0, 30)
    assert client.show("r4", delayed)["state"] == "delayed"
    peeked = client.peek("r4", 2)
    assert [m["msg_id"] for m in peeked] == ids[:2] and peeked[0]["queue"] == "r4"
    assert [m["msg_id"] for m in client.peek("r4")] == ids[:1]
    assert client.monitor("r4")["in_flight"] == 0  # peek changes nothing
    rest = {"max_size": 1_000_000, "dedup_window": 300, "paused": "none"}  # issue 15's
    assert client.config("r4") == {"max_deliveries": 0, "dead_letter": None, **rest}
    assert client.set_config("r4", max_deliveries=3, dead_letter="r4_dead") == {
        "max_deliveries": 3, "dead_letter": "r4_dead", **rest}
    assert client.set_config("r4", dead_letter=None) == {"max_deliveries": 3,
                                                        "dead_letter": None, **rest}
    assert client.config("r4")["max_deliveries"] == 3
    with pytest.raises(ServerError) as info:
        client.set_config("r4", paused_forever=True)
    assert info.value.reason == "unknown setting: paused_forever"
    with pytest.raises(ServerError, match="bad value for max_deliveries"):
        client.set_config("r4", max_deliveries=-1)
    with pytest.raises(InvalidArgument):
        client.set_config("r4")


def test_dead_letters(client):
    client.set_config("r5", max_deliveries=2, dead_letter="r5_dead")
    msg_id = client.produce("r5", "poison", retry=60)
    first = client.consume("r5")
    assert set(first.nack()) == {"ready_at"}
    second = client.consume("r5")
    assert second.deliveries == 2
    result = second.nack()  # at the limit: it leaves the queue
    assert result == {"dead_lettered": True, "dead_letter": "r5_dead"}
    assert client.show("r5", msg_id) is None
    [peeked] = client.peek("r5_dead", 10)
    assert (peeked["queue"], peeked["data"], peeked["state"]) == ("r5_dead", "poison", "ready")
    info = client.show("r5_dead", peeked["msg_id"])
    assert (info["origin_queue"], info["origin_msg_id"], info["dead_letter_reason"]) == (
        "r5", msg_id, "max_deliveries")
    dead = client.consume("r5_dead")
    assert (dead.msg_id, dead.data) == (peeked["msg_id"], "poison")
    # without a dead-letter queue, a nack at the limit deletes
    client.set_config("r5b", max_deliveries=1)
    client.produce("r5b", "poison", retry=60)
    assert client.consume("r5b").nack() == {"deleted": True}
    assert client.monitor("r5")["dead_lettered"] == 1


def test_long_polls(client):
    # a parked consume is answered by a produce, from the same client
    got: list = []
    poller = threading.Thread(target=lambda: got.append(client.consume("r6", wait=DEADLINE_S)))
    start = time.monotonic()
    poller.start()
    wait_until(lambda: client.monitor("r6").get("waiting") == 1, DEADLINE_S)
    client.produce("r6", "wake up")
    poller.join(DEADLINE_S)
    assert got[0].data == "wake up" and time.monotonic() - start < DEADLINE_S
    # an empty long poll ends after its wait
    start = time.monotonic()
    assert client.consume("r6", wait=0.5, count=3) == []
    assert time.monotonic() - start >= 0.5 - EARLY_S
    with pytest.raises(ServerError, match="wait out of range"):
        client.consume("r6", wait=31)  # the node's default max_wait is 30


def test_messages_long_poll_and_batch(client):
    seen: list[str] = []
    done = threading.Event()

    def consume() -> None:
        with Client([f"127.0.0.1:{client.address[1]}"], retry_for=DEADLINE_S) as c:
            for delivery in c.messages("r7", count=10, lease=30):
                with delivery as msg:
                    seen.append(msg.data)
                if len(seen) == 12:
                    done.set()
                    return

    worker = threading.Thread(target=consume)
    worker.start()
    # parked: one waiting consume, nothing sent meanwhile
    wait_until(lambda: client.monitor("r7").get("waiting") == 1, DEADLINE_S)
    client.produce_many([{"queue": "r7", "data": str(i), "retry": 60} for i in range(12)])
    assert done.wait(DEADLINE_S)
    worker.join(DEADLINE_S)
    assert sorted(seen, key=int) == [str(i) for i in range(12)]
    wait_until(lambda: client.monitor("r7")["size"] == 0, DEADLINE_S)  # all confirmed
    # stop_when_empty: batches until an empty one
    client.produce_many([{"queue": "r7", "data": str(i), "retry": 60} for i in range(25)])
    got = [d.data for d in client.messages("r7", count=10, stop_when_empty=True)
           if d.confirm()]
    assert got == [str(i) for i in range(25)]


def test_process_waits_with_long_polls(client):
    client.produce("r8", "fails once", retry=60)
    with pytest.raises(RuntimeError):
        with client.process("r8", lease=0.5) as msg:
            raise RuntimeError("handler failed")
    with client.process("r8", wait=DEADLINE_S) as again:  # back after the 0.5 s lease
        assert again == msg and again.deliveries == 2
    assert client.monitor("r8")["size"] == 0


def test_the_helpers_adapt_to_the_node_max_wait(node):
    with Client([f"127.0.0.1:{node.port}"], retry_for=DEADLINE_S, long_poll=60) as c:
        c.produce("r9", "x")
        assert next(c.messages("r9")).data == "x"
        assert c.long_poll == 30  # halved once: the node's max_wait is 30


def test_async_client_v2(node):
    async def main() -> None:
        async with AsyncClient(f"127.0.0.1:{node.port}", retry_for=DEADLINE_S) as c:
            ids = await c.produce_many([{"queue": "ra", "data": str(i), "retry": 60}
                                        for i in range(4)])
            batch = await c.consume("ra", count=2, lease=30)
            assert [d.msg_id for d in batch] == ids[:2]
            assert all(isinstance(d, AsyncDelivery) and d.receipt for d in batch)
            assert (await batch[0].touch(lease=90)) > time.time() + 80
            assert "ready_at" in await batch[1].nack()
            assert await batch[0].confirm() is True
            assert (await c.show("ra", ids[0])) is None
            assert sorted(m["msg_id"] for m in await c.peek("ra", 3)) == ids[1:]
            assert (await c.set_config("ra", max_deliveries=5))["max_deliveries"] == 5
            assert (await c.config("ra"))["max_deliveries"] == 5
            with pytest.raises(NotInFlight):
                await c.touch("ra", ids[3])
            got = []
            async for d in c.messages(queues=["ra_x", "ra"], stop_when_empty=True):
                async with d as msg:
                    got.append(msg.msg_id)
            assert sorted(got) == ids[1:]
            # delivered again (and confirmed) since its nack: the receipt is stale
            with pytest.raises(StaleReceipt):
                await batch[1].confirm()

            # a long poll in one task, a produce in another, one client
            async def first() -> AsyncDelivery:
                async for d in c.messages("ra_wait"):
                    return d
                raise AssertionError("unreachable")

            task = asyncio.create_task(first())
            with Client(f"127.0.0.1:{node.port}", retry_for=DEADLINE_S) as probe:
                await asyncio.to_thread(
                    wait_until, lambda: probe.monitor("ra_wait").get("waiting") == 1,
                    DEADLINE_S)
            await c.produce("ra_wait", "woken")
            d = await asyncio.wait_for(task, DEADLINE_S)
            assert d.data == "woken"

    run(main())


# -- three nodes ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["native", "raft"])
def test_long_poll_through_a_slave_and_across_the_loss_of_the_master(cluster, engine):
    cluster = cluster(engine=engine)
    m = cluster.wait_master()
    slave = next(i for i in range(1, 4) if i != m)
    hosts = [f"127.0.0.1:{cluster.port(i)}" for i in [slave] + [i for i in (1, 2, 3)
                                                                 if i != slave]]
    got: list = []
    errors: list[BaseException] = []

    def consume(n: int) -> None:
        try:
            with Client(hosts, retry_for=DEADLINE_S) as c:
                for delivery in c.messages("ha_poll"):
                    with delivery as msg:
                        data = msg.data
                    # Once confirmed: the master is killed when `got` grows,
                    # and a confirm in flight then would be retried on the
                    # next master, where its receipt is stale if the first
                    # try was applied.
                    got.append(data)
                    if len(got) == n:
                        return
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    worker = threading.Thread(target=consume, args=(2,), daemon=True)
    worker.start()
    with Client([f"127.0.0.1:{cluster.port(m)}"], retry_for=DEADLINE_S) as producer:
        # parked on the master, relayed by the slave
        wait_until(lambda: producer.monitor("ha_poll").get("waiting") == 1 or errors,
                   DEADLINE_S)
        producer.produce("ha_poll", "one", retry=60)
        wait_until(lambda: got or errors, DEADLINE_S)
    assert got == ["one"] and not errors
    # the master goes; the consumer's next long poll finds the new one
    cluster.kill(m)
    alive = [i for i in (1, 2, 3) if i != m]
    new = cluster.wait_master(alive=alive)
    with Client([f"127.0.0.1:{cluster.port(new)}"], retry_for=DEADLINE_S) as producer:
        producer.produce("ha_poll", "two", retry=60)
    worker.join(DEADLINE_S)
    assert not worker.is_alive() and not errors, errors
    assert got == ["one", "two"]


def test_long_polls_follow_a_redirect_once(cluster):
    c = cluster(extra='<replication forward_request="0"/>\n')
    m = c.wait_master()
    slave = next(i for i in range(1, 4) if i != m)
    master = ("127.0.0.1", c.port(m))
    with Client([f"127.0.0.1:{c.port(slave)}"], retry_for=DEADLINE_S) as client, \
            Client([master], retry_for=DEADLINE_S) as producer:
        producer.produce("redir_poll", "first", retry=60)
        it = client.messages("redir_poll", count=5)
        assert next(it).data == "first"
        # the slave redirected the long poll to the master, where the next
        # one goes at once: it parks there
        second = threading.Thread(target=lambda: got.append(next(it).data))
        got: list[str] = []
        second.start()
        wait_until(lambda: producer.monitor("redir_poll").get("waiting") == 1, DEADLINE_S)
        assert client._poll_home == master
        producer.produce("redir_poll", "second", retry=60)
        second.join(DEADLINE_S)
        assert got == ["second"]
        it.close()
