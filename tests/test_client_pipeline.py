"""AsyncClient's tasks share its connection, pipelined (issue 18, point 4):
scripted nodes in the test's event loop show what goes on the wire (how
many connections, how many requests before the first answer); real nodes
show the answers right under concurrency, cancellation, long polls,
tokens and kill -9 of the node the client talks to. The figures are
bench/client_bench.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from procs import pipelined, sockets_to, until_async, wait_until
from qserver.client import AsyncClient, Client, Message
from qserver.errors import ClientConnectionError, ClientTimeout, Unauthorized

DEADLINE_S = 30.0  # generous: CI is a shared, noisy 2-core machine
TOKEN = "pipeline-admin-token-0123456789"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def scripted(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A node played by `handler` (one call per connection) on a free port:
    its "host:port", and a list that counts the connections it accepted."""
    accepted: list[int] = []
    tasks: set[asyncio.Task] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        tasks.add(asyncio.current_task())
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted
    finally:
        server.close()
        # A connection accepted just before has its handler's task made but
        # not started: let it start, or cancelling it would skip the close
        # (Python 3.11's streams then leave its socket to the collector).
        await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> dict:
    """One request (the client writes them back to back, without newlines)."""
    buf = b""
    decoder = json.JSONDecoder()
    while True:
        buf += await reader.readexactly(1)
        if buf.endswith(b"}"):
            try:
                obj, end = decoder.raw_decode(buf.decode())
            except ValueError:
                continue
            assert end == len(buf)
            return obj


def answer(request: dict, **fields) -> bytes:
    return json.dumps({**request, "code": 0, **fields}).encode() + b"\n"


def test_tasks_pipeline_their_requests_on_one_connection():
    """The node answers nothing until 50 requests are in: with calls taken
    one at a time, the first would wait for its answer forever."""
    n = 50

    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests = [await read_request(reader) for _ in range(n)]
        assert len({r["seq"] for r in requests}) == n  # each with a seq of its own
        # in the order they came, each naming its own message
        writer.write(b"".join(answer(r, msg_id=int(r["data"])) for r in requests))
        await writer.drain()
        while True:
            r = await read_request(reader)
            writer.write(answer(r, msg_id=int(r["data"])))

    async def main() -> None:
        async with scripted(node) as (address, accepted), \
                AsyncClient(address, timeout=DEADLINE_S, retry_for=0) as c:
            ids = await asyncio.gather(*(c.produce("q", str(i)) for i in range(n)))
            assert ids == list(range(n))  # every task its own answer
            assert await c.produce("q", "77") == 77
            assert len(accepted) == 1

    asyncio.run(main())


def test_a_silent_node_times_every_task_out_together():
    """Tasks wait on one connection: all give up after `timeout`, not one
    after another (20 x 0.5 s with calls taken one at a time)."""
    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass

    async def main() -> None:
        async with scripted(node) as (address, accepted), \
                AsyncClient(address, timeout=0.5, retry_for=0) as c:
            start = time.monotonic()
            results = await asyncio.gather(*(c.produce("q", str(i)) for i in range(20)),
                                           return_exceptions=True)
            took = time.monotonic() - start
            assert all(isinstance(r, ClientTimeout) for r in results), results
            assert 0.5 <= took < 5.0, took
            assert len(accepted) == 1

    asyncio.run(main())


def test_a_connection_the_node_closed_while_idle_is_replaced_without_a_retry():
    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        r = await read_request(reader)
        writer.write(answer(r, msg_id=1))
        await writer.drain()  # then close: an idle connection the node let go

    async def main() -> None:
        async with scripted(node) as (address, accepted), \
                AsyncClient(address, timeout=DEADLINE_S, retry_for=0) as c:
            assert await c.produce("q", "a") == 1
            await asyncio.sleep(0.2)  # the close arrives
            assert await c.produce("q", "b") == 1  # retry_for=0: no retry was needed
            assert len(accepted) == 2

    asyncio.run(main())


def test_a_node_that_closes_every_connection_at_once_is_a_failure_with_backoff():
    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pass  # closed as soon as accepted

    async def main() -> None:
        async with scripted(node) as (address, accepted), \
                AsyncClient(address, timeout=5, retry_for=1.0) as c:
            start = time.monotonic()
            results = await asyncio.gather(*(c.produce("q", str(i)) for i in range(10)),
                                           return_exceptions=True)
            assert all(isinstance(r, ClientConnectionError) for r in results), results
            assert 1.0 <= time.monotonic() - start < DEADLINE_S
            # failures counted and paused for, not a loop of new connections
            assert len(accepted) < 200, len(accepted)

    asyncio.run(main())


# -- real nodes ----------------------------------------------------------------------


def host(node) -> str:
    return f"127.0.0.1:{node.port}"


def test_many_tasks_get_their_own_answers(node):
    async def main() -> None:
        async with AsyncClient(host(node), retry_for=DEADLINE_S) as c:
            async def produce(i: int) -> tuple[int, str]:
                data = f"task {i}"
                return await c.produce("many", data, retry=60), data

            got = await asyncio.gather(*(produce(i) for i in range(300)))
            assert sorted(msg_id for msg_id, _ in got) == list(range(1, 301))
            shown = await asyncio.gather(*(c.show("many", msg_id) for msg_id, _ in got))
            assert [s["data"] for s in shown] == [data for _, data in got]

            # different calls at once, each answered as its kind
            await c.set_config("many", max_deliveries=5)
            await c.produce_batch("many_d", [f"d{i}" for i in range(10)], retry=60)
            results = await asyncio.gather(
                c.monitor("many"), c.config("many"), c.peek("many", 3),
                c.produce_many([{"queue": "many_b", "data": str(i)} for i in range(2000)]),
                c.show("many", 7), c.list("many"), c.consume("many_d", count=10, lease=60),
                c.produce_batch("many_c", [str(i) for i in range(3000)]))
            monitor, config, peek, ids_b, show, listed, consumed, ids_c = results
            assert monitor["size"] == 300 and config["max_deliveries"] == 5
            assert [m["msg_id"] for m in peek] == [1, 2, 3]
            assert ids_b == list(range(1, 2001)) and ids_c == list(range(1, 3001))
            assert show["data"] == dict(got)[7]
            assert {"many", "many_b", "many_d"} <= {q["name"] for q in listed}
            assert [d.data for d in consumed] == [f"d{i}" for i in range(10)]
            assert all(await asyncio.gather(*(d.confirm() for d in consumed)))

    asyncio.run(main())


def test_close_returns_once_the_sockets_are_closed(node):
    """Not left to the end of the event loop (or past it, to the garbage
    collector: a ResourceWarning): the shared connection and an idle long
    poll's are closed when close() returns, and a later call opens anew."""
    async def main() -> None:
        c = AsyncClient(host(node), retry_for=DEADLINE_S)
        assert await c.produce("closing", "a") == 1
        assert await c.consume("closing_empty", wait=0.1) is None  # a lane of its own
        assert sockets_to(node.port) == 2
        await c.close()
        assert sockets_to(node.port) == 0
        async def long_poll() -> tuple[Message | None, int]:
            got = await c.consume("closing_wait", wait=DEADLINE_S)
            return got, sockets_to(node.port)  # as it returns

        async with c:
            assert await c.produce("closing", "b") == 2
            poll = asyncio.create_task(long_poll())
            await until_async(lambda: sockets_to(node.port) == 2, "the long poll's connection")
        assert sockets_to(node.port) == 1  # the poll goes on, on its own
        # (a blocking client: its socket is closed before the poll can run)
        assert pipelined(node.port, [{"action": 1, "queue": "closing_wait", "data": "c"}])[0][
            "code"] == 0
        got, left = await asyncio.wait_for(poll, DEADLINE_S)
        assert got is not None and got.data == "c"
        assert left == 0  # the client closed meanwhile: its connection too

    asyncio.run(main())


def test_cancelled_tasks_leave_the_others_their_answers(node):
    async def main() -> None:
        async with AsyncClient(host(node), retry_for=DEADLINE_S) as c:
            big = [{"queue": "cancel_big", "data": "x" * 100}] * 20_000
            doomed = [asyncio.create_task(c.produce_many(big)) for _ in range(3)]

            async def produce(i: int) -> tuple[int, str]:
                return await c.produce("cancel_small", f"s{i}", retry=60), f"s{i}"

            survivors = [asyncio.create_task(produce(i)) for i in range(100)]
            await asyncio.sleep(0.05)  # 60,000 produces take far longer
            for task in doomed:
                task.cancel()
            done = await asyncio.gather(*survivors)
            for task in doomed:
                with pytest.raises(asyncio.CancelledError):
                    await task
            shown = await asyncio.gather(*(c.show("cancel_small", i) for i, _ in done))
            assert [s["data"] for s in shown] == [data for _, data in done]
            # and calls after them read their own answers
            assert await c.consume("cancel_empty") is None
            assert await c.produce("cancel_after", "y") == 1

    asyncio.run(main())


def test_a_long_poll_does_not_hold_up_the_other_tasks(node):
    async def main() -> None:
        async with AsyncClient(host(node), retry_for=DEADLINE_S) as c:
            poll = asyncio.create_task(c.consume("lp_wait", wait=DEADLINE_S))
            await asyncio.sleep(0.2)  # parked on the node
            start = time.monotonic()
            ids = await asyncio.gather(*(c.produce("lp_other", str(i)) for i in range(200)))
            assert sorted(ids) == list(range(1, 201))
            assert time.monotonic() - start < DEADLINE_S / 3
            assert not poll.done()
            msg_id = await c.produce("lp_wait", "at last", retry=60)
            got = await asyncio.wait_for(poll, DEADLINE_S)
            assert got is not None and (got.msg_id, got.data) == (msg_id, "at last")
            assert await got.confirm()

    asyncio.run(main())


def test_a_refused_token_fails_every_task_on_the_connection(procs, tmp_path):
    node = procs(tmp_path, f'  <security><token name="admin" token="{TOKEN}"/></security>\n')

    async def main() -> None:
        async with AsyncClient(host(node), token="wrong-token-0123456789abc",
                               retry_for=DEADLINE_S) as c:
            results = await asyncio.gather(*(c.produce("auth", str(i)) for i in range(10)),
                                           return_exceptions=True)
            assert all(isinstance(r, Unauthorized) for r in results), results
        async with AsyncClient(host(node), token=TOKEN, retry_for=DEADLINE_S) as c:
            ids = await asyncio.gather(*(c.produce("auth", str(i)) for i in range(10)))
            assert sorted(ids) == list(range(1, 11))

    asyncio.run(main())


def test_concurrent_tasks_survive_kill_9_of_the_node_they_talk_to(cluster):
    c = cluster()
    m = c.wait_master(DEADLINE_S)
    # The client starts on the master (shuffle=False), the hardest node to
    # lose: the requests in flight of every task die with it.
    order = [m] + [i for i in sorted(c.nodes) if i != m]
    hosts = [f"127.0.0.1:{c.port(i)}" for i in order]
    acked: dict[str, int] = {}
    failures: list[BaseException] = []
    stop = asyncio.Event()
    progress = asyncio.Event()  # set by every answer or failure

    async def producer(c_: AsyncClient, k: int) -> None:
        i = 0
        while not stop.is_set():
            data = f"t{k}-{i}"
            try:
                acked[data] = await c_.produce("ha", data, retry=60, dedup_id=data)
            except BaseException as exc:
                failures.append(exc)
                return
            finally:
                progress.set()
            i += 1

    async def until(enough: int) -> None:
        async with asyncio.timeout(DEADLINE_S):
            while len(acked) < enough and not failures:
                progress.clear()
                await progress.wait()

    async def main() -> None:
        async with AsyncClient(hosts, timeout=5, retry_for=DEADLINE_S, shuffle=False) as ac:
            tasks = [asyncio.create_task(producer(ac, k)) for k in range(16)]
            await until(500)
            assert ac.address == ("127.0.0.1", c.port(m))
            await asyncio.to_thread(c.kill, m)
            before = len(acked)
            await until(before + 500)
            stop.set()
            await asyncio.gather(*tasks)
            assert not failures, failures
            assert len(acked) >= before + 500
            assert ac.address != ("127.0.0.1", c.port(m))

    asyncio.run(main())
    alive = [f"127.0.0.1:{c.port(i)}" for i in order[1:]]
    got: dict[int, str] = {}
    with Client(alive, retry_for=DEADLINE_S) as client:
        wait_until(lambda: client.monitor("ha")["size"] >= len(acked), DEADLINE_S)
        for delivery in client.messages("ha", count=1000, stop_when_empty=True):
            got[delivery.msg_id] = delivery.data
            delivery.confirm()
    assert {got.get(msg_id) for msg_id in acked.values()} == set(acked)  # none lost
    assert len(got) == len(set(got.values()))  # none stored twice (dedup_id)


def test_closing_drops_what_a_node_that_stopped_reading_never_took():
    """Calls cancelled while their requests wait in the connection's buffer
    (the node stopped reading): closing the client closes the socket at
    once, those requests unsent. (asyncio's close() would hold the socket
    open until they were sent: past the end of the event loop, an unclosed
    transport; CI saw one.)"""
    async def main() -> None:
        release = asyncio.Event()

        async def stalled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await release.wait()  # reads nothing: the kernel's buffers fill up

        async with scripted(stalled) as (host, _):
            c = AsyncClient(host, timeout=DEADLINE_S, retry_for=DEADLINE_S)
            items = [{"queue": "stalled", "data": "x" * 10_000}] * 200
            tasks = [asyncio.create_task(c.produce_many(items)) for _ in range(20)]
            # (the client's private state: what the test must see)
            pipe = await until_async(lambda: (p := c._pipe) is not None
                                     and p._writable is not None and p, "writing paused",
                                     DEADLINE_S)
            assert pipe._transport.get_write_buffer_size() > 0
            sock = pipe._transport.get_extra_info("socket")
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await c.close()
            await until_async(lambda: sock.fileno() == -1, "the socket closed", DEADLINE_S)
            release.set()

    asyncio.run(main())


def test_a_drain_or_transfer_the_node_holds_holds_up_no_other_call():
    """A node answers a connection in order and holds a drain (108) or a
    transfer (20) until the role has moved: they go on a connection of
    their own, so produces on the shared one are answered meanwhile, and
    the shared one never goes silent for `timeout` behind them."""
    release = asyncio.Event()

    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            r = await read_request(reader)
            if r["action"] in (20, 108):
                await release.wait()
                writer.write(answer(r, draining=True, leader_node_id=2))
            else:
                writer.write(answer(r, msg_id=int(r["data"])))

    async def main() -> None:
        async with scripted(node) as (address, accepted), \
                AsyncClient(address, timeout=0.5, retry_for=0) as c:
            drain = asyncio.create_task(c.drain())
            transfer = asyncio.create_task(c.transfer_leader(2))
            await asyncio.sleep(0.1)
            for i in range(5):  # 1 s in all: twice the timeout
                ids = await asyncio.gather(*(c.produce("q", str(10 * i + k)) for k in range(10)))
                assert ids == [10 * i + k for k in range(10)]
                await asyncio.sleep(0.2)
            assert not drain.done() and not transfer.done()
            release.set()
            assert await drain == {"draining": True, "leader_node_id": 2}
            assert await transfer == 2
            # the shared connection and one each for the held requests, at the
            # same node: the one the client talks to
            assert len(accepted) == 3

    asyncio.run(main())


def test_a_connection_opening_when_the_client_closes_is_closed_too():
    """close() while a call's connection is still being opened: once it is
    open it is closed, not installed on the closed client and left open."""
    eof = asyncio.Event()

    async def node(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass
        eof.set()  # the client closed its side

    async def main() -> None:
        async with scripted(node) as (address, accepted):
            c = AsyncClient(address, timeout=DEADLINE_S, retry_for=0)
            call = asyncio.create_task(c.produce("q", "x"))
            await asyncio.sleep(0)  # the opening has begun
            assert c._opening  # (the client's private state: what the test must see)
            call.cancel()
            await c.close()
            await asyncio.wait_for(eof.wait(), DEADLINE_S)
            assert c._pipe is None and not c._pipes and len(accepted) == 1
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(main())
