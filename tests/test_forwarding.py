"""The slave -> master relay (qserver.engines.forwarding), which both engines
use: every forwarded request is answered exactly once, by the master or by
a failure that says the outcome is unknown; the timeout is per request.

The network here is a stand-in that records what is sent (the Forwarder
uses only `connected` and `send`); forwarding over real links and real
processes is tested in test_cluster_integration.py and test_raft_cluster.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from qserver.config import Config, PeerConfig
from qserver.engines.base import Session
from qserver.engines.forwarding import FORWARD_TIMEOUT_S, Forwarder
from qserver.engines.messages import (
    FEATURE_FORWARD_BATCH,
    FEATURES,
    Features,
    Forward,
    ForwardBatch,
    ForwardCancel,
    ForwardReplies,
    ForwardReply,
    message_from_peer,
)
from qserver.node import Node


class FakeNet:
    def __init__(self, up: set[int]) -> None:
        self.up = up
        self.sent: list[tuple[int, object]] = []
        self.refuse = False  # send() fails (a full or broken link)
        self.max_requests = 0  # > 0: a ForwardBatch of more is over the frame limit
        self.flushed: list[int] = []

    def connected(self, peer_id: int) -> bool:
        return peer_id in self.up

    def send(self, peer_id: int, wire: object) -> bool:
        if self.refuse or peer_id not in self.up:
            return False
        if self.max_requests and type(wire) is list and wire[0] in (16, 17) and (
                len(wire[4] if wire[0] == 16 else wire[3]) > self.max_requests * (
                    1 if wire[0] == 16 else 2)):
            return False
        self.sent.append((peer_id, wire))
        return True

    def flush(self, peer_id: int) -> None:
        self.flushed.append(peer_id)


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


# -- batches: one message per turn and direction --------------------------------


def batching(up=(1, 3), node_id=2, masters=(1,)) -> tuple[Forwarder, FakeNet]:
    """A slave's forwarder that heard `masters` take batches."""
    fwd, net = make(up=up, node_id=node_id)
    for m in masters:
        fwd.on_features(m, Features(vote_id=7, node_id=m, features=FEATURES))
    return fwd, net


async def next_turn() -> None:
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def test_link_up_says_what_we_take_and_forgets_what_the_peer_took():
    async def main():
        fwd, net = batching()
        fwd.link_up(1)
        (peer, wire), = net.sent
        msg = decode(2, wire)
        assert peer == 1 and type(msg) is Features and msg.features & FEATURE_FORWARD_BATCH
        # until node 1 says it again, it gets single forwards (it may have
        # restarted as an earlier release)
        net.sent.clear()
        assert fwd.forward(1, {"action": 1, "n": 1}, lambda r: None)
        assert type(decode(2, net.sent[0][1])) is Forward
        fwd.on_features(1, Features(vote_id=7, node_id=1, features=0))  # takes nothing new
        assert fwd.forward(1, {"action": 1, "n": 2}, lambda r: None)
        assert [type(decode(2, w)) for _, w in net.sent] == [Forward, Forward]

    run(main())


def test_a_turns_requests_go_as_one_batch_and_each_client_hears_its_answer_once():
    async def main():
        fwd, net = batching()
        answers: dict[int, list[dict]] = {i: [] for i in range(5)}
        for i in range(5):
            assert fwd.forward(1, {"action": 1, "n": i}, answers[i].append)
        assert net.sent == []  # at the end of the turn
        await next_turn()
        (peer, wire), = net.sent
        batch = decode(2, wire)
        assert peer == 1 and type(batch) is ForwardBatch and net.flushed == [1]
        assert [r["n"] for r in batch.requests] == [0, 1, 2, 3, 4]
        first = batch.first_id
        # the master answers some now, the others later, in any order
        fwd.on_replies(ForwardReplies(vote_id=7, node_id=1, replies=(
            (first + 3, {"code": 0, "n": 3}), (first, {"code": 0, "n": 0}))))
        fwd.on_replies(ForwardReplies(vote_id=7, node_id=1, replies=(
            (first + 1, {"code": 0, "n": 1}), (first + 4, {"code": 0, "n": 4}),
            (first + 3, {"code": 0, "n": 33}))))  # a duplicate: dropped
        fwd.on_reply(ForwardReply(vote_id=7, node_id=1, request_id=first + 2,
                                  response={"code": 0, "n": 2}))
        assert answers == {i: [{"code": 0, "n": i}] for i in range(5)}
        assert fwd.waiting == 0

    run(main())


def test_a_lone_request_goes_as_a_single_forward():
    async def main():
        fwd, net = batching()
        fwd.forward(1, {"action": 1}, lambda r: None)
        await next_turn()
        assert type(decode(2, net.sent[0][1])) is Forward

    run(main())


def test_a_full_batch_goes_at_once(monkeypatch):
    from qserver.engines import forwarding

    monkeypatch.setattr(forwarding, "BATCH_MAX_REQUESTS", 3)
    monkeypatch.setattr(forwarding, "BATCH_MAX_BYTES", 100)

    async def main():
        fwd, net = batching()
        for i in range(4):
            fwd.forward(1, {"action": 1, "n": i}, lambda r: None)
        # three requests: the batch went; the fourth waits for the turn's end
        assert [[r["n"] for r in decode(2, w).requests] for _, w in net.sent] == [[0, 1, 2]]
        fwd.forward(1, {"action": 1, "data": "x" * 100}, lambda r: None)  # 100 bytes of data
        assert len(net.sent) == 2 and [r.get("n") for r in decode(2, net.sent[1][1]).requests] \
            == [3, None]
        await next_turn()
        assert len(net.sent) == 2

    run(main())


def test_a_waiting_consume_goes_alone_after_the_requests_before_it():
    async def main():
        fwd, net = batching()
        fwd.forward(1, {"action": 1, "n": 0}, lambda r: None)
        fwd.forward(1, {"action": 1, "n": 1}, lambda r: None)
        cancel = fwd.forward(1, {"action": 2, "queue": "q", "wait": 5}, lambda r: None,
                             timeout_s=FORWARD_TIMEOUT_S + 5)
        msgs = [decode(2, w) for _, w in net.sent]
        assert [type(m) for m in msgs] == [ForwardBatch, Forward]  # in the order asked
        assert msgs[1].request_id == msgs[0].first_id + 2
        assert cancel is not None
        cancel()
        assert type(decode(2, net.sent[-1][1])) is ForwardCancel

    run(main())


def test_a_cancel_sends_its_batched_request_first():
    async def main():
        fwd, net = batching()
        fwd.forward(1, {"action": 1, "n": 0}, lambda r: None)
        answers: list[dict] = []
        cancel = fwd.forward(1, {"action": 1, "n": 1}, answers.append)
        assert cancel is not None and net.sent == []
        cancel()
        msgs = [decode(2, w) for _, w in net.sent]
        assert [type(m) for m in msgs] == [ForwardBatch, ForwardCancel]
        assert msgs[1].request_id == msgs[0].first_id + 1
        await next_turn()
        assert len(net.sent) == 2 and answers == []

    run(main())


def test_a_batch_over_the_frame_limit_goes_one_by_one():
    async def main():
        fwd, net = batching()
        net.max_requests = 2
        answers: list[dict] = []
        for i in range(3):
            fwd.forward(1, {"action": 1, "n": i}, answers.append)
        await next_turn()
        msgs = [decode(2, w) for _, w in net.sent]
        assert [type(m) for m in msgs] == [Forward] * 3
        assert [m.request["n"] for m in msgs] == [0, 1, 2]
        assert len({m.request_id for m in msgs}) == 3 and answers == []

    run(main())


def test_a_batch_whose_link_went_fails_with_no_leader():
    async def main():
        fwd, net = batching()
        answers: list[dict] = []
        fwd.forward(1, {"action": 1, "seq": 1}, answers.append)
        fwd.forward(1, {"action": 1, "seq": 2}, answers.append)
        net.refuse = True  # the link broke before the turn ended (no down event yet)
        await next_turn()
        assert answers == [{"action": 1, "seq": 1, "code": -1, "reason": "no leader"},
                           {"action": 1, "seq": 2, "code": -1, "reason": "no leader"}]
        net.refuse = False
        fwd.forward(1, {"action": 1, "seq": 3}, answers.append)
        fwd.link_down(1)  # the down event: the unsent batch fails at once
        assert answers[2:] == [{"action": 1, "seq": 3, "code": -1, "reason": "no leader"}]
        await next_turn()
        assert net.sent == [] and fwd.waiting == 0

    run(main())


def test_batches_go_to_each_master_that_takes_them():
    async def main():
        # leadership moved between forwards: each master gets its own batch
        fwd, net = batching(masters=(1, 3))
        fwd.forward(1, {"n": 0}, lambda r: None)
        fwd.forward(3, {"n": 1}, lambda r: None)
        fwd.forward(1, {"n": 2}, lambda r: None)
        await next_turn()
        got = {peer: [r["n"] for r in decode(2, w).requests] if decode(2, w).__class__
               is ForwardBatch else [decode(2, w).request["n"]] for peer, w in net.sent}
        assert got == {1: [0, 2], 3: [1]}

    run(main())


def test_close_fails_the_requests_of_an_unsent_batch():
    async def main():
        fwd, net = batching()
        answers: list[dict] = []
        fwd.forward(1, {"action": 1}, answers.append)
        fwd.close()
        assert answers == [{"action": 1, "code": -1, "reason": "node shutting down"}]
        await next_turn()
        assert net.sent == []

    run(main())


def test_the_master_answers_a_batch_with_one_message_per_turn():
    async def main():
        fwd, net = make(up=(2, 3), node_id=1)
        later: list = []
        seen: list[int] = []

        def handler(request: dict, now_ms: int, respond, session) -> None:
            seen.append(now_ms)
            if request["n"] % 2:
                later.append((request["n"], respond))  # answered in a later turn
            else:
                respond({"code": 0, "n": request["n"]})

        fwd.serve_batch(2, ForwardBatch(vote_id=7, node_id=2, first_id=10, requests=tuple(
            {"action": 1, "n": n} for n in range(4))), handler)
        fwd.serve(3, Forward(vote_id=7, node_id=3, request_id=5, request={"n": 8}), handler)
        assert len(set(seen[:4])) == 1  # one clock reading for the batch
        (peer, wire), = net.sent  # the single forward's answer goes at once, as before
        assert peer == 3 and type(decode(1, wire)) is ForwardReply
        await next_turn()
        peer, wire = net.sent[1]
        msg = decode(1, wire)
        assert peer == 2 and type(msg) is ForwardReplies and 2 in net.flushed
        assert msg.replies == ((10, {"code": 0, "n": 0}), (12, {"code": 0, "n": 2}))
        for n, respond in later:
            respond({"code": 0, "n": n})
        await next_turn()
        msg = decode(1, net.sent[2][1])
        assert msg.replies == ((11, {"code": 0, "n": 1}), (13, {"code": 0, "n": 3}))
        assert len(net.sent) == 3

    run(main())


def test_the_master_tries_the_fast_answer_first_and_keeps_the_order_of_a_turn():
    async def main():
        fwd, net = make(up=(2, 3), node_id=1)
        handled: list[int] = []
        fast_now: list[int] = []

        def handler(request: dict, now_ms: int, respond, session) -> None:
            handled.append(request["n"])
            respond({"code": 0, "by": "handler", "n": request["n"]})

        def answer_now(request: dict, now_ms: int) -> dict | None:
            fast_now.append(now_ms)
            if request["n"] == 1:
                return None  # not its shape: the handler takes it
            return {"code": 0, "by": "now", "n": request["n"]}

        fwd.serve_batch(2, ForwardBatch(vote_id=7, node_id=2, first_id=10, requests=tuple(
            {"n": n} for n in range(3))), handler, answer_now)
        fwd.serve(3, Forward(vote_id=7, node_id=3, request_id=5, request={"n": 7}), handler,
                  answer_now)
        assert handled == [1] and len(set(fast_now[:3])) == 1  # one clock reading a batch
        (peer, wire), = net.sent  # the single forward's fast answer goes at once
        reply = decode(1, wire)
        assert peer == 3 and (reply.request_id, reply.response) == (5, {"code": 0, "by": "now",
                                                                         "n": 7})
        await next_turn()
        msg = decode(1, net.sent[1][1])
        assert msg.replies == ((10, {"code": 0, "by": "now", "n": 0}),
                               (11, {"code": 0, "by": "handler", "n": 1}),
                               (12, {"code": 0, "by": "now", "n": 2}))

    run(main())


def test_a_request_refused_as_it_came_in_is_answered_alone_and_the_rest_served():
    async def main():
        fwd, net = make(up=(2, 3), node_id=1)
        served: list[dict] = []

        def handler(request: dict, now_ms: int, respond, session) -> None:
            served.append(request)
            respond({"code": 0, "n": request["n"]})

        # as message_from_wire decodes a batch holding a map JSON cannot carry
        wire = [16, 7, 2, 10, [{"n": 0}, {"n": b"raw"}, {"n": 2}]]
        batch = message_from_peer(2, wire)
        assert isinstance(batch, ForwardBatch)
        fwd.serve_batch(2, batch, handler, lambda request, now_ms: None)
        single = message_from_peer(3, [8, 7, 3, 4, {"n": {"deep": b"x"}}])
        assert isinstance(single, Forward)
        fwd.serve(3, single, handler)
        assert served == [{"n": 0}, {"n": 2}]
        reply = decode(1, net.sent[0][1])
        assert reply.request_id == 4 and reply.response["code"] == -1
        assert "forwarded request holds a bytes" in reply.response["reason"]
        await next_turn()
        msg = decode(1, net.sent[1][1])
        assert [(i, r["code"]) for i, r in msg.replies] == [(10, 0), (11, -1), (12, 0)]
        assert "holds a bytes" in msg.replies[1][1]["reason"]

    run(main())


def test_answers_over_the_frame_limit_go_one_by_one_and_a_gone_slave_gets_none():
    async def main():
        fwd, net = make(up=(2,), node_id=1)
        net.max_requests = 1
        fwd.serve_batch(2, ForwardBatch(vote_id=7, node_id=2, first_id=1, requests=(
            {"n": 0}, {"n": 1})), lambda req, now, respond, s: respond({"code": 0, **req}))
        await next_turn()
        assert [type(decode(1, w)) for _, w in net.sent] == [ForwardReply, ForwardReply]
        net.sent.clear()
        held: list = []
        fwd.serve_batch(2, ForwardBatch(vote_id=7, node_id=2, first_id=3, requests=(
            {"n": 0},)), lambda req, now, respond, s: held.append(respond))
        held[0]({"code": 0})
        fwd.link_down(2)  # the slave is gone before the turn ended: nothing to send
        await next_turn()
        assert net.sent == []

    run(main())


def test_a_waiting_request_in_a_batch_can_be_cancelled():
    async def main():
        fwd, net = make(up=(2,), node_id=1)
        sessions: list[Session] = []
        fwd.serve_batch(2, ForwardBatch(vote_id=7, node_id=2, first_id=20, requests=(
            {"action": 2, "queue": "q"}, {"action": 2, "queue": "q", "wait": 3})),
            lambda req, now, respond, session: sessions.append(session))
        assert sessions[0] is None and isinstance(sessions[1], Session)
        fwd.on_cancel(2, ForwardCancel(vote_id=7, node_id=2, request_id=21))
        assert sessions[1].closed

    run(main())


def test_flush_now_sends_the_turns_answers_at_once_and_leaves_nothing_for_the_turn_end():
    async def main():
        fwd, net = make(up=(2,), node_id=1)
        pending: list = []
        fwd.serve_batch(2, ForwardBatch(vote_id=7, node_id=2, first_id=10, requests=(
            {"action": 1, "n": 0},)), lambda request, now_ms, respond, session: pending.append(
                respond))
        fwd.flush_now()  # nothing answered yet: nothing to send
        assert net.sent == []
        pending[0]({"code": 0, "n": 0})  # a commit's answer, at the end of a turn
        fwd.flush_now()
        (peer, wire), = net.sent
        assert peer == 2 and net.flushed == [2]
        assert decode(1, wire).replies == ((10, {"code": 0, "n": 0}),)
        await next_turn()  # the end-of-turn callback it replaced sends nothing more
        assert len(net.sent) == 1 and net.flushed == [2]

    run(main())


@pytest.mark.parametrize("peers", [False, True])
def test_the_node_gives_the_engine_the_services_fast_path_for_forwarded_requests(peers):
    config = Config.default()
    if peers:  # a cluster node (its engine is built, not started: no sockets)
        config = dataclasses.replace(config, node_id=1, peers=tuple(
            PeerConfig(node_id=i, host="127.0.0.1", port=1 + i) for i in (1, 2, 3)))
    node = Node(config)
    assert node.engine.answer_forwarded_now == node.service.answer_now
    assert node.engine.handle_forwarded is not None
    # and, once an engine ran a commit's answers, writes their connections at once
    assert node.engine.on_answered == node._flush_connections
