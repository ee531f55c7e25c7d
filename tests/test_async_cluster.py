"""A three-node native cluster in async mode (queue_server's own mode), with
real processes: its master answers writes at once (ClusterEngine.commit_now,
also for requests a slave forwards), pushes them to the slaves with the
turn's Ready, and the slaves hold the same state; a new master after kill -9
of the old one holds every write replicated before it, and serves at once
too. Without storage and with fsync=batch (where answers wait for the
turn's write)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from procs import Cluster, TcpClient, pipelined, wait_until


def _cluster(tmp_path: Path, storage: bool) -> Cluster:
    extra = '  <replication mode="async" forward_request="1"/>\n'
    if storage:
        extra += f'  <storage dir="{tmp_path}/data{{id}}" fsync="batch"/>\n'
    c = Cluster(tmp_path, extra=extra)
    base_config_path = c.config_path

    def config_path(node_id: int) -> Path:  # one data directory per node
        path = base_config_path(node_id)
        path.write_text(path.read_text().replace("{id}", str(node_id)))
        return path

    c.config_path = config_path  # type: ignore[method-assign]
    return c


def _views(c: Cluster, nodes: list[int], queues: tuple[str, ...]) -> dict[int, list]:
    out = {}
    for i in nodes:
        views = [c.ask(i, action=104, queue=q) or {} for q in queues]
        out[i] = [(v.get("size"), v.get("max_id"), v.get("in_flight")) for v in views]
    return out


def _replicated(c: Cluster, nodes: list[int], master: int) -> bool:
    last = (c.ask(master, action=104) or {}).get("trans_id")
    return last is not None and all(
        (c.ask(i, action=104) or {}).get("applied_id") == last for i in nodes)


@pytest.mark.parametrize("storage", [False, True], ids=["memory", "fsync-batch"])
def test_async_master_answers_at_once_and_the_slaves_follow(tmp_path, storage):
    c = _cluster(tmp_path, storage)
    try:
        c.start_all()
        m = c.wait_master()
        slaves = [i for i in range(1, 4) if i != m]
        requests: list[dict] = []
        for i in range(200):  # the fast path, with general writes among them
            requests.append({"action": 1, "queue": "q", "data": f"m{i}", "retry": 30})
            if i % 30 == 0:
                requests.append({"action": 1, "queue": "q", "messages": [
                    {"data": f"b{i}.{k}", "retry": 30} for k in range(3)]})
            if i % 50 == 0:
                requests.append({"action": 1, "queue": "q", "data": f"p{i}", "priority": 3,
                                 "retry": 30})
        answers = pipelined(c.port(m), requests)
        assert all(a["code"] == 0 for a in answers), [a for a in answers if a["code"]]
        ids = [a["msg_id"] for a in answers if "msg_id" in a]
        ids += [x for a in answers for x in a.get("msg_ids", [])]
        assert len(set(ids)) == len(ids)
        # through a slave: forwarded, answered by the master's fast path
        via = TcpClient(c.port(slaves[0]))
        forwarded = [via.request(action=1, queue="q", data=f"s{i}", retry=30) for i in range(50)]
        assert all(a["code"] == 0 for a in forwarded), forwarded
        assert len({a["msg_id"] for a in forwarded} | set(ids)) == len(ids) + 50
        delivered = [via.request(action=2, queue="q") for _ in range(30)]
        assert all(a["code"] == 0 and "msg_id" in a for a in delivered), delivered
        direct = TcpClient(c.port(m))
        for a in delivered[::2]:
            assert direct.request(action=3, queue="q", msg_id=a["msg_id"])["code"] == 0
        wait_until(lambda: _replicated(c, slaves, m), deadline_s=60)
        views = _views(c, [m, *slaves], ("q",))
        assert views[m] == views[slaves[0]] == views[slaves[1]], views
        assert views[m][0][0] == len(ids) + 50 - 15  # produced, less the confirmed
        via.close()
        direct.close()

        # kill -9 of the master: the new one holds everything replicated
        c.kill(m)
        m2 = c.wait_master(alive=slaves, deadline_s=60)
        assert _views(c, [m2], ("q",))[m2] == views[m]
        c2 = TcpClient(c.port(m2))
        after = c2.request(action=1, queue="q", data="after", retry=30)
        assert after["code"] == 0 and after["msg_id"] > max(ids)
        c2.close()
        if storage:  # the old master comes back from its files and follows
            c.start(m)
            wait_until(lambda: _replicated(c, [m], m2), deadline_s=60)
            assert _views(c, [m], ("q",))[m] == _views(c, [m2], ("q",))[m2]
    finally:
        c.stop_all()


def test_slaves_keep_up_by_pushes_under_steady_writes(tmp_path):
    """Under a steady stream of writes from several clients, heartbeats
    announced records not yet pushed and the slaves pulled them; a pull
    answered ahead of the push then left the slave catching up by pulls
    for good. sync_rate (the pull budget, records a second) is tiny here,
    so a slave left to pulls would be thousands of records behind for
    minutes: both must hold every write soon after the writes stop."""
    c = _cluster(tmp_path, storage=False)
    c.extra += '  <queue_config sync_rate="10"/>\n'
    try:
        c.start_all()
        m = c.wait_master()
        slaves = [i for i in range(1, 4) if i != m]
        stop = time.monotonic() + 3.0
        counts: list[int] = []

        def produce(k: int) -> None:
            client = TcpClient(c.port(m))
            n = 0
            try:
                while time.monotonic() < stop:
                    assert client.request(action=1, queue="q", data=f"{k}.{n}")["code"] == 0
                    n += 1
            finally:
                client.close()
                counts.append(n)

        threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(counts) == 4 and sum(counts) > 100, counts
        wait_until(lambda: _replicated(c, slaves, m), deadline_s=60)
        views = _views(c, [m, *slaves], ("q",))
        assert views[m] == views[slaves[0]] == views[slaves[1]], views
        assert views[m][0][0] == sum(counts)
    finally:
        c.stop_all()
