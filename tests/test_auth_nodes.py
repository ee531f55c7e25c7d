"""Client authentication (issue 17, point 4) on real nodes: every auth case
on a single node, on both engines' masters, and through their slaves
(forwarding), over TCP and UDP, with raw requests, the Python client and
the command line.

Tokens: "admin" (every action, from a token file), "producer" (produce
only), "reader" (read: monitor, list, leader, show, peek, health). Every
refused request is answered code -1 with a reason that starts with
"unauthorized" and changes nothing (checked afterwards with the admin
token); no answer ever carries a `token` field (answers echo requests: a
token the slave forwarded would come back in the master's answer).

The single node and the two three-node clusters serve the whole module;
every test uses queues of its own. Processes are killed when the module
ends.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import (
    IO_TIMEOUT_S,
    Cluster,
    NodeProcess,
    TcpClient,
    UdpClient,
    free_port,
    pipelined,
    wait_until,
    write_config,
)
from qserver.auth import LOG_BURST
from qserver.client import AsyncClient, Client
from qserver.errors import Unauthorized

ADMIN = "admin-token-0123456789abcdef"
PRODUCER = "producer-token-0123456789"
READER = "reader-token-0123456789ab"
WRONG = "wrong-token-0123456789abcd"

SECURITY = f"""  <security client_token_file="admin.token">
    <token name="producer" token="{PRODUCER}" actions="produce"/>
    <token name="reader" token="{READER}" actions="read"/>
  </security>
"""

TARGETS = ["single", "native-master", "native-slave", "raft-master", "raft-slave"]


class AuthCluster(Cluster):
    """procs.Cluster whose own requests (master election checks) carry the
    admin token as a `token` field."""

    def ask(self, node_id: int, **fields) -> dict | None:
        return super().ask(node_id, token=ADMIN, **fields)


@pytest.fixture(scope="module")
def deployments(tmp_path_factory):
    """Where each target is: target name -> client port. Started lazily,
    once per module."""
    started: dict[str, int] = {}
    nodes: list[NodeProcess] = []
    clusters: list[Cluster] = []

    def port_of(target: str) -> int:
        if target in started:
            return started[target]
        if target == "single":
            directory = tmp_path_factory.mktemp("single")
            (directory / "admin.token").write_text(ADMIN + "\n")
            port = free_port()
            node = NodeProcess(write_config(directory / "node.xml", port, SECURITY), port)
            nodes.append(node)
            node.wait_ready()
            started[target] = port
            return port
        engine, role = target.split("-")
        directory = tmp_path_factory.mktemp(engine)
        (directory / "admin.token").write_text(ADMIN + "\n")
        cluster = AuthCluster(directory, 3, extra=SECURITY, engine=engine)
        clusters.append(cluster)
        cluster.start_all()
        master = cluster.wait_master(60)
        slave = next(i for i in range(1, 4) if i != master)
        started[f"{engine}-master"] = cluster.port(master)
        started[f"{engine}-slave"] = cluster.port(slave)
        return started[target]

    yield port_of
    for node in nodes:
        node.kill()
    for cluster in clusters:
        cluster.stop_all()


@pytest.fixture(params=TARGETS)
def target(request, deployments) -> tuple[str, int]:
    return request.param, deployments(request.param)


def admin(port: int, **fields) -> dict:
    """A request with the admin token (as a field) on a fresh connection."""
    c = TcpClient(port)
    try:
        return c.request(token=ADMIN, **fields)
    finally:
        c.close()


def size(port: int, queue: str) -> int:
    answer = admin(port, action=4, queue=queue)
    assert answer["code"] == 0, answer
    return answer["size"]


def queues(port: int) -> list[str]:
    answer = admin(port, action=7, pattern="")
    assert answer["code"] == 0, answer
    return [q["name"] for q in answer["queue_list"]]


def refused(answer: dict, *words: str) -> None:
    assert answer["code"] == -1, answer
    assert answer["reason"].startswith("unauthorized"), answer
    assert "token" not in answer
    for word in words:
        assert word in answer["reason"], (word, answer)


def queue_name(target: tuple[str, int], what: str) -> str:
    return f"{what}_{target[0].replace('-', '_')}"


# -- raw requests over TCP ------------------------------------------------------


def test_no_token_is_refused_and_changes_nothing(target):
    port = target[1]
    q = queue_name(target, "none")
    c = TcpClient(port)
    refused(c.request(action=1, queue=q, data="x", seq=1), "requires a client token")
    for fields in ({"action": 2, "queue": q}, {"action": 3, "queue": q, "msg_id": 1},
                   {"action": 4}, {"action": 104}, {"action": 7}, {"action": 8},
                   {"action": 5, "queue": q, "set": {"max_size": 5}},
                   {"action": 6, "queue": q}):
        refused(c.request(**fields))
    answer = c.request(action=1, queue=q, data="x", seq=9)
    assert answer["seq"] == 9 and "data" not in answer  # echoed as any answer, data dropped
    c.close()
    assert q not in queues(port)
    # with a token they go through
    assert admin(port, action=1, queue=q, data="x")["code"] == 0
    assert size(port, q) == 1


def test_wrong_token(target):
    port = target[1]
    q = queue_name(target, "wrong")
    c = TcpClient(port)
    refused(c.request(action=0, token=WRONG, seq=1), "unknown token")
    refused(c.request(action=1, queue=q, data="x"))  # still not authenticated
    refused(c.request(action=1, queue=q, data="x", token=WRONG), "unknown token")
    refused(c.request(action=0), "needs a token")
    refused(c.request(action=0, token=12345), "must be a string")
    # a good action 0, then a bad one: the connection is unauthenticated again
    assert c.request(action=0, token=ADMIN)["code"] == 0
    refused(c.request(action=0, token=WRONG))
    refused(c.request(action=1, queue=q, data="x"))
    c.close()
    assert q not in queues(port)


def test_action_0_authenticates_the_connection(target):
    port = target[1]
    q = queue_name(target, "auth0")
    c = TcpClient(port)
    answer = c.request(action=0, token=ADMIN, seq=5)
    assert answer == {"action": 0, "seq": 5, "code": 0, "name": "default"}
    produced = c.request(action=1, queue=q, data="hello", seq=6)
    assert produced["code"] == 0 and produced["seq"] == 6 and "token" not in produced
    got = c.request(action=2, queue=q)
    assert (got["code"], got["data"]) == (0, "hello")
    c.close()


def test_read_only_token_monitors_but_cannot_produce(target):
    port = target[1]
    q = queue_name(target, "reader")
    assert admin(port, action=1, queue=q, data="x")["code"] == 0
    c = TcpClient(port)
    assert c.request(action=0, token=READER) == {"action": 0, "code": 0, "name": "reader"}
    assert c.request(action=4, queue=q)["size"] == 1
    assert c.request(action=104)["code"] == 0
    assert q in [x["name"] for x in c.request(action=7)["queue_list"]]
    assert c.request(action=8)["code"] == 0
    assert c.request(action=12, queue=q)["code"] == 0  # peek
    refused(c.request(action=1, queue=q, data="y"), "token 'reader' is not allowed",
            "action 1 (produce)")
    refused(c.request(action=2, queue=q), "action 2 (consume)")
    refused(c.request(action=6, queue=q), "action 6 (clear)")
    refused(c.request(action=5, queue=q, set={"max_size": 1}), "action 5 (config)")
    c.close()
    assert size(port, q) == 1
    assert admin(port, action=5, queue=q)["config"].get("max_size") != 1


def test_producer_token_produces_only(target):
    port = target[1]
    q = queue_name(target, "producer")
    c = TcpClient(port)
    assert c.request(action=0, token=PRODUCER)["name"] == "producer"
    assert c.request(action=1, queue=q, data="x")["code"] == 0
    refused(c.request(action=2, queue=q), "token 'producer'", "consume")
    refused(c.request(action=4, queue=q), "monitor")
    c.close()
    assert size(port, q) == 1


def test_a_token_field_decides_for_its_request(target):
    port = target[1]
    q = queue_name(target, "field")
    c = TcpClient(port)
    # per request, without action 0 (and never echoed)
    answer = c.request(action=1, queue=q, data="x", token=PRODUCER)
    assert answer["code"] == 0 and "token" not in answer
    refused(c.request(action=4, queue=q, token=PRODUCER), "monitor")
    # on a connection authenticated as reader, a field decides alone
    assert c.request(action=0, token=READER)["code"] == 0
    assert c.request(action=1, queue=q, data="y", token=PRODUCER)["code"] == 0
    refused(c.request(action=1, queue=q, data="z"), "reader")
    c.close()
    assert size(port, q) == 2


def test_pipelined_requests_after_action_0_in_one_write(target):
    port = target[1]
    q = queue_name(target, "pipelined")
    answers = pipelined(port, [
        {"action": 0, "token": ADMIN, "seq": 0},
        {"action": 1, "queue": q, "data": "a", "seq": 1},
        {"action": 1, "queue": q, "data": "b", "seq": 2},
        {"action": 2, "queue": q, "seq": 3},
        {"action": 0, "token": WRONG, "seq": 4},
        {"action": 1, "queue": q, "data": "c", "seq": 5},
        {"action": 0, "token": READER, "seq": 6},
        {"action": 4, "queue": q, "seq": 7},
        {"action": 2, "queue": q, "seq": 8},
    ])
    assert [a["seq"] for a in answers] == list(range(9))
    assert [a["code"] for a in answers] == [0, 0, 0, 0, -1, -1, 0, 0, -1]
    assert answers[0]["name"] == "default" and answers[6]["name"] == "reader"
    assert answers[3]["data"] == "a"
    # a was consumed (at most once: gone), c refused: b is left
    assert (answers[7]["size"], answers[7]["max_id"]) == (1, answers[2]["msg_id"])
    assert all("token" not in a for a in answers)


# -- UDP: a token field on every request --------------------------------------------


def test_udp(target):
    name, port = target
    q = queue_name(target, "udp")
    u = UdpClient(port)
    refused(u.request(action=1, queue=q, data="x", seq=1), "requires a client token")
    refused(u.request(action=1, queue=q, data="x", token=WRONG), "unknown token")
    refused(u.request(action=1, queue=q, data="x", token=READER), "produce")
    answer = u.request(action=1, queue=q, data="x", token=PRODUCER, seq=2)
    assert answer["code"] == 0 and answer["seq"] == 2 and "token" not in answer
    assert u.request(action=4, queue=q, token=READER)["size"] == 1
    # action 0 over UDP checks the token; there is no connection to keep it
    assert u.request(action=0, token=READER) == {"action": 0, "code": 0, "name": "reader"}
    refused(u.request(action=4, queue=q))
    u.close()
    assert size(port, q) == 1


# -- the Python client ------------------------------------------------------------


def test_python_client(target):
    port = target[1]
    q = queue_name(target, "client")
    hosts = f"127.0.0.1:{port}"
    with Client(hosts, token=ADMIN) as c:
        ids = c.produce_batch(q, ["a", "b", "c"])
        assert len(ids) == 3 and c.produce(q, "d") > 0
        got = c.consume(q)
        assert got is not None and got.data == "a"
    with Client(hosts, token=READER) as c:
        assert c.monitor(q)["size"] == 3
        with pytest.raises(Unauthorized, match="not allowed action 1"):
            c.produce(q, "e")
    for token in (None, WRONG):
        with Client(hosts, token=token, retry_for=0) as c, pytest.raises(Unauthorized):
            c.monitor(q)
    assert size(port, q) == 3

    async def main() -> None:
        async with AsyncClient(hosts, token=PRODUCER) as ac:
            await ac.produce(q, "f")
            with pytest.raises(Unauthorized, match="consume"):
                await ac.consume(q)
        async with AsyncClient(hosts, token=WRONG) as ac:
            with pytest.raises(Unauthorized, match="unknown token"):
                await ac.monitor()

    import asyncio
    asyncio.run(main())
    assert size(port, q) == 4


# -- one node: the log, an open node, the command line --------------------------------


def start_single(tmp_path: Path, procs, extra: str = SECURITY) -> NodeProcess:
    (tmp_path / "admin.token").write_text(ADMIN)
    return procs(tmp_path, extra)


def test_failed_authentications_are_logged_rate_limited_without_tokens(procs, tmp_path):
    node = start_single(tmp_path, procs)
    c = TcpClient(node.port)
    for _ in range(3 * LOG_BURST):
        refused(c.request(action=0, token=WRONG))
    refused(c.request(action=1, queue="q", data="x"))
    c.close()
    u = UdpClient(node.port)
    refused(u.request(action=4, token=WRONG + "udp"))
    u.close()
    assert admin(node.port, action=4)["code"] == 0  # a good token is not logged
    node.stop()
    lines = [line for line in node.stderr_text.splitlines() if "refused" in line]
    assert 1 <= len(lines) <= LOG_BURST, node.stderr_text
    assert all(" WARNING " in line and "unauthorized" in line and "127.0.0.1:" in line
               for line in lines)
    assert WRONG not in node.stderr_text and ADMIN not in node.stderr_text


def test_action_0_on_an_open_node(procs, tmp_path):
    node = procs(tmp_path)  # no <security>
    c = TcpClient(node.port)
    assert c.request(action=0, token=ADMIN, seq=1) == {"action": 0, "seq": 1, "code": 0}
    assert c.request(action=1, queue="open", data="x")["code"] == 0
    c.close()
    with Client(f"127.0.0.1:{node.port}", token=ADMIN) as client:
        assert client.produce("open", "y") == 2
    u = UdpClient(node.port)
    assert u.request(action=0, token=ADMIN)["code"] == 0
    u.close()


def run_cli(*args: str, env_token: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QSERVER_TOKEN"}
    if env_token is not None:
        env["QSERVER_TOKEN"] = env_token
    return subprocess.run([sys.executable, "-m", "qserver", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_cli_token_options(procs, tmp_path):
    node = start_single(tmp_path, procs)
    server = ["-s", f"127.0.0.1:{node.port}", "--retry-for", "0"]
    (tmp_path / "producer.token").write_text(PRODUCER + "\n")
    done = run_cli("produce", "cliq", "hello", *server, "--token-file",
                   str(tmp_path / "producer.token"))
    assert done.returncode == 0, done.stderr
    done = run_cli("monitor", "cliq", *server, "--json", env_token=READER)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["size"] == 1
    done = run_cli("monitor", "cliq", *server, "--token", ADMIN)
    assert done.returncode == 0, done.stderr
    # --token wins over the environment
    done = run_cli("consume", "cliq", *server, "--token", READER, env_token=ADMIN)
    assert done.returncode == 1 and "Unauthorized" in done.stderr and "consume" in done.stderr
    done = run_cli("monitor", *server)
    assert done.returncode == 1 and "Unauthorized" in done.stderr
    done = run_cli("status", *server)
    assert done.returncode == 1 and "Unauthorized" in done.stderr
    assert run_cli("status", *server, "--token", READER).returncode == 0
    done = run_cli("monitor", *server, "--token", ADMIN, "--token-file", "x")
    assert done.returncode == 2 and "not both" in done.stderr
    done = run_cli("monitor", *server, "--token-file", str(tmp_path / "missing"))
    assert done.returncode == 2 and "missing" in done.stderr
    assert size(node.port, "cliq") == 1


def test_many_refusals_pipelined_then_a_good_request(procs, tmp_path):
    """A refused request's answer is written in its turn among pipelined
    answers, and the connection stays usable (no poisoning: an auth
    failure is the client's expected outcome, not a protocol error)."""
    node = start_single(tmp_path, procs)
    with socket.create_connection(("127.0.0.1", node.port), timeout=IO_TIMEOUT_S) as sock:
        requests = [{"action": 1, "queue": "slow", "data": "x", "token": WRONG, "seq": i}
                    for i in range(200)]
        requests.append({"action": 1, "queue": "slow", "data": "x", "token": ADMIN,
                         "seq": 200})
        sock.sendall(b"".join(json.dumps(r).encode() for r in requests))
        buf = b""
        deadline = time.monotonic() + IO_TIMEOUT_S
        while buf.count(b"\n") < len(requests) and time.monotonic() < deadline:
            buf += sock.recv(65536)
    answers = [json.loads(line) for line in buf.splitlines()]
    assert [a["seq"] for a in answers] == list(range(201))
    assert all(a["code"] == -1 for a in answers[:200]) and answers[200]["code"] == 0
    assert all("token" not in a for a in answers)
    assert WRONG.encode() not in buf and ADMIN.encode() not in buf
    wait_until(lambda: size(node.port, "slow") == 1)
