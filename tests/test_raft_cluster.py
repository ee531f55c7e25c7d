"""The raft engine on real processes, beyond the tests it shares with the
native engine (test_cluster_integration.py): one node alone, storage and
kill -9 of every node at once, catch-up by snapshot after log compaction."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from procs import Cluster, TcpClient, wait_until
from qserver.engines.raft.driver import RAFT_PORT_OFFSET

RAFT = '  <replication engine="raft"/>\n'


def per_node_storage(c: Cluster, tmp_path: Path, fsync: str = "always") -> None:
    """Give each node of `c` its own data directory."""
    orig = c.config_path

    def config_path(node_id: int) -> Path:
        path = orig(node_id)
        storage = f'  <storage dir="{tmp_path / f"data{node_id}"}" fsync="{fsync}"/>\n'
        path.write_text(path.read_text().replace("</config>", storage + "</config>"))
        return path

    c.config_path = config_path


def test_single_raft_node_serves_and_recovers_from_its_data_dir(tmp_path, procs):
    extra = RAFT + f'  <storage dir="{tmp_path / "data"}" fsync="always"/>\n'
    node = procs(tmp_path, extra)
    client = TcpClient(node.port)
    wait_until(lambda: client.request(action=104)["role"] == "master")
    for i in range(50):
        assert client.request(action=1, queue="one", data=f"d{i}", retry=30)["msg_id"] == i + 1
    got = client.request(action=2, queue="one")
    assert (got["msg_id"], got["data"]) == (1, "d0")
    client.close()
    node.kill()
    node = procs(tmp_path, extra)
    client = TcpClient(node.port)
    wait_until(lambda: client.request(action=104)["role"] == "master")
    wait_until(lambda: client.request(action=4, queue="one")["size"] == 50)
    mon = client.request(action=4, queue="one")
    assert (mon["max_id"], mon["in_flight"]) == (50, 1)  # the delivery is remembered too
    assert client.request(action=1, queue="one", data="after")["msg_id"] == 51
    client.close()


def test_single_raft_node_in_memory(tmp_path, procs):
    node = procs(tmp_path, RAFT)
    client = TcpClient(node.port)
    wait_until(lambda: client.request(action=104)["role"] == "master")
    assert client.request(action=1, queue="m", data="x")["msg_id"] == 1
    assert client.request(action=2, queue="m")["data"] == "x"
    assert client.request(action=8)["leader_port"] == node.port
    client.close()


def test_a_raft_port_in_use_stops_the_node_with_a_clear_error(tmp_path):
    """Not a node that serves clients and never joins an election (pysyncobj
    alone retries its bind for ever)."""
    c = Cluster(tmp_path, engine="raft")
    raft_port = c.internal_ports[0] + RAFT_PORT_OFFSET
    with socket.create_server(("127.0.0.1", raft_port)):  # taken
        node = c.start(1, wait=False)
        try:
            code = node.proc.wait(60)
        finally:
            node.kill()
    assert code == 1
    assert "cannot listen" in node.stderr_text and f"raft port 127.0.0.1:{raft_port}" \
        in node.stderr_text, node.stderr_text


def test_three_raft_nodes_killed_at_once_lose_no_acknowledged_write(tmp_path):
    c = Cluster(tmp_path, engine="raft")
    per_node_storage(c, tmp_path, "always")
    c.start_all()
    try:
        acked: dict[int, str] = {}
        stop = threading.Event()

        def work() -> None:
            i, node, client = 0, 1, None
            while not stop.is_set():
                i += 1
                try:
                    if client is None:
                        client = TcpClient(c.port(node))
                        client.sock.settimeout(5)
                    r = client.request(action=1, queue="dur", data=f"d{i}", retry=60)
                    if r.get("code") != 0:
                        raise ConnectionError(r.get("reason"))
                    acked[r["msg_id"]] = f"d{i}"
                except (OSError, ConnectionError, ValueError):
                    if client is not None:
                        client.close()
                    client = None
                    node = node % 3 + 1
                    time.sleep(0.02)

        t = threading.Thread(target=work, daemon=True)
        t.start()
        wait_until(lambda: len(acked) >= 150, deadline_s=60)
        terms = {i: (c.ask(i, action=104) or {}).get("vote_id", 0) for i in range(1, 4)}
        for node in c.nodes.values():  # all at once
            node.proc.kill()
        stop.set()
        t.join(10)
        for node in c.nodes.values():
            node.stop()
        c.start_all()
        m = c.wait_master(deadline_s=60)
        for i in range(1, 4):  # terms are kept across the crash, never go back
            assert c.ask(i, action=104)["vote_id"] >= terms[i]
        client = TcpClient(c.port(m))
        wait_until(lambda: client.request(action=4, queue="dur")["max_id"] >= max(acked))
        got: dict[int, str] = {}
        while True:
            r = client.request(action=2, queue="dur")
            if "msg_id" not in r:
                break
            got[r["msg_id"]] = r["data"]
        missing = {i: d for i, d in acked.items() if got.get(i) != d}
        assert not missing, f"acknowledged writes lost: {sorted(missing)[:10]}"
        client.close()
    finally:
        c.stop_all()


def test_slave_behind_the_compacted_log_catches_up_by_snapshot(tmp_path):
    # log_size 20: pysyncobj compacts (snapshots the store) every 20 entries
    c = Cluster(tmp_path, engine="raft", extra='  <queue_config log_size="20"/>\n')
    c.start_all()
    try:
        m = c.wait_master()
        victim = next(i for i in range(1, 4) if i != m)
        c.kill(victim)
        client = TcpClient(c.port(m))
        for k in range(300):
            assert client.request(action=1, queue="snap", data=f"d{k}", retry=30)["code"] == 0
        for _ in range(100):  # some deliveries and confirms, snapshotted too
            got = client.request(action=2, queue="snap")
            client.request(action=3, queue="snap", msg_id=got["msg_id"])
        assert client.request(action=104)["log_size"] < 300  # compacted
        c.start(victim)
        theirs = client.request(action=104, queue="snap")
        wait_until(lambda: (c.ask(victim, action=104, queue="snap") or {}).get("size") == 200)
        mine = c.ask(victim, action=104, queue="snap")
        assert (mine["max_id"], mine["ready"]) == (theirs["max_id"], theirs["ready"]) == (300, 200)
        # and it follows on from there
        assert client.request(action=1, queue="snap", data="next")["msg_id"] == 301
        wait_until(lambda: (c.ask(victim, action=104, queue="snap") or {}).get("max_id") == 301)
        client.close()
    finally:
        c.stop_all()
