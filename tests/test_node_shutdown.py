"""The orderly shutdown (qserver.node.Node.shutdown): it waits for the
answers connections still owe, and ends as soon as the last one is written
(an event, not a poll), or after SHUTDOWN_GRACE_S at the latest.

A real node in this process on a free loopback port; a TCP client whose
pipelined requests are held unanswered by an engine that defers its
commits, as a cluster master does while its slaves acknowledge.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

import qserver.node
from procs import free_port
from qserver.config import Config
from qserver.engines.local import LocalEngine
from qserver.node import Node

DEADLINE_S = 30.0


class HeldEngine(LocalEngine):
    """Commits like a lone node, but answers only when the test says."""

    commits_at_once = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.held: list = []

    def propose(self, entry, done) -> None:
        result = self.commit_now(entry)
        self.held.append(lambda: done(result, None))

    def release(self) -> None:
        held, self.held = self.held, []
        for answer in held:
            answer()


async def until(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"not before the deadline: {what}")
        await asyncio.sleep(0.01)


async def start_node() -> tuple[Node, HeldEngine]:
    node = Node(Config(port=free_port(), host="127.0.0.1"))
    engine = HeldEngine(store=node.store, log=node.log, me=node.engine.leader(),
                        log_size=node.config.log_size)
    node.engine = node.service.engine = engine
    await node.start()
    return node, engine


async def two_answers_owed():
    """A node, and a client that pipelined two produces the node owes."""
    node, engine = await start_node()
    reader, writer = await asyncio.open_connection("127.0.0.1", node.address[1])
    for seq in (1, 2):
        writer.write(json.dumps({"action": 1, "queue": "q", "data": "x", "seq": seq}).encode())
    await writer.drain()
    await until(lambda: len(engine.held) == 2, "both produces proposed")
    return node, engine, reader, writer


def test_shutdown_ends_when_the_last_owed_answer_is_written(monkeypatch):
    # Only the last answer can end the wait before the test's deadline.
    monkeypatch.setattr(qserver.node, "SHUTDOWN_GRACE_S", 3600.0)

    async def main():
        node, engine, reader, writer = await two_answers_owed()
        shutdown = asyncio.create_task(node.shutdown())
        await asyncio.sleep(0.2)
        assert not shutdown.done()  # two answers are owed
        engine.release()
        await asyncio.wait_for(shutdown, DEADLINE_S)
        answers = [json.loads(await reader.readline()) for _ in range(2)]
        assert [a["seq"] for a in answers] == [1, 2]
        assert all(a["code"] == 0 for a in answers)
        assert await reader.read() == b""  # closed after its answers
        writer.close()

    asyncio.run(main())


def test_shutdown_gives_up_after_the_grace_period(monkeypatch, caplog):
    monkeypatch.setattr(qserver.node, "SHUTDOWN_GRACE_S", 0.3)

    async def main():
        node, engine, reader, writer = await two_answers_owed()
        with caplog.at_level(logging.WARNING, logger="qserver.node"):
            await asyncio.wait_for(node.shutdown(), DEADLINE_S)
        assert "answers still owed" in caplog.text
        assert await reader.read() == b""  # closed without the answers
        writer.close()

    asyncio.run(main())


@pytest.mark.parametrize("owed", [False, True])
def test_a_client_that_leaves_ends_the_wait(owed, monkeypatch):
    monkeypatch.setattr(qserver.node, "SHUTDOWN_GRACE_S", 3600.0)

    async def main():
        node, engine, reader, writer = await two_answers_owed()
        if not owed:
            engine.release()
            await until(lambda: all(c.idle for c in node.connections), "answers written")
        shutdown = asyncio.create_task(node.shutdown())
        await asyncio.sleep(0.1)
        assert shutdown.done() is not owed
        writer.close()  # the client goes away: nothing is owed to anyone
        await asyncio.wait_for(shutdown, DEADLINE_S)

    asyncio.run(main())
