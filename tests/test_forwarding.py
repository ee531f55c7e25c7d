"""The slave -> master relay (qserver.engines.forwarding), which both engines
use: every forwarded request is answered exactly once, by the master or by
a failure that says the outcome is unknown; the timeout is per request.

The network here is a stand-in that records what is sent (the Forwarder
uses only `connected` and `send`); forwarding over real links and real
processes is tested in test_cluster_integration.py and test_raft_cluster.py.
"""

from __future__ import annotations

import asyncio

import pytest

from qserver.engines.base import Session
from qserver.engines.forwarding import FORWARD_TIMEOUT_S, Forwarder
from qserver.engines.messages import Forward, ForwardCancel, ForwardReply, message_from_peer


class FakeNet:
    def __init__(self, up: set[int]) -> None:
        self.up = up
        self.sent: list[tuple[int, object]] = []
        self.refuse = False  # send() fails (a full or broken link)

    def connected(self, peer_id: int) -> bool:
        return peer_id in self.up

    def send(self, peer_id: int, wire: object) -> bool:
        if self.refuse or peer_id not in self.up:
            return False
        self.sent.append((peer_id, wire))
        return True


def make(up=(1, 3), node_id=2) -> tuple[Forwarder, FakeNet]:
    net = FakeNet(set(up))
    return Forwarder(node_id=node_id, net=net, vote_id=lambda: 7), net


def decode(peer_id: int, wire: object):
    msg = message_from_peer(peer_id, wire)
    assert not isinstance(msg, str), msg
    return msg


def reply_to(fwd: Forwarder, sent_wire: object, response: dict) -> None:
    msg = decode(fwd.node_id, sent_wire)
    assert type(msg) is Forward
    fwd.on_reply(ForwardReply(vote_id=7, node_id=1, request_id=msg.request_id,
                              response=response))


def run(coro):
    return asyncio.run(coro)


def test_the_masters_answer_reaches_the_client_once():
    async def main():
        fwd, net = make()
        answers: list[dict] = []
        assert fwd.forward(1, {"action": 1, "queue": "q"}, answers.append)
        (peer, wire), = net.sent
        assert peer == 1
        msg = decode(2, wire)
        assert type(msg) is Forward and msg.vote_id == 7 and msg.node_id == 2
        assert msg.request == {"action": 1, "queue": "q"}
        reply_to(fwd, wire, {"code": 0, "msg_id": 5})
        reply_to(fwd, wire, {"code": 0, "msg_id": 6})  # a duplicate reply is dropped
        assert answers == [{"code": 0, "msg_id": 5}]
        assert fwd.waiting == 0

    run(main())


def test_no_link_to_the_master_is_refused_without_an_answer():
    async def main():
        fwd, net = make(up=(3,))
        answers: list[dict] = []
        assert not fwd.forward(1, {"action": 1}, answers.append)  # link down
        net.refuse = True
        assert not fwd.forward(3, {"action": 1}, answers.append)  # send failed
        assert answers == [] and fwd.waiting == 0

    run(main())


def test_timeouts_of_many_requests_fail_exactly_the_unanswered(monkeypatch):
    """One timer for every forward: requests answered in time stay
    answered once, those left unanswered fail at their deadline, whatever
    the mix of default and custom timeouts and the order of answers."""
    from qserver.engines import forwarding

    monkeypatch.setattr(forwarding, "FORWARD_TIMEOUT_S", 0.2)

    async def main():
        fwd, net = make()
        answers: dict[int, list[dict]] = {i: [] for i in range(40)}
        all_answered = asyncio.Event()

        def answer_of(i: int):
            def respond(response: dict) -> None:
                answers[i].append(response)
                if all(answers.values()):
                    all_answered.set()
            return respond

        for i in range(40):
            timeout = None if i % 3 else 0.1 + (i % 4) * 0.05  # custom ones, out of order
            assert fwd.forward(1, {"action": 1, "seq": i}, answer_of(i), timeout_s=timeout)
        for i in range(0, 40, 2):  # every even one answered, last ones first
            reply_to(fwd, net.sent[38 - i][1], {"code": 0, "seq": 38 - i})
        await asyncio.wait_for(all_answered.wait(), 30)
        assert fwd.waiting == 0
        for i in range(40):
            if i % 2 == 0:
                assert answers[i] == [{"code": 0, "seq": i}]
            else:
                assert answers[i] == [{"action": 1, "seq": i, "code": -1,
                                       "reason": "forward timeout; outcome unknown"}]
        # later forwards are timed out too (the timer is armed again)
        late = asyncio.get_running_loop().create_future()
        assert fwd.forward(1, {"action": 1}, late.set_result)
        assert (await asyncio.wait_for(late, 30))["code"] == -1
        fwd.close()

    run(main())


def test_the_timeout_is_per_request():
    async def main():
        fwd, net = make()
        short: list[dict] = []
        default: list[dict] = []
        answered = asyncio.Event()

        def on_short(answer: dict) -> None:
            short.append(answer)
            answered.set()

        assert fwd.forward(1, {"action": 2, "seq": 7}, on_short, timeout_s=0.05)
        assert fwd.forward(1, {"action": 2}, default.append)
        await asyncio.wait_for(answered.wait(), 30)
        # A failure echoes the request (its seq), as every answer does.
        assert short == [{"action": 2, "seq": 7, "code": -1,
                          "reason": "forward timeout; outcome unknown"}]
        assert default == []  # FORWARD_TIMEOUT_S, far away
        assert FORWARD_TIMEOUT_S >= 1
        reply_to(fwd, net.sent[0][1], {"code": 0})  # too late: already answered
        assert len(short) == 1
        reply_to(fwd, net.sent[1][1], {"code": 0})
        assert default == [{"code": 0}]

    run(main())


def test_a_broken_link_fails_only_the_requests_sent_over_it():
    async def main():
        fwd, _ = make(up=(1, 3))
        to_1: list[dict] = []
        to_3: list[dict] = []
        assert fwd.forward(1, {"action": 1, "seq": 1, "data": "x"}, to_1.append)
        assert fwd.forward(3, {"action": 1, "seq": 2}, to_3.append)
        fwd.link_down(1)
        assert to_1 == [{"action": 1, "seq": 1, "code": -1,
                         "reason": "master unreachable; outcome unknown"}]
        assert to_3 == [] and fwd.waiting == 1
        fwd.close()
        assert to_3 == [{"action": 1, "seq": 2, "code": -1, "reason": "node shutting down"}]
        assert fwd.waiting == 0

    run(main())


@pytest.mark.parametrize("with_handler", [True, False])
def test_the_master_serves_a_forward_and_answers_the_slave(with_handler):
    async def main():
        fwd, net = make(up=(2,), node_id=1)
        seen: list[tuple[dict, int]] = []

        def handler(request: dict, now_ms: int, respond, session) -> None:
            assert session is None  # no wait: nothing to cancel
            seen.append((request, now_ms))
            respond({"code": 0, "echo": request["queue"]})

        fwd.serve(2, Forward(vote_id=7, node_id=2, request_id=41, request={"queue": "q"}),
                  handler if with_handler else None)
        (peer, wire), = net.sent
        reply = decode(1, wire)
        assert peer == 2 and type(reply) is ForwardReply and reply.request_id == 41
        if with_handler:
            assert reply.response == {"code": 0, "echo": "q"}
            (request, now_ms), = seen
            assert request == {"queue": "q"} and now_ms > 1_600_000_000_000  # unix ms
        else:
            assert reply.response == {"code": -1, "reason": "no leader"}

    run(main())


# -- requests that may wait on the master (a consume with `wait`) ---------------


def test_cancel_sends_forward_cancel_and_the_client_hears_nothing():
    async def main():
        fwd, net = make()
        answers: list[dict] = []
        cancel = fwd.forward(1, {"action": 2, "queue": "q", "wait": 5}, answers.append,
                             timeout_s=FORWARD_TIMEOUT_S + 5)
        assert cancel is not None and fwd.waiting == 1
        sent = decode(2, net.sent[0][1])
        cancel()  # the slave's client went
        assert fwd.waiting == 0
        (peer, wire) = net.sent[1]
        msg = decode(2, wire)
        assert peer == 1 and type(msg) is ForwardCancel
        assert (msg.vote_id, msg.node_id, msg.request_id) == (7, 2, sent.request_id)
        reply_to(fwd, net.sent[0][1], {"code": 0, "msg_id": 1})  # the master's late answer
        assert answers == []
        cancel()  # twice: nothing more is sent
        assert len(net.sent) == 2

    run(main())


def test_cancel_after_the_answer_sends_nothing():
    async def main():
        fwd, net = make()
        answers: list[dict] = []
        cancel = fwd.forward(1, {"action": 2, "queue": "q", "wait": 5}, answers.append)
        reply_to(fwd, net.sent[0][1], {"code": 0})
        cancel()
        assert answers == [{"code": 0}] and len(net.sent) == 1

    run(main())


def _serve_waiting(fwd: Forwarder, peer: int, request_id: int, parked: dict) -> None:
    """The master serves a forwarded consume with `wait`; the handler parks
    it (keeps respond and the session) instead of answering."""
    def handler(request: dict, now_ms: int, respond, session) -> None:
        assert isinstance(session, Session) and not session.closed
        closed: list[bool] = []
        session.add(lambda: closed.append(True))
        parked[request_id] = (respond, session, closed)

    fwd.serve(peer, Forward(vote_id=7, node_id=peer, request_id=request_id,
                            request={"action": 2, "queue": "q", "wait": 3}), handler)


def test_the_master_closes_the_session_of_a_cancelled_forward():
    async def main():
        fwd, net = make(up=(2, 3), node_id=1)
        parked2: dict = {}
        parked3: dict = {}
        _serve_waiting(fwd, 2, 41, parked2)
        _serve_waiting(fwd, 3, 41, parked3)  # another slave, the same request_id
        assert net.sent == []  # parked: not answered
        fwd.on_cancel(2, ForwardCancel(vote_id=7, node_id=2, request_id=41))
        assert parked2[41][1].closed and parked2[41][2] == [True]
        # the cancel of slave 2 reaches slave 2's request only
        assert not parked3[41][1].closed and parked3[41][2] == []
        fwd.on_cancel(3, ForwardCancel(vote_id=7, node_id=3, request_id=41))
        assert parked3[41][1].closed and parked3[41][2] == [True]
        fwd.on_cancel(3, ForwardCancel(vote_id=7, node_id=3, request_id=41))  # unknown: ignored
        assert net.sent == []

    run(main())


def test_a_cancel_closes_only_its_own_session():
    async def main():
        fwd, net = make(up=(2,), node_id=1)
        parked: dict = {}
        _serve_waiting(fwd, 2, 41, parked)
        _serve_waiting(fwd, 2, 42, parked)
        fwd.on_cancel(2, ForwardCancel(vote_id=7, node_id=2, request_id=41))
        assert parked[41][1].closed and parked[41][2] == [True]
        assert not parked[42][1].closed and parked[42][2] == []
        respond, _session, _ = parked[42]
        respond({"code": 0})  # answered: its session is forgotten
        (peer, wire), = net.sent
        reply = decode(1, wire)
        assert peer == 2 and type(reply) is ForwardReply and reply.request_id == 42
        fwd.on_cancel(2, ForwardCancel(vote_id=7, node_id=2, request_id=42))
        assert not parked[42][1].closed  # too late to cancel: nothing closed

    run(main())


def test_a_broken_link_closes_the_sessions_of_that_slave_and_close_closes_all():
    async def main():
        fwd, _net = make(up=(2, 3), node_id=1)
        parked2: dict = {}
        parked3: dict = {}
        _serve_waiting(fwd, 2, 1, parked2)
        _serve_waiting(fwd, 3, 1, parked3)
        fwd.link_down(2)
        assert parked2[1][1].closed and parked2[1][2] == [True]
        assert not parked3[1][1].closed
        fwd.close()
        assert parked3[1][1].closed and parked3[1][2] == [True]

    run(main())
