"""Snapshots with real processes and real files: a node writes its own
snapshots as its log grows (without stopping), restarts from the newest
one plus the log after it, and a slave behind the master's log catches up
through a snapshot streamed in chunks, ending with the master's state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from procs import Cluster, NodeProcess, TcpClient, wait_until
from qserver.engines.native import snapshots
from test_snapshot_replay import recovered

DATA = "x" * 1000  # 1 kB messages: a few thousand make a multi-chunk snapshot


def single_config(port: int, data: Path, log_size: int) -> str:
    return (f'<config><node_info node_id="1" host="127.0.0.1" port="{port}"/>'
            f'<queue_config log_size="{log_size}"/>'
            f'<storage dir="{data}" fsync="batch"/></config>')


def start_single(tmp_path: Path, log_size: int) -> tuple[NodeProcess, Path, Path]:
    """A node alone with storage (fsync=batch) in tmp_path, ready: the
    node, its data directory and its config file."""
    port = __import__("procs").free_port()
    data = tmp_path / "data"
    cfg = tmp_path / "node.xml"
    cfg.write_text(single_config(port, data, log_size=log_size))
    node = NodeProcess(cfg, port)
    node.wait_ready()
    return node, data, cfg


def produce_each(c: TcpClient, n: int, prefix: str = "m") -> None:
    """n produces to queue "s", one at a time (data prefix + index), each
    answered with code 0."""
    for i in range(n):
        assert c.request(action=1, queue="s", data=f"{prefix}{i}")["code"] == 0


def replayed_state(data: Path) -> tuple[int, list]:
    """What a node's data directory holds: (last trans_id, store state), read
    back as a restart would (snapshot, then the log after it)."""
    store, last = recovered(str(data))
    return last, store.to_wire()


def test_single_node_writes_snapshots_and_restarts_from_one(tmp_path):
    node, data, cfg = start_single(tmp_path, log_size=200)
    port = node.port
    try:
        c = TcpClient(port)
        for i in range(1500):
            assert c.request(action=1, queue="s", data=f"m{i}", retry=300)["code"] == 0
        delivered = [c.request(action=2, queue="s")["msg_id"] for _ in range(300)]
        for msg_id in delivered[:100]:
            c.request(action=3, queue="s", msg_id=msg_id)
        before = c.request(action=104, queue="s")
        # writes are over, so the writer goes quiet after its last snapshot
        snap = wait_until(lambda: (lambda s: s["taken"] >= 1 and not s["writing"] and s)(
            c.request(action=104)["snapshot"]))
        assert snap["failed"] == 0 and snap["last_pause_ms"] is not None
        assert len(list(data.glob("snapshot-*.snap"))) == 1
    finally:
        node.kill()
    snapshot_id = int(next(data.glob("snapshot-*.snap")).name[9:29])
    assert snapshot_id > 0
    node = NodeProcess(cfg, port)
    node.wait_ready()
    try:
        c = TcpClient(port)
        after = wait_until(lambda: (lambda m: m["applied_id"] >= before["applied_id"] and m)(
            c.request(action=104, queue="s")))
        # restarted from the snapshot: the in-memory log starts at it
        assert after["snapshot"]["snapshot_id"] >= snapshot_id
        assert after["log_size"] < after["trans_id"]
        for key in ("size", "max_id", "in_flight", "ready"):
            assert after[key] == before[key], key
        assert c.request(action=2, queue="s")["msg_id"] == 301
        assert c.request(action=1, queue="s", data="new")["msg_id"] == 1501
    finally:
        node.stop()


def test_slave_behind_the_log_catches_up_through_a_streamed_snapshot(tmp_path):
    c = Cluster(tmp_path, extra=('  <queue_config log_size="200"/>\n'
                                 f'  <storage dir="{tmp_path}/data{{id}}" fsync="batch"/>\n'))
    # one data directory per node
    base_config_path = c.config_path

    def config_path(node_id: int) -> Path:
        path = base_config_path(node_id)
        path.write_text(path.read_text().replace("{id}", str(node_id)))
        return path

    c.config_path = config_path
    try:
        c.start_all()
        m = c.wait_master()
        behind = next(i for i in range(1, 4) if i != m)
        c.kill(behind)
        client = TcpClient(c.port(m))
        for i in range(4000):  # ~4 MB of state: the snapshot goes in several chunks
            r = client.request(action=1, queue=f"q{i % 3}", data=f"{i}:{DATA}", retry=600)
            assert r["code"] == 0, r
        for q in ("q0", "q1"):
            got = [client.request(action=2, queue=q)["msg_id"] for _ in range(200)]
            for msg_id in got[:100]:
                assert client.request(action=3, queue=q, msg_id=msg_id)["code"] == 0
        # the writer runs below the node's priority (SNAPSHOT_WRITER_NICE):
        # on a busy machine its snapshot may come a while after the writes
        master_view = wait_until(lambda: (lambda v: v["snapshot"]["taken"] >= 1 and v)(
            client.request(action=104)), deadline_s=60)
        # the slave's log ends far before what the master still holds
        assert master_view["trans_id"] - master_view["log_size"] > 10

        c.start(behind)
        wait_until(lambda: (lambda r: r is not None and r.get("applied_id")
                            == c.ask(m, action=104)["commit_id"])(c.ask(behind, action=104)),
                   deadline_s=60)
        slave_view = c.ask(behind, action=104)
        assert slave_view["snapshot"]["installed"] >= 1
        assert c.ask(m, action=104)["snapshot"]["sent"] >= 1
        for q in ("q0", "q1", "q2"):
            mine, theirs = c.ask(behind, action=104, queue=q), c.ask(m, action=104, queue=q)
            assert (mine["size"], mine["max_id"], mine["in_flight"]) == \
                   (theirs["size"], theirs["max_id"], theirs["in_flight"])
        # it goes on replicating after the snapshot
        assert client.request(action=1, queue="q0", data="after")["code"] == 0
        last = c.ask(m, action=104)["trans_id"]
        wait_until(lambda: (c.ask(behind, action=104) or {}).get("applied_id", 0) >= last)
    finally:
        for node in c.nodes.values():
            node.stop()  # SIGTERM: every node flushes its log
    states = {i: replayed_state(tmp_path / f"data{i}") for i in range(1, 4)}
    assert states[behind] == states[m]


def test_a_cluster_in_memory_writes_a_snapshot_only_for_a_slave_behind_its_log(tmp_path):
    """Without a data directory a snapshot serves only a slave behind the
    log, so none is written while every slave keeps up (each one is the
    whole store: every log_size entries, that cost three async nodes half
    a core under load). A slave restarted empty is behind the master's
    log: the master writes one then, streams it, and the slave catches up."""
    c = Cluster(tmp_path, extra='  <queue_config log_size="200"/>\n')
    try:
        c.start_all()
        m = c.wait_master()
        client = TcpClient(c.port(m))
        for i in range(1500):
            assert client.request(action=1, queue=f"q{i % 3}", data=f"{i}:{DATA}")["code"] == 0
        slaves = [i for i in range(1, 4) if i != m]
        last = client.request(action=104)["trans_id"]
        wait_until(lambda: all((c.ask(i, action=104) or {}).get("applied_id", 0) >= last - 5
                               for i in slaves), deadline_s=60)
        for i in (m, *slaves):
            view = c.ask(i, action=104)
            assert view["snapshot"]["taken"] == 0, (i, view["snapshot"])
            assert view["log_size"] < 3 * 200, (i, view["log_size"])  # compacted all the same
        behind = slaves[0]
        c.kill(behind)
        c.start(behind)  # empty: no data directory
        wait_until(lambda: (lambda r: r is not None and r.get("applied_id", 0) >= last)(
            c.ask(behind, action=104)), deadline_s=60)
        assert c.ask(m, action=104)["snapshot"]["taken"] == 1
        assert c.ask(m, action=104)["snapshot"]["sent"] >= 1
        assert c.ask(behind, action=104)["snapshot"]["installed"] >= 1
        for q in ("q0", "q1", "q2"):
            mine, theirs = c.ask(behind, action=104, queue=q), c.ask(m, action=104, queue=q)
            assert (mine["size"], mine["max_id"]) == (theirs["size"], theirs["max_id"])
        client.close()
    finally:
        c.stop_all()


def test_the_snapshot_writer_runs_below_the_nodes_cpu_priority():
    """The forked writer's setup (snapshots._child_setup, which
    _fork_snapshot runs in the child) raises its niceness by
    SNAPSHOT_WRITER_NICE (19 at most): on a busy machine it leaves the
    cores to the node's requests."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its niceness after the writer's setup
        try:
            os.close(r)
            snapshots._child_setup()
            os.write(w, str(os.nice(0)).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 16)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert got, "the child failed before it reported its niceness"
    assert snapshots.SNAPSHOT_WRITER_NICE > 0
    if os.nice(0) >= 19:
        pytest.skip("this test already runs at the lowest priority (nice 19)")
    assert int(got) == min(os.nice(0) + snapshots.SNAPSHOT_WRITER_NICE, 19)
