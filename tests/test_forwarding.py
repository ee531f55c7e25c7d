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

from qserver.engines.forwarding import FORWARD_TIMEOUT_S, Forwarder
from qserver.engines.messages import Forward, ForwardReply, message_from_peer


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


def test_the_timeout_is_per_request():
    async def main():
        fwd, net = make()
        short: list[dict] = []
        default: list[dict] = []
        answered = asyncio.Event()

        def on_short(answer: dict) -> None:
            short.append(answer)
            answered.set()

        assert fwd.forward(1, {"action": 2}, on_short, timeout_s=0.05)
        assert fwd.forward(1, {"action": 2}, default.append)
        await asyncio.wait_for(answered.wait(), 30)
        assert short == [{"code": -1, "reason": "forward timeout; outcome unknown"}]
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
        assert fwd.forward(1, {"action": 1}, to_1.append)
        assert fwd.forward(3, {"action": 1}, to_3.append)
        fwd.link_down(1)
        assert to_1 == [{"code": -1, "reason": "master unreachable; outcome unknown"}]
        assert to_3 == [] and fwd.waiting == 1
        fwd.close()
        assert to_3 == [{"code": -1, "reason": "node shutting down"}]
        assert fwd.waiting == 0

    run(main())


@pytest.mark.parametrize("with_handler", [True, False])
def test_the_master_serves_a_forward_and_answers_the_slave(with_handler):
    async def main():
        fwd, net = make(up=(2,), node_id=1)
        seen: list[tuple[dict, int]] = []
        def handler(request: dict, now_ms: int, respond) -> None:
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
