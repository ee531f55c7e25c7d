"""Faults a production queue meets, on real processes: a client that never
reads its answers, thousands of idle connections, running out of file
descriptors, an authenticated peer that sends garbage. Each must leave the
node serving everyone else. (A full disk: test_disk_full.py; a wall-clock
step: test_clock_step.py.)
"""

from __future__ import annotations

import json
import resource
import secrets
import select
import socket
import subprocess
import sys

import msgpack
import pytest

from procs import Cluster, NodeProcess, TcpClient, free_port, wait_until, write_config
from qserver.engines.peers import _LABEL_DIALER, NONCE_BYTES, PROTOCOL, _proof

IDLE_CONNECTIONS = 2000


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def start_node(procs, tmp_path, extra: str = "") -> NodeProcess:
    return procs(tmp_path, extra=extra)


# -- a client that sends and never reads -----------------------------------

# What the test client may send before the node must have stopped reading
# it: far more than the kernel's socket buffers (a few MB on loopback) plus
# what the node may hold for one connection (MAX_PIPELINE answers owed and
# the transport's buffer up to its high mark, plus one read's answers).
SEND_LIMIT_BYTES = 48 * 1024 * 1024

# The node's memory may grow by this much while it holds one stalled
# client's requests and answers (measured: a few MB).
RSS_GROWTH_LIMIT_BYTES = 48 * 1024 * 1024

# Once the client's writes have made no progress for this long, the node is
# taken to have stopped reading. A node that was only slow to read makes the
# test end early, not fail: what follows holds either way.
STALL_S = 3.0


def test_a_client_that_never_reads_is_no_longer_read_and_others_are_served(procs, tmp_path):
    node = start_node(procs, tmp_path)
    port = node.port
    # a monitor request is answered with several times its size
    request = json.dumps({"action": 4, "queue": "q"}).encode()
    chunk = request * 2048
    rss_before = rss_bytes(node.proc.pid)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    sent = 0
    try:
        while sent < SEND_LIMIT_BYTES:
            _, writable, _ = select.select([], [s], [], STALL_S)
            if not writable:
                break  # the node has stopped reading this client
            try:
                sent += s.send(chunk[sent % len(chunk):])
            except BlockingIOError:
                continue
        assert sent < SEND_LIMIT_BYTES, "the node kept reading a client that never reads"
        assert rss_bytes(node.proc.pid) - rss_before < RSS_GROWTH_LIMIT_BYTES

        # others are unaffected
        other = TcpClient(port)
        assert other.request(action=1, queue="other", data="x")["code"] == 0
        assert other.request(action=2, queue="other")["data"] == "x"
        other.close()

        # the stalled client gets every answer, in order, once it reads
        s.setblocking(True)
        s.settimeout(30)
        s.shutdown(socket.SHUT_WR)  # a partial last request is never answered
        complete = sent // len(request)
        buf = b""
        answers = 0
        while answers < complete:
            data = s.recv(1 << 20)
            assert data, f"closed after {answers} of {complete} answers"
            buf += data
            lines = buf.split(b"\n")
            buf = lines.pop()
            for line in lines:
                assert json.loads(line)["code"] == 0
            answers += len(lines)
        assert answers == complete
    finally:
        s.close()
    assert node.proc.poll() is None


# -- many idle clients ------------------------------------------------------

def _raise_own_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"this test opens {needed} sockets; the hard open-file limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def start_with_fd_limit(tmp_path, soft: int, hard: int) -> NodeProcess:
    """A `qserver run` whose open-file limit starts at (soft, hard)."""
    port = free_port()
    path = write_config(tmp_path / "node.xml", port)

    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    node = NodeProcess.__new__(NodeProcess)
    node.config_path, node.port = path, port
    node.stdout_lines, node.stderr_text = [], ""
    node.proc = subprocess.Popen([sys.executable, "-m", "qserver", "run", "--config", str(path)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 preexec_fn=set_limit)
    return node


def test_two_thousand_idle_connections_are_accepted_and_others_served(tmp_path):
    """The node starts with the usual soft open-file limit of 1024, which it
    raises towards the hard limit (and says so)."""
    needed = IDLE_CONNECTIONS + 256
    _raise_own_fd_limit(needed)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    node = start_with_fd_limit(tmp_path, 1024, hard)
    idle: list[socket.socket] = []
    try:
        node.wait_ready()
        for _ in range(IDLE_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", node.port), timeout=30))
        # another client is served while they are all open
        c = TcpClient(node.port)
        assert c.request(action=1, queue="q", data="x")["code"] == 0
        assert c.request(action=2, queue="q")["data"] == "x"
        # every idle connection was accepted and is served: one request each
        request = json.dumps({"action": 4, "queue": "q"}).encode()
        for s in idle:
            s.sendall(request)
        for s in idle:
            buf = b""
            while not buf.endswith(b"\n"):
                data = s.recv(65536)
                assert data, "an idle connection was closed by the node"
                buf += data
            assert json.loads(buf)["code"] == 0
        assert c.request(action=1, queue="q", data="y")["code"] == 0
        c.close()
        assert node.proc.poll() is None
    finally:
        for s in idle:
            s.close()
        node.stop()
    assert "raised the open-file limit from 1024 to" in node.stderr_text


def test_running_out_of_descriptors_pauses_accepting_and_the_node_serves_on(tmp_path):
    """With a hard open-file limit it cannot raise, the node meets EMFILE
    when accepting: it must neither die nor spin, and once connections
    close it accepts again."""
    limit = 64
    node = start_with_fd_limit(tmp_path, limit, limit)
    port, proc = node.port, node.proc
    conns: list[socket.socket] = []
    try:
        node.wait_ready()
        first = TcpClient(port)  # connected before the descriptors run out
        for _ in range(2 * limit):  # the kernel completes these; the node cannot accept all
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        # the node is alive and serves the client it holds
        assert first.request(action=1, queue="q", data="x")["code"] == 0
        for s in conns:
            s.close()
        conns.clear()
        # once descriptors are free again, new clients are accepted and served
        c = wait_until(lambda: _fresh_client_answer(port), deadline_s=60)
        assert c["code"] == 0
        assert first.request(action=2, queue="q")["data"] == "x"
        first.close()
        assert proc.poll() is None
        assert node.stop() == 0
    finally:
        for s in conns:
            s.close()
        node.kill()
    assert " CRITICAL " not in node.stderr_text


def _fresh_client_answer(port: int) -> dict | None:
    try:
        c = TcpClient(port)
        c.sock.settimeout(2)
        try:
            return c.request(action=1, queue="q2", data="y")
        finally:
            c.close()
    except (OSError, ConnectionError, ValueError):
        return None


# -- an authenticated peer that sends garbage --------------------------------

class FakePeer:
    """The test as node `node_id` of a cluster: dials a node's internal
    port and authenticates with the cluster secret as qserver.engines.peers does."""

    def __init__(self, port: int, node_id: int, acceptor_id: int, secret: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""
        nonce = secrets.token_bytes(NONCE_BYTES)
        self.send_obj([PROTOCOL, "hello", node_id, nonce])
        welcome = self.read_obj()
        assert welcome[:3] == [PROTOCOL, "welcome", acceptor_id], welcome
        mine = _proof(secret.encode(), _LABEL_DIALER, node_id, nonce, acceptor_id, welcome[3])
        self.send_obj([PROTOCOL, "auth", mine])

    def send_frame(self, body: bytes) -> None:
        self.sock.sendall(len(body).to_bytes(4, "big") + body)

    def send_obj(self, obj: object) -> None:
        self.send_frame(msgpack.packb(obj))

    def read_obj(self) -> object:
        """The next frame; None once the node closed the connection."""
        while True:
            if len(self.buf) >= 4:
                size = int.from_bytes(self.buf[:4], "big")
                if len(self.buf) >= 4 + size:
                    body, self.buf = self.buf[4:4 + size], self.buf[4 + size:]
                    return msgpack.unpackb(body, raw=False, strict_map_key=False)
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.buf += data

    def close(self) -> None:
        self.sock.close()


# Messages an authenticated peer might send that are not qserver messages,
# or are with a wrong field: each is dropped (and logged), the link stays.
MALFORMED_MESSAGES = [
    None, 0, "push", b"\x00", [], {}, [5], {"tag": 5},
    [99, 1, 3], [5, -1, 3, 0, 0, [], 0, 0], [5, 1, 3, 0, 0, "records", 0, 0],
    [5, 1, 3, 0, 0, [[1, 1, [1, [["q", 0]], "d", 0, 0, 0]]], 0, 0],  # msg_id 0
    [5, 1, 3, 0, 0, [[2, 1, [0]]], 0, 0],  # records not consecutive after prev
    [5, 1, 3, 0, 0, [[1, 1, [42]]], 0, 0],  # unknown entry kind
    [5, 1.5, 3, 0, 0, [], 0, 0], [5, True, 3, 0, 0, [], 0, 0],
    [5, 2**64 - 1, 3, 0, 0, [], 0, 0, "x"],
    [2, 1, 1, 0, 0, 0],  # a ping in node 1's name
    [3, 1, 3, 0, 0, "yes"], [8, 1, 3, 1, ["not", "a", "map"]], [9, 1, 3, 1, None],
    [11, 1, 3, 1, 1, 0, "not bytes", True], [10, 1, 3, 1, 1, "state"],
    [10, 1000, 3, 50, 1000, [["q", "not a queue"]]],  # nodes send snapshots as files only
    [[[[[[[[[[[]]]]]]]]]]],
]


def test_an_authenticated_peer_sending_garbage_is_dropped_and_the_node_serves_on(tmp_path):
    """A cluster of three whose node 3 is the test: nodes 1 and 2 make the
    majority and serve writes while node 3 sends malformed messages (each
    dropped and logged, the link kept) and then a frame that is not msgpack
    (the link dropped). Neither node stops."""
    c = Cluster(tmp_path, extra='  <replication mode="quorum"/>\n')
    try:
        c.start(1, wait=False)
        c.start(2, wait=False)
        c.nodes[1].wait_ready()
        c.nodes[2].wait_ready()
        master = c.wait_master(alive=[1, 2])
        target = 3 - master  # the slave: forwards, applies what the master sends
        for victim in (master, target):
            peer = FakePeer(c.internal_ports[victim - 1], 3, victim, c.secrets[0])
            for obj in MALFORMED_MESSAGES:
                peer.send_obj(obj)
            # the link is still up: the node's messages to node 3 flow on it
            assert peer.read_obj() is not None
            r = c.ask(victim, action=1, queue="q", data=f"to {victim}")
            assert r and r["code"] == 0, r
            peer.send_frame(b"\xc1")  # never valid msgpack: the link is dropped
            while peer.read_obj() is not None:
                pass
            peer.close()
        for i in (1, 2):
            r = wait_until(lambda i=i: (r := c.ask(i, action=1, queue="q", data="after"))
                           and r.get("code") == 0 and r)
            assert c.nodes[i].proc.poll() is None
        assert c.ask(master, action=104, queue="q")["size"] == 4
    finally:
        c.stop_all()
    for i in (1, 2):
        err = c.nodes[i].stderr_text
        assert " CRITICAL " not in err, err
        assert "bad message from node 3" in err
        assert "undecodable frame" in err
