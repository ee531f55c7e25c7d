"""The Python client (qserver.client) against real nodes: one node for the
API, typed errors and consumer helpers (sync and async); three-node clusters
for failover under kill -9 and redirects."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from procs import NodeProcess, free_port, wait_until, write_config
from qserver.client import (
    AsyncClient,
    Client,
    Message,
    parse_hosts,
    produce_request,
)
from qserver.errors import (
    ClientConnectionError,
    InvalidArgument,
    NoLeader,
    QServerClientError,
    QServerError,
    QueueFull,
    ServerError,
)

DEADLINE_S = 30.0  # generous: CI is a shared, noisy 2-core machine
VIRTUAL = '<virtual_queue name="fan"><queue name="fan_a"/><queue name="fan_b"/></virtual_queue>\n'


def start_node(tmp_path, extra: str = "") -> NodeProcess:
    """One node on a free port (retried: a port can be taken meanwhile)."""
    for attempt in range(3):
        port = free_port()
        node = NodeProcess(write_config(tmp_path / f"node{port}.xml", port, extra), port)
        try:
            node.wait_ready()
            return node
        except RuntimeError:
            node.kill()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """One node shared by the single-node tests (each uses its own queues)."""
    n = start_node(tmp_path_factory.mktemp("client"), VIRTUAL)
    yield n
    n.kill()


@pytest.fixture
def client(node):
    with Client([f"127.0.0.1:{node.port}"], timeout=10, retry_for=DEADLINE_S) as c:
        yield c


def run(coro):
    return asyncio.run(coro)


# -- arguments (no server) -------------------------------------------------------


def test_parse_hosts_accepts_every_form():
    assert parse_hosts("a:1, b:2") == [("a", 1), ("b", 2)]
    assert parse_hosts(["a:1", ("b", 2)]) == [("a", 1), ("b", 2)]
    assert parse_hosts(("a", 1)) == [("a", 1)]
    assert parse_hosts(["[::1]:1111"]) == [("::1", 1111)]
    for bad in ("a", "a:x", "a:0", "", ["a:70000"], [("a", "1")]):
        with pytest.raises(InvalidArgument):
            parse_hosts(bad)


def test_times_become_whole_absolute_seconds_rounded_up():
    now = 1_700_000_000.25
    r = produce_request("q", "d", delay=30, ttl=timedelta(hours=1), retry=1.5, now_s=now)
    assert r == {"action": 1, "queue": "q", "data": "d", "delay": math.ceil(now + 30),
                 "ttl": math.ceil(now + 3600), "retry": 2}
    naive = datetime.fromtimestamp(now + 10)  # local time
    aware = datetime.fromtimestamp(now + 10, tz=UTC)
    for when in (naive, aware):
        assert produce_request("q", "d", delay=when, now_s=now)["delay"] == math.ceil(now + 10)
    # absolute unix times pass through; a delay already past is left out (ready now)
    assert produce_request("q", "d", delay=1_800_000_000, now_s=now)["delay"] == 1_800_000_000
    assert "delay" not in produce_request("q", "d", delay=0, now_s=now)
    past = datetime.fromtimestamp(now - 5)
    assert "delay" not in produce_request("q", "d", delay=past, now_s=now)
    assert produce_request("q", "d", now_s=now) == {"action": 1, "queue": "q", "data": "d"}


def test_bad_arguments_raise_invalid_argument_before_sending():
    for kwargs in ({"data": 5}, {"data": None}, {"delay": "soon"}, {"ttl": True},
                   {"retry": -1}, {"delay": float("nan")}, {"queue": 7}):
        args = {"queue": "q", "data": "d", **kwargs}
        with pytest.raises(InvalidArgument) as info:
            produce_request(args.pop("queue"), args.pop("data"), **args)
        assert isinstance(info.value, ValueError) and isinstance(info.value, QServerClientError)


def test_error_hierarchy_is_rooted():
    for cls in (InvalidArgument, ClientConnectionError, ServerError, QueueFull, NoLeader):
        assert issubclass(cls, QServerClientError) and issubclass(cls, QServerError)
    assert issubclass(QueueFull, ServerError) and issubclass(NoLeader, ServerError)


# -- one node, blocking client -----------------------------------------------------


def test_produce_consume_confirm(client):
    msg_id = client.produce("basic", "hello", retry=60)
    assert isinstance(msg_id, int) and msg_id >= 1
    msg = client.consume("basic")
    assert msg == Message(queue="basic", msg_id=msg_id, data="hello")
    assert client.consume("basic") is None  # in flight until confirmed or due again
    assert client.monitor("basic")["in_flight"] == 1
    client.confirm("basic", msg_id)
    assert client.monitor("basic")["size"] == 0
    client.confirm("basic", 10**9)  # an unknown id is not an error
    assert [q["name"] for q in client.list("basi")] == ["basic"]
    leader = client.leader()
    assert leader == {"leader_node_id": 1, "leader_host": "127.0.0.1",
                      "leader_port": client.address[1]}
    assert client.monitor(local=True)["role"] == "master"


def test_delay_as_timedelta_and_datetime(client):
    client.produce("later", "td", delay=timedelta(seconds=2))
    client.produce("later", "dt", delay=datetime.now() + timedelta(seconds=2))
    client.produce("later", "utc", delay=datetime.now(UTC) + timedelta(seconds=2))
    assert client.consume("later") is None
    mon = client.monitor("later")
    assert (mon["delayed"], mon["ready"]) == (3, 0)
    got = []
    wait_until(lambda: got.extend(m.data for m in iter(lambda: client.consume("later"), None))
               or len(got) == 3, DEADLINE_S)
    assert sorted(got) == ["dt", "td", "utc"]


def test_virtual_queue_names_every_message(client):
    ids = client.produce_ids("fan", "to both")
    assert set(ids) == {"fan_a", "fan_b"}
    assert client.produce("fan", "again") == ids["fan_a"] + 1  # the first real queue's id
    assert client.produce_ids("plain", "x") == {"plain": 1}
    for name in ("fan_a", "fan_b"):
        assert client.consume(name).data == "to both"
    with pytest.raises(ServerError) as info:
        client.consume("fan")
    assert info.value.reason == "virtual queue only takes produce"


def test_produce_many_returns_ids_in_input_order(client):
    items = [{"queue": "bulk", "data": f"item-{i}", "retry": 60} for i in range(5000)]
    items[10]["delay"] = 0  # ready now; conventions as produce
    ids = client.produce_many(iter(items), window=700)
    assert len(ids) == len(set(ids)) == 5000
    by_id = {msg_id: item["data"] for msg_id, item in zip(ids, items)}
    got = {}
    for delivery in client.messages("bulk", stop_when_empty=True):
        with delivery as msg:
            got[msg.msg_id] = msg.data
    assert got == by_id
    assert client.monitor("bulk")["size"] == 0  # every one confirmed
    assert client.produce_many([]) == []


def test_bad_input_is_typed(client):
    max_id = client.monitor("typed")["max_id"]
    with pytest.raises(InvalidArgument, match="item 1"):
        client.produce_many([{"queue": "typed", "data": "ok"}, {"queue": "typed", "data": 1}])
    with pytest.raises(InvalidArgument, match="unknown key"):
        client.produce_many([{"queue": "typed", "data": "ok", "dealy": 5}])
    assert client.monitor("typed")["max_id"] == max_id  # nothing was sent
    with pytest.raises(ServerError) as info:
        client.produce("", "x")
    assert (info.value.code, info.value.reason) == (-1, "queue must not be empty")
    with pytest.raises(ServerError, match="time error"):
        client.produce("typed", "x", delay=60, ttl=30)
    with pytest.raises(ServerError) as info:
        client.produce_many([{"queue": "typed", "data": "a"},
                             {"queue": "typed", "data": "b", "delay": 60, "ttl": 30}])
    assert info.value.index == 1 and info.value.reason == "time error"
    # a refusal leaves the connection usable
    assert client.request({"action": 4, "queue": "typed", "seq": "mine"})["seq"] == "mine"
    assert client.request({"action": 99})["reason"] == "invalid action"


def test_queue_full_is_typed(tmp_path):
    small = start_node(tmp_path, '<queue_config queue_size="3"/>\n' + VIRTUAL)
    try:
        with Client([("127.0.0.1", small.port)]) as c:
            items = [{"queue": "full", "data": str(i)} for i in range(3)]
            assert c.produce_many(items) == [1, 2, 3]
            with pytest.raises(QueueFull) as info:
                c.produce("full", "one too many")
            assert info.value.reason == "queue full: full"
            with pytest.raises(QueueFull) as info:
                c.produce_many([{"queue": "other", "data": str(i)} for i in range(5)])
            assert info.value.index == 3
            c.produce_many([{"queue": "fan_b", "data": str(i)} for i in range(3)])
            with pytest.raises(QueueFull):  # all or nothing for a virtual queue
                c.produce_ids("fan", "x")
            assert c.monitor("fan_a")["size"] == 0
    finally:
        small.kill()


def test_process_confirms_on_success_and_leaves_on_exception(client):
    client.produce("work", "fails once", retry=1)
    with pytest.raises(RuntimeError):
        with client.process("work") as msg:
            assert msg.data == "fails once"
            raise RuntimeError("handler failed")
    mon = client.monitor("work")
    assert (mon["size"], mon["in_flight"]) == (1, 1)  # not confirmed: the server retries it
    with client.process("work", wait=DEADLINE_S) as again:  # back after retry=1 s
        assert again.msg_id == msg.msg_id
    assert client.monitor("work")["size"] == 0  # confirmed
    with client.process("work") as nothing:
        assert nothing is None


def test_messages_skips_confirm_for_a_failed_block(client):
    for i in range(3):
        client.produce("loop", f"m{i}", retry=60)
    seen = []
    for delivery in client.messages("loop", stop_when_empty=True):
        try:
            with delivery as msg:
                seen.append(msg.data)
                if msg.data == "m1":
                    raise ValueError("bad message")
        except ValueError:
            pass
    assert seen == ["m0", "m1", "m2"]
    mon = client.monitor("loop")
    assert (mon["size"], mon["in_flight"]) == (1, 1)  # only m1 left, for retry


def test_messages_waits_for_new_messages(client):
    timer = threading.Timer(0.3, client.produce, ("wait_q", "late"), {"retry": 60})
    timer.start()
    for delivery in client.messages("wait_q"):
        with delivery as msg:
            assert msg.data == "late"
        break
    timer.join()
    assert client.monitor("wait_q")["size"] == 0


def test_fails_over_to_the_next_address_and_raises_when_all_are_down(node):
    dead = free_port()
    with Client([f"127.0.0.1:{dead}", f"127.0.0.1:{node.port}"], retry_for=0) as c:
        assert c.produce("over", "x") >= 1
        assert c.address == ("127.0.0.1", node.port)
    with Client([f"127.0.0.1:{dead}"], retry_for=0.3) as c:
        start = time.monotonic()
        with pytest.raises(ClientConnectionError):
            c.produce("over", "x")
        assert time.monotonic() - start < DEADLINE_S


def test_threads_share_one_client(client):
    ids: list[int] = []

    def worker(k: int) -> None:
        ids.extend(client.produce("shared", f"{k}-{i}") for i in range(100))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert sorted(ids) == list(range(1, 401))


# -- one node, asyncio client --------------------------------------------------------


def test_async_client(node):
    async def main() -> None:
        async with AsyncClient(f"127.0.0.1:{node.port}", retry_for=DEADLINE_S) as c:
            msg_id = await c.produce("async", "hi", retry=1, delay=timedelta(0))
            assert await c.consume("async") == Message(queue="async", msg_id=msg_id, data="hi")
            await c.confirm("async", msg_id)
            assert (await c.monitor("async"))["size"] == 0
            ids = await c.produce_ids("fan", "x")
            assert ids == {"fan_a": (await c.monitor("fan_a"))["max_id"],
                           "fan_b": (await c.monitor("fan_b"))["max_id"]}
            ids = await c.produce_many([{"queue": "async_bulk", "data": str(i), "retry": 60}
                                        for i in range(3000)])
            assert len(set(ids)) == 3000
            got = {}
            async for delivery in c.messages("async_bulk", stop_when_empty=True):
                async with delivery as msg:
                    got[msg.msg_id] = msg.data
            assert got == {msg_id: str(i) for i, msg_id in enumerate(ids)}
            # the consumer helper: confirm on success, retry on exception
            await c.produce("async_work", "job", retry=1)
            with pytest.raises(KeyError):
                async with c.process("async_work") as msg:
                    raise KeyError(msg.msg_id)
            async with c.process("async_work", wait=DEADLINE_S) as again:
                assert again.data == "job"
            assert (await c.monitor("async_work"))["size"] == 0
            # concurrent tasks on one client
            many = await asyncio.gather(*(c.produce("async_tasks", str(i)) for i in range(50)))
            assert sorted(many) == list(range(1, 51))
            with pytest.raises(InvalidArgument):
                await c.produce("async", b"bytes")
            with pytest.raises(ServerError, match="queue must not be empty"):
                await c.consume("")
            assert [q["name"] for q in await c.list("async_t")] == ["async_tasks"]
            assert (await c.leader())["leader_port"] == node.port
            assert (await c.request({"action": 8, "seq": 5}))["seq"] == 5
            # a cancelled call leaves no stale answers for the next one
            big = [{"queue": "async_cancel", "data": "x" * 100}] * 50_000
            task = asyncio.create_task(c.produce_many(big))
            await asyncio.sleep(0.05)  # 50,000 produces take far longer
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await c.consume("async_empty") is None
            assert await c.produce("async_after", "y") == 1

    run(main())


# -- three-node clusters ---------------------------------------------------------------


def drain(hosts: list[str], queue: str) -> dict[int, str]:
    got: dict[int, str] = {}
    with Client(hosts, retry_for=DEADLINE_S) as c:
        for delivery in c.messages(queue, stop_when_empty=True):
            with delivery as msg:
                got[msg.msg_id] = msg.data
    return got


def test_produce_many_survives_kill_9_of_the_node_it_talks_to(cluster):
    c = cluster()
    m = c.wait_master()
    # The client starts on the master, the hardest node to lose: its
    # in-flight requests die with it and the others say "no leader" until
    # a new master is elected.
    order = [m] + [i for i in range(1, 4) if i != m]
    hosts = [f"127.0.0.1:{c.port(i)}" for i in order]
    acked: dict[int, str] = {}
    batches = []
    stop = threading.Event()
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            with Client(hosts, timeout=5, retry_for=DEADLINE_S, shuffle=False) as client:
                b = 0
                while not stop.is_set():
                    items = [{"queue": "ha", "data": f"b{b}-{i}", "retry": 60} for i in range(400)]
                    ids = client.produce_many(items, window=200)
                    acked.update(zip(ids, (item["data"] for item in items)))
                    batches.append(client.address)
                    b += 1
        except BaseException as exc:  # reported by the test thread
            failure.append(exc)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    wait_until(lambda: len(batches) >= 2 or failure, DEADLINE_S)
    assert not failure, failure
    assert batches[-1] == ("127.0.0.1", c.port(m))
    c.kill(m)
    after_kill = len(batches)
    alive = [i for i in range(1, 4) if i != m]
    c.wait_master(alive=alive)
    wait_until(lambda: len(batches) >= after_kill + 3 or failure, DEADLINE_S)
    stop.set()
    producer.join(DEADLINE_S)
    assert not failure, failure
    assert batches[-1] != ("127.0.0.1", c.port(m))
    got = drain([f"127.0.0.1:{c.port(i)}" for i in alive], "ha")
    missing = {i: d for i, d in acked.items() if got.get(i) != d}
    assert not missing, f"acknowledged ids not consumable: {sorted(missing)[:10]}"
    # at-least-once: a resent item may be stored twice, never lost
    assert set(got.values()) == set(acked.values())

    # Without a majority there is no master: "no leader" is retried, then raised.
    new_master = c.wait_master(alive=alive)
    last = next(i for i in alive if i != new_master)
    c.kill(new_master)
    wait_until(lambda: (c.ask(last, action=1, queue="ha", data="lost") or {}).get("reason")
               == "no leader", DEADLINE_S)
    with Client([f"127.0.0.1:{c.port(last)}"], retry_for=0.5) as client:
        start = time.monotonic()
        with pytest.raises(NoLeader) as info:
            client.produce("ha", "lost")
        assert info.value.reason == "no leader"
        assert time.monotonic() - start >= 0.5  # retried for the whole retry time


def test_redirects_are_followed_without_forwarding(cluster):
    c = cluster(extra='<replication forward_request="0"/>\n')
    m = c.wait_master()
    slave = next(i for i in range(1, 4) if i != m)
    with Client([f"127.0.0.1:{c.port(slave)}"], retry_for=DEADLINE_S) as client:
        assert client.produce("redir", "one") == 1
        assert client.address == ("127.0.0.1", c.port(m))  # stays with the master
        ids = client.produce_many([{"queue": "redir", "data": str(i)} for i in range(1000)])
        assert ids == list(range(2, 1002))
        assert client.monitor(local=True)["role"] == "master"
    with Client([f"127.0.0.1:{c.port(slave)}"], retry_for=DEADLINE_S) as client:
        ids = client.produce_many([{"queue": "redir2", "data": str(i)} for i in range(500)])
        assert ids == list(range(1, 501))

    async def consume_via_slave() -> Message | None:
        async with AsyncClient([("127.0.0.1", c.port(slave))], retry_for=DEADLINE_S) as ac:
            return await ac.consume("redir")

    assert run(consume_via_slave()) == Message(queue="redir", msg_id=1, data="one")
