"""Real qserver processes on free loopback ports, for integration tests.

Every process started here is tracked and killed at the end of the test that
started it (see the `procs` fixture in conftest.py), and every TcpClient and
UdpClient a test opens and does not close is closed when it ends (the
`close_clients` fixture), not left to the garbage collector (a
ResourceWarning, an error under the suite's filterwarnings). Waits are on
conditions with generous deadlines: CI is a shared, noisy 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from harness.nodes import pick_ports

# Generous: a cold Python start on a loaded 2-core machine can take seconds.
START_DEADLINE_S = 30.0
IO_TIMEOUT_S = 10.0


def wait_until(predicate, deadline_s: float = 30.0, step_s: float = 0.05):
    """Poll `predicate` until it returns something true; fail at the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    raise AssertionError("condition not met before the deadline")


def free_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 (at the time of asking)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
            t.bind(("127.0.0.1", 0))
            port = t.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                try:
                    u.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port")


class NodeProcess:
    """A `qserver run` child process."""

    def __init__(self, config_path: Path, port: int, env: dict | None = None) -> None:
        self.config_path = config_path
        self.port = port
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qserver", "run", "--config", str(config_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.stdout_lines: list[str] = []
        self.stderr_text = ""  # what it wrote to stderr, once stopped

    def wait_ready(self, deadline_s: float = START_DEADLINE_S) -> None:
        """Wait for the ready line on stdout; raise with stderr if it dies."""
        end = time.monotonic() + deadline_s
        buf = b""
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qserver exited with {self.proc.returncode}: "
                                   f"{self.proc.stderr.read().decode(errors='replace')}")
            r, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if r:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                buf += chunk
                if b"ready on" in buf:
                    self.stdout_lines = buf.decode().splitlines()
                    return
        raise TimeoutError("qserver did not become ready")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr and not self.proc.stderr.closed:
            self.stderr_text = self.proc.stderr.read().decode(errors="replace")
        for f in (self.proc.stdout, self.proc.stderr):
            if f:
                f.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def write_config(path: Path, port: int, extra: str = "", node_id: int = 1) -> Path:
    path.write_text(f'<config>\n  <node_info node_id="{node_id}" host="127.0.0.1" '
                    f'port="{port}"/>\n{extra}</config>\n')
    return path


# The clients open while a test runs (None outside `clients_closed_at_end`:
# a bench keeps none).
_open_clients: set[TcpClient | UdpClient] | None = None


def sockets_to(port: int) -> int:
    """How many TCP sockets this process holds open to 127.0.0.1:`port`
    (its descriptors' sockets, matched in /proc/net/tcp by inode; IPv4
    only: the tests connect to 127.0.0.1, never to localhost)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with suppress(OSError):  # closed meanwhile (listdir's own, say)
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    wanted = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as table:
        next(table)  # the header
        return sum(1 for row in map(str.split, table)
                   if row[2] == wanted and row[9] in inodes)


@contextmanager
def clients_closed_at_end() -> Iterator[None]:
    """Close, when the block ends, every client opened in it and still open."""
    global _open_clients
    _open_clients = set()
    try:
        yield
    finally:
        left, _open_clients = _open_clients, None
        for client in left:
            client.sock.close()


class TcpClient:
    """A minimal blocking TCP client: send requests, read newline-framed answers."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port), timeout=IO_TIMEOUT_S)
        if _open_clients is not None:
            _open_clients.add(self)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> dict:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by server")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def closed_by_server(self) -> bool:
        """True if the server closed the connection (EOF) after any buffered answers."""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
                self.buf += chunk
        except (TimeoutError, ConnectionResetError):
            return False

    def request(self, **fields) -> dict:
        self.send_raw(json.dumps(fields).encode())
        return self.read()

    def close(self) -> None:
        self.sock.close()
        if _open_clients is not None:
            _open_clients.discard(self)


def pipelined(port: int, requests: list[dict]) -> list[dict]:
    """Send every request in one write on a new connection, read every
    answer (in order)."""
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(b"".join(json.dumps(r).encode() + b"\n" for r in requests))
        buf = b""
        answers: list[dict] = []
        while len(answers) < len(requests):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by server")
            buf += chunk
            *lines, buf = buf.split(b"\n")
            answers += [json.loads(line) for line in lines]
        return answers


class UdpClient:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.addr = (host, port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if _open_clients is not None:
            _open_clients.add(self)
        self.sock.settimeout(IO_TIMEOUT_S)

    def send_raw(self, data: bytes) -> dict:
        self.sock.sendto(data, self.addr)
        data, _ = self.sock.recvfrom(70000)
        return json.loads(data)

    def request(self, **fields) -> dict:
        return self.send_raw(json.dumps(fields).encode())

    def close(self) -> None:
        self.sock.close()
        if _open_clients is not None:
            _open_clients.discard(self)


def cluster_config(node_id: int, client_ports: list[int], internal_ports: list[int],
                   secret: str | None = "test-secret", extra: str = "") -> str:
    nodes = "\n".join(f'    <node id="{i + 1}" host="127.0.0.1" port="{p}"/>'
                      for i, p in enumerate(internal_ports))
    secret_attr = f' secret="{secret}"' if secret else ""
    return (f'<config>\n  <node_info node_id="{node_id}" host="127.0.0.1" '
            f'port="{client_ports[node_id - 1]}"/>\n'
            f'  <cluster{secret_attr}>\n{nodes}\n  </cluster>\n{extra}</config>\n')


def with_engine(extra: str, engine: str | None) -> str:
    """`extra` config text with `<replication engine=...>` set (merged into
    a `<replication>` element already there); unchanged for None."""
    if engine is None:
        return extra
    if "<replication" in extra:
        return extra.replace("<replication", f'<replication engine="{engine}"', 1)
    return extra + f'  <replication engine="{engine}"/>\n'


class Cluster:
    """A local cluster of real `qserver run` processes on free ports."""

    def __init__(self, tmp_path: Path, n: int = 3, extra: str = "",
                 secrets: list[str | None] | None = None, engine: str | None = None) -> None:
        self.tmp_path = tmp_path
        self.n = n
        # Below the ephemeral range, with internal + RAFT_PORT_OFFSET (the raft
        # engine's port) free too: a port from free_port() is in that range,
        # where any connection made meanwhile may take it; and the raft port
        # was not checked at all (pysyncobj then retried its bind forever and
        # the cluster never agreed on a master).
        ports = pick_ports(n)
        self.client_ports = [p.client for p in ports]
        self.internal_ports = [p.internal for p in ports]
        self.extra = with_engine(extra, engine)
        self.engine = engine or "native"
        self.secrets = secrets or ["test-secret"] * n
        self.nodes: dict[int, NodeProcess] = {}

    def config_path(self, node_id: int) -> Path:
        path = self.tmp_path / f"node{node_id}.xml"
        path.write_text(cluster_config(node_id, self.client_ports, self.internal_ports,
                                       self.secrets[node_id - 1], self.extra))
        return path

    def start(self, node_id: int, wait: bool = True) -> NodeProcess:
        node = NodeProcess(self.config_path(node_id), self.client_ports[node_id - 1])
        self.nodes[node_id] = node
        if wait:
            node.wait_ready()
        return node

    def start_all(self) -> None:
        for i in range(1, self.n + 1):
            self.start(i, wait=False)
        for node in self.nodes.values():
            node.wait_ready()

    def kill(self, node_id: int) -> None:
        self.nodes[node_id].kill()

    def stop_all(self) -> None:
        for node in self.nodes.values():
            node.kill()

    def port(self, node_id: int) -> int:
        return self.client_ports[node_id - 1]

    def ask(self, node_id: int, **fields) -> dict | None:
        """One request to one node over a fresh TCP connection; None if down."""
        try:
            c = TcpClient(self.port(node_id))
            c.sock.settimeout(5)
            try:
                return c.request(**fields)
            finally:
                c.close()
        except (OSError, ConnectionError, ValueError):
            return None

    def master(self, alive: list[int] | None = None) -> int | None:
        """The node every live node agrees is master and that says so itself."""
        ids = alive or [i for i, p in self.nodes.items() if p.proc.poll() is None]
        roles = {i: self.ask(i, action=104) for i in ids}
        masters = [i for i, r in roles.items() if r and r.get("role") == "master"]
        if len(masters) != 1:
            return None
        m = masters[0]
        if all(r and r.get("leader_node_id") == m for r in roles.values()):
            return m
        return None

    def wait_master(self, deadline_s: float = 30.0, alive: list[int] | None = None) -> int:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            m = self.master(alive)
            if m is not None:
                return m
            time.sleep(0.05)
        raise TimeoutError("no master agreed on before the deadline")


def read_until(proc: subprocess.Popen, text: bytes, deadline_s: float = START_DEADLINE_S) -> bytes:
    """Read `proc`'s stdout until `text` appears; fail if it exits first."""
    assert proc.stdout is not None
    end = time.monotonic() + deadline_s
    buf = b""
    while text not in buf:
        if time.monotonic() > end:
            raise TimeoutError(f"no {text!r} on stdout: {buf!r}")
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}: {proc.communicate()}")
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            buf += os.read(proc.stdout.fileno(), 4096)
    return buf


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    """SIGTERM, then the exit status and all of stderr."""
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err.decode()


class ProducerThreads:
    """Threads producing distinct messages to `queue` until stopped (a
    load under which a test moves the master role); a subclass's
    `_run(k)` is thread k's loop, which adds each acknowledged message's
    data to `acked` under `lock` and ends once `stop_flag` is set."""

    def __init__(self, queue: str, count: int, join_s: float = 30.0) -> None:
        self.queue = queue
        self.join_s = join_s
        self.acked: set[str] = set()
        self.lock = threading.Lock()
        self.stop_flag = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                        for k in range(count)]

    def _run(self, k: int) -> None:
        raise NotImplementedError

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(self.join_s)

    def count(self) -> int:
        with self.lock:
            return len(self.acked)


def consume_all(port: int, queue: str, timeout_s: float = 30.0) -> list[str]:
    """Every message of `queue` from the node at `port`, taken 1,000 at a
    time (messages without a retry are deleted as they are delivered; a
    test's at-least-once messages stay in flight, which is fine at its end)."""
    client = TcpClient(port)
    client.sock.settimeout(timeout_s)
    got: list[str] = []
    try:
        while True:
            r = client.request(action=2, queue=queue, count=1000)
            assert r["code"] == 0, r
            if not r["messages"]:
                return got
            got.extend(m["data"] for m in r["messages"])
    finally:
        client.close()


# -- nodes in the test's own process (qserver.node.Node on an event loop) ----


async def ask_async(port: int, request: dict, timeout_s: float = 30.0) -> dict:
    """One request on a connection of its own to the node at `port`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(json.dumps(request).encode())
        return json.loads(await asyncio.wait_for(reader.readline(), timeout_s))
    finally:
        writer.close()


async def until_async(predicate, what: str, deadline_s: float = 30.0):
    """wait_until for a test on an event loop: `predicate()`'s first true
    value, polled every 20 ms without blocking the loop; AssertionError
    naming `what` after `deadline_s`."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"not before the deadline: {what}")
