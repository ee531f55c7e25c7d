"""Answers given outside the read that asked for them (a parked consume
woken by another client's produce, a replicated write's commit, a relayed
answer) are written at the end of the loop turn they were given in: one
write per connection for all of its answers of that turn, and one callback
for every connection answered in it (Node.flush_at_turn_end)."""

from __future__ import annotations

import asyncio

import orjson

from qserver.config import Config
from qserver.node import Node
from qserver.server import ClientTcpProtocol
from test_alone_fast_path import _Transport


def _connect(node: Node) -> tuple[ClientTcpProtocol, _Transport]:
    protocol = ClientTcpProtocol(node)
    transport = _Transport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport


def _answers(transport: _Transport) -> list[dict]:
    return [orjson.loads(line) for data in transport.written for line in data.splitlines()]


def _record_flushes(node: Node) -> list[int]:
    """How many connections each of the node's end-of-turn callbacks wrote."""
    calls: list[int] = []
    flush = node._flush_connections

    def counted() -> None:
        calls.append(len(node._to_flush))
        flush()
    node._flush_connections = counted  # type: ignore[method-assign]
    return calls


async def _until(check, what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within 5 s: {what}")


def test_answers_given_in_another_clients_turn_go_at_its_end_one_write_each():
    async def main() -> None:
        node = Node(Config.default())
        consumers = [_connect(node) for _ in range(3)]
        for i, (protocol, _) in enumerate(consumers):
            # two parked consumes on the first connection: both answered below
            for seq in range(2 if i == 0 else 1):
                protocol.data_received(orjson.dumps(
                    {"action": 2, "queue": "q", "wait": 5, "seq": 10 * i + seq}) + b"\n")
        assert all(t.written == [] for _, t in consumers)  # parked
        producer, out = _connect(node)
        flushes = _record_flushes(node)
        producer.data_received(orjson.dumps(
            {"action": 1, "queue": "q", "messages": [{"data": f"m{i}"} for i in range(4)],
             "seq": 99})
            + b"\n")
        (answer,) = _answers(out)  # the producer's own answer: in its read
        assert answer["code"] == 0 and len(answer["msg_ids"]) == 4
        # Theirs: at the end of the turn they were given in.
        await _until(lambda: all(t.written for _, t in consumers), "the consumers' answers")
        assert flushes == [3]  # one callback for the three connections
        assert node._to_flush == []
        assert [len(t.written) for _, t in consumers] == [1, 1, 1]  # one write each
        got = [_answers(t) for _, t in consumers]
        assert [[a["seq"] for a in answers] for answers in got] == [[0, 1], [10], [20]]
        assert sorted(a["data"] for answers in got for a in answers) == ["m0", "m1", "m2", "m3"]
        assert all(a["code"] == 0 for answers in got for a in answers)
        assert all(p.idle for p, _ in consumers)

    asyncio.run(main())


def test_a_connection_gone_before_the_turn_ends_is_skipped():
    async def main() -> None:
        node = Node(Config.default())
        (a, ta), (b, tb) = _connect(node), _connect(node)
        for seq, protocol in enumerate((a, b)):
            protocol.data_received(orjson.dumps(
                {"action": 2, "queue": "q", "wait": 5, "seq": seq}) + b"\n")
        producer, _ = _connect(node)
        flushes = _record_flushes(node)
        flush = node._flush_connections

        def lose_a_first() -> None:
            a.connection_lost(None)  # answered in the turn, gone before its end
            flush()
        node._flush_connections = lose_a_first  # type: ignore[method-assign]
        producer.data_received(orjson.dumps(
            {"action": 1, "queue": "q", "messages": [{"data": "x"}, {"data": "y"}]}) + b"\n")
        await _until(lambda: tb.written, "b's answer")
        assert flushes == [2]
        assert ta.written == [] and [x["seq"] for x in _answers(tb)] == [1]

    asyncio.run(main())
