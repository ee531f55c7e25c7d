"""The node-to-node link layer (qserver.engines.peers) on real loopback sockets.

Every test runs its own event loop under a hard timeout, waits on conditions
with generous deadlines (never on bare sleeps), closes everything it opened,
and is then checked for leaks: no task left, no ResourceWarning, no error
from the loop's exception handler, no file descriptor left open.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import logging
import os
import socket
import warnings

import msgpack
import pytest
import uvloop

from procs import free_port
from qserver.engines import peers as peers_mod
from qserver.engines.peers import (
    MAX_FRAME_BYTES,
    MAX_HANDSHAKE_FRAME_BYTES,
    PROTOCOL,
    PeerNetwork,
    _PeerLink,
    _Role,
)

HOST = "127.0.0.1"
SECRET = "correct horse battery staple"
# A whole test must finish within this (the hard timeout).
TEST_TIMEOUT_S = 30.0
# One awaited condition must come true within this: generous, CI is noisy.
WAIT_S = 10.0

LOOPS = ["asyncio", "uvloop"]

# libuv opens a process-wide pipe with its first loop and keeps it: open it
# now, so that the file-descriptor leak check below does not count it.
uvloop.new_event_loop().close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run(body, loop_kind: str = "asyncio") -> None:
    """Run `body(h)` on a fresh loop under TEST_TIMEOUT_S, then check for leaks."""
    problems: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: problems.append(ctx["message"]))
        h = Harness()
        async with asyncio.timeout(TEST_TIMEOUT_S):  # covers the clean-up too
            try:
                await body(h)
            finally:
                await h.aclose()
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not leftover, f"tasks left running: {leftover}"

    fds = open_fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        factory = uvloop.new_event_loop if loop_kind == "uvloop" else None
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], \
        [str(w.message) for w in caught]
    assert not problems, problems
    assert open_fds() == fds, "file descriptors leaked"


class Node:
    """A PeerNetwork and what it has told us."""

    def __init__(self, h: Harness, node_id: int) -> None:
        self.h = h
        self.node_id = node_id
        self.inbox: list[tuple[int, object]] = []
        self.link_events: list[tuple[int, bool]] = []
        self.net: PeerNetwork | None = None
        self.on_up = None  # optional extra on_link(peer, True) behaviour

    def on_message(self, peer: int, obj: object) -> None:
        self.inbox.append((peer, obj))
        self.h.poke()

    def on_link(self, peer: int, up: bool) -> None:
        self.link_events.append((peer, up))
        if up and self.on_up is not None:
            self.on_up(peer)
        self.h.poke()

    def got(self, peer: int) -> list:
        return [obj for p, obj in self.inbox if p == peer]

    def send_to_all(self, obj: object) -> int:
        """`net.send(peer, obj)` to every configured peer; how many queued it."""
        return sum(self.net.send(peer, obj) for peer in sorted(self.net.peers))


class RecordWarnings(logging.Handler):
    def __init__(self, h: Harness) -> None:
        super().__init__(logging.WARNING)
        self.h = h
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.h.poke()


class Harness:
    """Starts nodes and raw connections, wakes waiters on every observed
    change, and closes everything at the end."""

    def __init__(self) -> None:
        self.changed = asyncio.Event()
        self.nodes: list[Node] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.warnings = RecordWarnings(self)
        self.logger = logging.getLogger("qserver.engines.peers")
        self.logger.addHandler(self.warnings)

    def poke(self) -> None:
        self.changed.set()

    async def until(self, predicate, what: str, wait_s: float = WAIT_S) -> None:
        """Wait until predicate() holds; re-checked after every change."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not predicate():
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError(f"timed out after {wait_s} s waiting for {what}")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except TimeoutError:
                pass

    def warned(self, *parts: str) -> int:
        return sum(all(p in m for p in parts) for m in self.warnings.messages)

    async def start_nodes(self, ids, *, secret=SECRET, secrets=None, peers_of=None,
                          ports=None, setup=None, **kw) -> dict[int, Node]:
        """Start one PeerNetwork per id on free ports; peers_of(i) lists the
        ids node i knows (default: all others); secrets maps id -> secret;
        setup(node) runs before each node starts."""
        for attempt in range(5):
            ports = ports or {}
            port_of = {i: ports.get(i) or free_port() for i in ids}
            started: dict[int, Node] = {}
            try:
                for i in ids:
                    known = peers_of(i) if peers_of else [j for j in ids if j != i]
                    addrs = {j: (HOST, port_of[j]) for j in known if j in port_of}
                    addrs.update({j: (HOST, free_port()) for j in known if j not in port_of})
                    started[i] = await self.start_node(
                        i, port_of[i], addrs, secrets.get(i) if secrets else secret,
                        setup=setup, **kw)
                return started
            except OSError:  # a "free" port was taken meanwhile: try others
                for node in started.values():
                    await node.net.close()
                if attempt == 4 or ports:
                    raise
        raise AssertionError("unreachable")

    async def start_node(self, node_id, port, peers, secret=SECRET, setup=None, **kw) -> Node:
        node = Node(self, node_id)
        if setup is not None:
            setup(node)
        node.net = PeerNetwork(node_id=node_id, listen=(HOST, port), peers=peers, secret=secret,
                               on_message=node.on_message, on_link=node.on_link, **kw)
        self.nodes.append(node)
        await node.net.start()
        return node

    async def connect_raw(self, node: Node):
        reader, writer = await asyncio.open_connection(*node.net.address)
        self.writers.append(writer)
        return reader, writer

    async def aclose(self) -> None:
        self.logger.removeHandler(self.warnings)
        for writer in self.writers:
            writer.close()
        for writer in self.writers:
            try:
                await writer.wait_closed()
            except OSError:
                pass
        for node in self.nodes:
            await node.net.close()


def all_connected(nodes) -> bool:
    ids = {n.node_id for n in nodes}
    return all(n.net.connected_ids() >= ids - {n.node_id} for n in nodes)


def frame(obj) -> bytes:
    body = msgpack.packb(obj)
    return len(body).to_bytes(4, "big") + body


async def read_frame(reader: asyncio.StreamReader):
    header = await asyncio.wait_for(reader.readexactly(4), WAIT_S)
    body = await asyncio.wait_for(reader.readexactly(int.from_bytes(header, "big")), WAIT_S)
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """True once the other side closed or reset the connection."""
    try:
        while await asyncio.wait_for(reader.read(65536), WAIT_S):
            pass
    except ConnectionError:
        pass
    return True


def proof(secret: str, label: bytes, dialer_id, dialer_nonce, acceptor_id, acceptor_nonce):
    msg = (label + dialer_nonce + acceptor_nonce + dialer_id.to_bytes(8, "big", signed=True)
           + acceptor_id.to_bytes(8, "big", signed=True))
    return hmac.new(secret.encode(), msg, hashlib.sha256).digest()


async def raw_dial_as(h: Harness, node: Node, my_id: int, secret: str = SECRET):
    """Do the dialer's side of the handshake by hand (this pins the wire
    format); return the stream once the auth frame is written."""
    reader, writer = await h.connect_raw(node)
    nonce = os.urandom(16)
    writer.write(frame([PROTOCOL, "hello", my_id, nonce]))
    welcome = await read_frame(reader)
    assert welcome[:3] == [PROTOCOL, "welcome", node.node_id]
    their_nonce, their_proof = welcome[3], welcome[4]
    assert hmac.compare_digest(their_proof, proof(SECRET, b"qserver-peer/1 acceptor proof",
                                                  my_id, nonce, node.node_id, their_nonce))
    mine = proof(secret, b"qserver-peer/1 dialer proof", my_id, nonce, node.node_id, their_nonce)
    writer.write(frame([PROTOCOL, "auth", mine]))
    return reader, writer


# Exchange


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_three_nodes_exchange_both_ways_and_to_every_peer(loop_kind):
    async def body(h: Harness):
        nodes = await h.start_nodes([1, 2, 3])
        n = list(nodes.values())
        await h.until(lambda: all_connected(n), "all links up")
        for a in n:
            assert sorted(a.link_events) == [(p, True) for p in sorted(a.net.peers)]
            for b in n:
                if a is not b:
                    assert a.net.send(b.node_id, {"from": a.node_id, "to": b.node_id,
                                                  "data": b"\x00\xff", "list": [1, "x"]})
        for a in n:
            assert a.send_to_all(["to all", a.node_id]) == 2

        def done():
            return all(len(b.inbox) == 4 for b in n)
        await h.until(done, "every node to get 2 sends and 2 sends to all")
        for b in n:
            for a in n:
                if a is not b:
                    assert b.got(a.node_id) == [
                        {"from": a.node_id, "to": b.node_id, "data": b"\x00\xff",
                         "list": [1, "x"]},
                        ["to all", a.node_id]]
    run(body, loop_kind)


def test_without_a_secret_node_ids_are_still_exchanged():
    async def body(h: Harness):
        nodes = await h.start_nodes([1, 2], secret=None)
        await h.until(lambda: all_connected(nodes.values()), "link up")
        assert nodes[1].net.send(2, {7: "int keys survive"})
        await h.until(lambda: nodes[2].inbox, "message")
        assert nodes[2].inbox == [(1, {7: "int keys survive"})]
    run(body)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_messages_arrive_in_order_per_link(loop_kind):
    count = 5000

    async def body(h: Harness):
        nodes = await h.start_nodes([1, 2])
        a, b = nodes[1], nodes[2]
        await h.until(lambda: all_connected([a, b]), "link up")
        for i in range(count):
            assert a.net.send(2, i)
            assert b.net.send(1, [i, "x" * (i % 50)])
            if i % 97 == 0:
                await asyncio.sleep(0)  # spread the sends over many loop turns
        await h.until(lambda: len(a.inbox) == count and len(b.inbox) == count, "all messages")
        assert b.got(1) == list(range(count))
        assert a.got(2) == [[i, "x" * (i % 50)] for i in range(count)]
    run(body, loop_kind)


def test_large_message_arrives_whole():
    big = os.urandom(5 * 1024 * 1024)

    async def body(h: Harness):
        nodes = await h.start_nodes([1, 2])
        await h.until(lambda: all_connected(nodes.values()), "link up")
        assert nodes[1].net.send(2, "before")
        assert nodes[1].net.send(2, {"snapshot": big})
        assert nodes[1].net.send(2, "after")
        assert nodes[2].send_to_all([big, big[:10]]) == 1
        await h.until(lambda: len(nodes[2].inbox) == 3 and len(nodes[1].inbox) == 1, "3+1 msgs")
        assert nodes[2].got(1) == ["before", {"snapshot": big}, "after"]
        assert nodes[1].got(2) == [[big, big[:10]]]
    run(body)


def test_message_sent_from_on_link_up_is_delivered():
    async def body(h: Harness):
        def greet(node: Node) -> None:
            node.on_up = lambda peer: node.net.send(peer, f"hi from {node.node_id}")

        nodes = await h.start_nodes([1, 2], setup=greet)
        a, b = nodes[1], nodes[2]
        await h.until(lambda: a.inbox and b.inbox, "the greetings")
        assert a.inbox == [(2, "hi from 2")]
        assert b.inbox == [(1, "hi from 1")]
    run(body)


def test_send_to_a_down_or_unknown_peer_returns_false():
    async def body(h: Harness):
        nodes = await h.start_nodes([1], peers_of=lambda i: [2, 3])  # 2 and 3 never start
        net = nodes[1].net
        assert not net.send(2, "x")
        assert not net.send(99, "x")
        assert nodes[1].send_to_all("x") == 0
        assert not net.connected(2)
        assert net.connected_ids() == set()
    run(body)


def test_unencodable_message_is_refused_without_raising():
    async def body(h: Harness):
        nodes = await h.start_nodes([1, 2])
        await h.until(lambda: all_connected(nodes.values()), "link up")
        assert nodes[1].net.send(2, object()) is False
        assert nodes[1].send_to_all({"x": {1, 2}}) == 0
        assert nodes[1].net.send(2, "still fine")
        await h.until(lambda: nodes[2].inbox, "the good message")
        assert nodes[2].inbox == [(1, "still fine")]
    run(body)


def test_start_raises_oserror_when_the_port_is_taken():
    async def body(h: Harness):
        with socket.socket() as taken:
            taken.bind((HOST, 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(OSError):
                await h.start_node(1, port, {2: (HOST, free_port())})
    run(body)


# Restart


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_restarted_peer_is_reconnected_and_messages_flow_again(loop_kind):
    async def body(h: Harness):
        nodes = await h.start_nodes([1, 2, 3])
        await h.until(lambda: all_connected(nodes.values()), "all links up")
        old = nodes[2]
        port = old.net.address[1]
        await old.net.close()
        h.nodes.remove(old)
        await h.until(lambda: not nodes[1].net.connected(2) and not nodes[3].net.connected(2),
                      "link to node 2 down on 1 and 3")
        assert nodes[1].link_events[-1] == (2, False)
        assert nodes[3].link_events[-1] == (2, False)
        assert nodes[1].net.send(2, "lost") is False
        assert nodes[1].send_to_all("to 3 only") == 1

        new = await h.start_node(2, port, {1: (HOST, nodes[1].net.address[1]),
                                           3: (HOST, nodes[3].net.address[1])})
        trio = [nodes[1], new, nodes[3]]
        await h.until(lambda: all_connected(trio), "node 2 reconnected")
        assert nodes[1].link_events[-1] == (2, True)
        for i in range(3):
            assert nodes[1].net.send(2, ["from 1", i])
            assert nodes[3].net.send(2, ["from 3", i])
            assert new.send_to_all(["from 2", i]) == 2
        await h.until(lambda: len(new.inbox) == 6 and len(nodes[1].got(2)) == 3
                      and len(nodes[3].got(2)) == 3, "messages after the restart")
        assert new.got(1) == [["from 1", i] for i in range(3)]
        assert new.got(3) == [["from 3", i] for i in range(3)]
        assert nodes[1].got(2) == nodes[3].got(2) == [["from 2", i] for i in range(3)]
        assert nodes[3].got(1) == ["to 3 only"]
    run(body, loop_kind)


# Authentication


@pytest.mark.parametrize("good, bad", [(SECRET, "wrong"), (SECRET, None), (None, SECRET)],
                         ids=["wrong-secret", "no-secret", "unexpected-secret"])
def test_wrong_secret_never_comes_up(good, bad):
    async def body(h: Harness):
        nodes = await h.start_nodes([1, 2, 3], secrets={1: good, 2: good, 3: bad})
        await h.until(lambda: nodes[1].net.connected(2) and nodes[2].net.connected(1),
                      "the good link")
        # Each side has refused the other at least twice (so it also redials).
        await h.until(lambda: h.warned("node 1: dropping dialer", "(node 3)") >= 2
                      and h.warned("node 3: dropping dialer", "(node 1)") >= 2
                      and h.warned("node 2: dropping dialer", "(node 3)") >= 2,
                      "refusals logged")
        assert not nodes[3].net.connected_ids()
        assert nodes[3].send_to_all("let me in") == 0
        assert nodes[3].net.send(1, "let me in") is False
        assert not nodes[3].link_events
        assert nodes[1].link_events == [(2, True)] and nodes[2].link_events == [(1, True)]
        assert not nodes[1].got(3) and not nodes[2].got(3)
        assert nodes[1].net.send(2, "good")
        await h.until(lambda: nodes[2].inbox, "a good message")
    run(body)


def test_forged_proof_is_dropped_and_nothing_after_it_is_delivered():
    async def body(h: Harness):
        nodes = await h.start_nodes([1], peers_of=lambda i: [2])
        reader, writer = await h.connect_raw(nodes[1])
        nonce = os.urandom(16)
        writer.write(frame([PROTOCOL, "hello", 2, nonce]))
        welcome = await read_frame(reader)
        forged = proof("guess", b"qserver-peer/1 dialer proof", 2, nonce, 1, welcome[3])
        writer.write(frame([PROTOCOL, "auth", forged]) + frame("smuggled"))
        assert await closed_by_peer(reader)
        await h.until(lambda: h.warned("node 1: dropping acceptor", "authentication failed"),
                      "warning")
        # Replaying the acceptor's own proof as ours does not work either.
        reader, writer = await h.connect_raw(nodes[1])
        writer.write(frame([PROTOCOL, "hello", 2, nonce]))
        welcome = await read_frame(reader)
        writer.write(frame([PROTOCOL, "auth", welcome[4]]) + frame("smuggled"))
        assert await closed_by_peer(reader)
        assert not nodes[1].inbox and not nodes[1].link_events
    run(body)


def test_unknown_node_id_is_dropped():
    async def body(h: Harness):
        nodes = await h.start_nodes([1, 2])
        await h.until(lambda: all_connected(nodes.values()), "the good link")
        # Node 9 is not in node 1's peers map, even with the right secret.
        stranger = await h.start_node(9, 0, {1: nodes[1].net.address})
        await h.until(lambda: h.warned("node 1: dropping acceptor", "unknown node id 9") >= 2,
                      "node 9 refused twice")
        assert not stranger.net.connected_ids()
        assert stranger.net.send(1, "x") is False
        # A hello that claims node 1's own id, or a non-int id.
        for claimed in (1, "2", True, None):
            reader, writer = await h.connect_raw(nodes[1])
            writer.write(frame([PROTOCOL, "hello", claimed, os.urandom(16)]))
            assert await closed_by_peer(reader)
            assert h.warned("node 1: dropping acceptor", f"unknown node id {claimed!r}")
        assert nodes[1].link_events == [(2, True)] and not nodes[1].got(9)
        assert nodes[1].net.send(2, "still serving")
        await h.until(lambda: nodes[2].inbox, "a good message")
    run(body)


def test_dialed_address_answering_as_another_node_is_dropped():
    async def body(h: Harness):
        # Node 1 believes node 2 lives where node 3 listens.
        n3 = await h.start_node(3, 0, {1: (HOST, free_port())})
        n1 = await h.start_node(1, 0, {2: n3.net.address})
        await h.until(lambda: h.warned("node 1: dropping dialer",
                                       "answered as node id 3, expected node 2"),
                      "the mismatch refused")
        assert not n1.net.connected_ids() and not n3.inbox and not n1.inbox
    run(body)


def test_handshake_timeout_drops_a_silent_connection():
    async def body(h: Harness):
        nodes = await h.start_nodes([1, 2], handshake_timeout_s=0.5)
        await h.until(lambda: all_connected(nodes.values()), "the good link")
        silent_reader, _ = await h.connect_raw(nodes[1])
        partial_reader, partial = await h.connect_raw(nodes[1])
        partial.write(frame([PROTOCOL, "hello", 2, os.urandom(16)])[:10])
        assert await closed_by_peer(silent_reader)
        assert await closed_by_peer(partial_reader)
        assert h.warned("node 1: dropping acceptor", "handshake not finished") == 2
        assert nodes[1].link_events == [(2, True)]
    run(body)


# Garbage


GARBAGE = {
    "http request": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "undecodable body": b"\x00\x00\x00\x01\xc1",
    "trailing bytes in body": b"\x00\x00\x00\x02\x01\x02",
    "not a hello": frame({"hello": 1}),
    "wrong protocol": frame(["qserver-peer/0", "hello", 2, os.urandom(16)]),
    "short nonce": frame([PROTOCOL, "hello", 2, b"short"]),
    "welcome to an acceptor": frame([PROTOCOL, "welcome", 2, os.urandom(16), None]),
    "handshake frame too large": (MAX_HANDSHAKE_FRAME_BYTES + 1).to_bytes(4, "big") + b"x" * 100,
    "huge length prefix": b"\xff\xff\xff\xff",
}


def test_garbage_from_a_raw_socket_is_dropped_and_good_peers_are_served():
    async def body(h: Harness):
        nodes = await h.start_nodes([1, 2])
        await h.until(lambda: all_connected(nodes.values()), "the good link")
        for name, garbage in GARBAGE.items():
            before = h.warned("node 1: dropping acceptor")
            reader, writer = await h.connect_raw(nodes[1])
            writer.write(garbage)
            assert await closed_by_peer(reader), name
            await h.until(lambda before=before: h.warned("node 1: dropping acceptor") == before + 1,
                          f"a warning for {name}")
            assert nodes[1].net.send(2, name)
            assert nodes[2].net.send(1, name)
        await h.until(lambda: len(nodes[1].inbox) == len(nodes[2].inbox) == len(GARBAGE),
                      "the good peers' messages")
        assert nodes[1].got(2) == nodes[2].got(1) == list(GARBAGE)
        assert nodes[1].link_events == [(2, True)]
    run(body)


@pytest.mark.parametrize("bad", [
    (MAX_FRAME_BYTES + 1).to_bytes(4, "big") + b"\x00" * 1000,
    b"\x00\x00\x00\x01\xc1",
], ids=["oversized-length-prefix", "undecodable"])
def test_authenticated_peer_breaking_framing_is_dropped(bad):
    async def body(h: Harness):
        nodes = await h.start_nodes([1, 3], peers_of=lambda i: [2, 3] if i == 1 else [1])
        await h.until(lambda: all_connected([nodes[1], nodes[3]]), "the good link")
        reader, writer = await raw_dial_as(h, nodes[1], 2)
        writer.write(frame(["ok", 1]) + bad + frame(["after", 2]))
        assert await closed_by_peer(reader)
        await h.until(lambda: (2, False) in nodes[1].link_events, "the link down")
        assert nodes[1].got(2) == [["ok", 1]]
        assert nodes[1].link_events == [(3, True), (2, True), (2, False)] or \
            nodes[1].link_events == [(2, True), (3, True), (2, False)]
        assert h.warned("node 1: dropping acceptor", "(node 2)")
        assert nodes[1].net.send(3, "good peers still served")
        await h.until(lambda: nodes[3].inbox, "a good message")
    run(body)


def test_a_new_connection_from_a_peer_replaces_its_old_one():
    async def body(h: Harness):
        nodes = await h.start_nodes([1], peers_of=lambda i: [2])
        old_reader, _ = await raw_dial_as(h, nodes[1], 2)
        await h.until(lambda: nodes[1].net.connected(2), "first link")
        new_reader, new_writer = await raw_dial_as(h, nodes[1], 2)
        assert await closed_by_peer(old_reader)
        assert nodes[1].link_events == [(2, True)]  # never seen down: the new one took over
        new_writer.write(frame("via the new link"))
        await h.until(lambda: nodes[1].inbox, "a message")
        assert nodes[1].net.send(2, "reply")
        assert await read_frame(new_reader) == "reply"
    run(body)


def test_peer_that_stops_reading_is_dropped_instead_of_buffered(monkeypatch):
    monkeypatch.setattr(peers_mod, "MAX_SEND_BUFFER_BYTES", 1 << 20)

    async def body(h: Harness):
        nodes = await h.start_nodes([1], peers_of=lambda i: [2])
        await raw_dial_as(h, nodes[1], 2)  # authenticates, then never reads
        await h.until(lambda: nodes[1].net.connected(2), "the link")
        chunk = b"x" * 65536
        for i in range(10_000):
            if not nodes[1].net.send(2, chunk):
                break
            if i % 8 == 0:
                await asyncio.sleep(0)  # let the transport hand data to the kernel
        else:
            raise AssertionError("the send buffer was never found full")
        # Refused from now on, but on_link(False) never runs inside send().
        assert nodes[1].link_events == [(2, True)]
        assert nodes[1].net.send(2, b"more") is False
        await h.until(lambda: nodes[1].link_events == [(2, True), (2, False)], "the drop")
        assert h.warned("node 1: dropping acceptor", "peer is not reading")
    run(body)


# Framing, fed through a fake transport so that the chunking is exact


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def get_extra_info(self, name, default=None):
        return ("198.51.100.7", 4242) if name == "peername" else default

    def write(self, data) -> None:
        self.out += data

    def writelines(self, chunks) -> None:
        for chunk in chunks:
            self.out += chunk

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


def take_frames(out: bytearray) -> list:
    frames = []
    while len(out) >= 4:
        size = int.from_bytes(out[:4], "big")
        frames.append(msgpack.unpackb(bytes(out[4:4 + size]), raw=False))
        del out[:4 + size]
    return frames


@pytest.mark.parametrize("chunking", ["whole", "bytewise", "trailing-partial"])
def test_frames_split_anywhere_are_delivered_whole_and_in_order(chunking):
    messages = ["a", {"b": [1, 2, 3]}, b"\x00" * 70_000, [None, True, 2.5], "z" * 300]

    async def body(h: Harness):
        node = Node(h, 1)
        node.net = PeerNetwork(node_id=1, listen=(HOST, 0), peers={2: (HOST, 9)},
                               secret=SECRET, on_message=node.on_message,
                               on_link=node.on_link, loop=asyncio.get_running_loop())
        link = _PeerLink(node.net, _Role.ACCEPTOR)
        transport = FakeTransport()
        link.connection_made(transport)

        def feed(data: bytes) -> None:
            if chunking == "bytewise":
                for i in range(len(data)):
                    link.data_received(data[i:i + 1])
            else:
                link.data_received(data)

        nonce = os.urandom(16)
        feed(frame([PROTOCOL, "hello", 2, nonce]))
        await asyncio.sleep(0)  # the welcome is written on the next loop turn
        [welcome] = take_frames(transport.out)
        mine = proof(SECRET, b"qserver-peer/1 dialer proof", 2, nonce, 1, welcome[3])
        stream = frame([PROTOCOL, "auth", mine]) + b"".join(frame(m) for m in messages)
        if chunking == "trailing-partial":
            tail = frame("last")
            feed(stream + tail[:3])
            assert node.got(2) == messages
            feed(tail[3:7])
            assert node.got(2) == messages
            feed(tail[7:])
            messages.append("last")
        else:
            feed(stream)
        assert node.link_events == [(2, True)]
        assert node.got(2) == messages
        assert not transport.closed
        link.connection_lost(None)
        assert node.link_events == [(2, True), (2, False)]

    run(body)


def test_encode_gives_msgpacks_bytes_after_a_failure_and_after_a_large_message(caplog):
    """encode keeps one Packer: what it returns is always exactly
    msgpack.packb's bytes, also right after a message that could not be
    encoded (the Packer's buffer is cleared, not prepended to the next) and
    after one larger than PACKER_KEEP_BYTES (whose Packer is replaced)."""
    net = PeerNetwork(node_id=1, listen=("127.0.0.1", 0), peers={2: ("127.0.0.1", 1)},
                      secret="s", on_message=lambda peer_id, obj: None)
    small = [6, 3, 2, 123456, 0]
    assert net.encode(small) == msgpack.packb(small)
    with caplog.at_level(logging.ERROR, logger=peers_mod.__name__):
        assert net.encode([5, 1, {"x": object()}]) is None
    assert "cannot encode" in caplog.text
    assert net.encode(small) == msgpack.packb(small)
    packer = net._pack
    large = [5, "x" * (peers_mod.PACKER_KEEP_BYTES + 1)]
    assert net.encode(large) == msgpack.packb(large)
    assert net._pack is not packer  # the grown buffer went with it
    assert net.encode(small) == msgpack.packb(small)
