"""The raft engine's replication through faults of its master, on real
processes with every node-to-node link behind a proxy (tests/harness):
the master paused, then the next master cut off while its own clients keep
writing to it. Afterwards every node holds the same state, nothing
acknowledged is lost, the faulted masters caught up without a snapshot, and
no node raised pysyncobj's truncation alarm or stopped on diverged entries
(qserver.engines.raft.appends)."""

from __future__ import annotations

import threading
import time

from harness import FaultCluster
from procs import TcpClient, wait_until

QUEUES = [f"q{k}" for k in range(4)]
FAULT_S = 3.0


class Writers:
    """One producer per node (retry=0, no delay), recording what was
    acknowledged: {queue: {msg_id: data}}."""

    def __init__(self, c: FaultCluster) -> None:
        self.c = c
        self.acked: dict[str, dict[int, str]] = {q: {} for q in QUEUES}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in c.ids]
        for t in self.threads:
            t.start()

    def _run(self, node: int) -> None:
        client, k = None, 0
        while not self.stop.is_set():
            k += 1
            queue = QUEUES[k % len(QUEUES)]
            data = f"n{node}-{k}"
            try:
                if client is None:
                    client = TcpClient(self.c.ports[node].client)
                    client.sock.settimeout(2)
                r = client.request(action=1, queue=queue, data=data, retry=0)
                if r.get("code") == 0:
                    self.acked[queue][r["msg_id"]] = data
            except (OSError, ConnectionError, ValueError):
                if client is not None:
                    client.close()
                client = None
                time.sleep(0.05)

    def count(self) -> int:
        return sum(len(v) for v in self.acked.values())

    def wait_more(self, n: int) -> None:
        start = self.count()
        wait_until(lambda: self.count() >= start + n, deadline_s=60)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def test_paused_and_cut_off_masters_catch_up_and_every_node_applies_the_same(tmp_path):
    with FaultCluster(tmp_path, engine="raft", fsync="always") as c:
        c.start()
        first = c.wait_master()
        w = Writers(c)
        try:
            w.wait_more(300)
            c.pause(first)
            time.sleep(FAULT_S)
            c.resume(first)
            second = c.wait_master()
            assert second != first
            w.wait_more(300)
            others = [j for j in c.ids if j != second]
            c.set_cuts({(second, j) for j in others} | {(j, second) for j in others})
            time.sleep(FAULT_S)  # its writer keeps proposing to it: entries nobody else has
            c.heal_links()
            w.wait_more(300)
        finally:
            w.finish()

        def settled():
            st = c.statuses(c.ids)
            if not all(s and s.get("role") in ("master", "slave") for s in st.values()):
                return None
            applied = {s["applied_id"] for s in st.values()}
            commits = {s["commit_id"] for s in st.values()}
            return st if len(applied) == 1 and applied == commits else None

        wait_until(settled, deadline_s=60)
        m = c.wait_master()
        states = {i: {q: c.ask(i, action=104, queue=q) for q in QUEUES} for i in c.ids}
        for q in QUEUES:
            seen = {i: (s[q]["size"], s[q]["max_id"], s[q]["ready"], s[q]["in_flight"])
                    for i, s in states.items()}
            assert len(set(seen.values())) == 1, f"{q}: nodes differ: {seen}"
        # nothing acknowledged is lost: drain every queue on the master
        client = TcpClient(c.ports[m].client)
        try:
            for q in QUEUES:
                got: dict[int, str] = {}
                while True:
                    r = client.request(action=2, queue=q)
                    if "msg_id" not in r:
                        break
                    got[r["msg_id"]] = r["data"]
                lost = {i: d for i, d in w.acked[q].items() if got.get(i) != d}
                assert not lost, f"{q}: acknowledged and lost: {sorted(lost)[:10]}"
        finally:
            client.close()
        for i in c.ids:
            assert c.alive(i), f"node {i} stopped"
            log = c.log_path(i).read_text(errors="replace")
            assert "truncating already-applied" not in log
            assert "loading raft snapshot" not in log  # caught up by appends
