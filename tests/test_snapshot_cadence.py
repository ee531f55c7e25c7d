"""When a node writes its own snapshot (engines.native.snapshots.snapshot_due):
a cluster node every log_size entries; a node alone also waits until the
entries since its newest snapshot are as many as the messages that snapshot
held, at most LONE_SNAPSHOT_MAX_LOGS * log_size entries, or until it is
quiet (LONE_QUIET_S)."""

from __future__ import annotations

import time

import pytest

from procs import NodeProcess, TcpClient, wait_until
from qserver.engines.native.snapshots import LONE_SNAPSHOT_MAX_LOGS, snapshot_due
from test_snapshots import produce_each, replayed_state, start_single


@pytest.mark.parametrize("since, last, cluster, alone", [
    (99, 0, False, False),  # below log_size: never
    (100, 0, True, True),  # the first snapshot of a run: log_size
    (100, 50, True, True),  # a small store: log_size still
    (100, 150, True, False),  # alone, 150 messages written last time: 150 entries
    (149, 150, True, False),
    (150, 150, True, True),
    (399, 10_000, True, False),  # a large store: at most 4 log_size runs
    (400, 10_000, True, True),
])
def test_the_entries_a_snapshot_waits_for(since, last, cluster, alone):
    assert LONE_SNAPSHOT_MAX_LOGS == 4
    assert snapshot_due(since, 100, False, last) is cluster
    assert snapshot_due(since, 100, True, last) is alone


def test_a_node_alone_spaces_its_snapshots_as_its_store_grows(tmp_path):
    """1,000 produces one at a time, log_size 50, nothing consumed: every 50
    entries a cluster node's cadence would fork 20 writers; alone, the
    thresholds are about 50, 100, 200, 400, then every 200 (the cap): 7 at
    most with the one near the end (fewer if a writer is still busy when
    one is due, or the last comes once the node is quiet). The restart
    replays the log after the newest one: every message is there."""
    node, data, cfg = start_single(tmp_path, log_size=50)
    port = node.port
    try:
        c = TcpClient(port)
        produce_each(c, 1000)
        before = c.request(action=104, queue="s")
        # quiet: less than log_size behind (a snapshot of everything, unless
        # the last one due came within log_size of the end)
        snap = wait_until(lambda: (lambda s: (
            not s["writing"] and before["trans_id"] - s["snapshot_id"] < 50 and s))(
            c.request(action=104)["snapshot"]))
        assert snap["failed"] == 0
        assert 2 <= snap["taken"] <= 7, snap
    finally:
        node.kill()
    assert replayed_state(data)[0] == before["trans_id"]
    node = NodeProcess(cfg, port)
    node.wait_ready()
    try:
        c = TcpClient(port)
        after = c.request(action=104, queue="s")
        assert (after["size"], after["max_id"]) == (1000, 1000)
        assert c.request(action=2, queue="s")["data"] == "m0"
    finally:
        node.stop()


def test_a_quiet_node_alone_snapshots_what_came_since_its_last(tmp_path):
    """log_size 50: after 300 produces, once the node is quiet, its newest
    snapshot holds more than 100 messages, so the next is due only after
    100 entries or more (up to the cap, 4 x log_size). 75 entries since it are not enough
    for that; once nothing has been applied for LONE_QUIET_S, the node
    writes one of everything all the same, so that a restart replays
    nothing."""
    node, _, _ = start_single(tmp_path, log_size=50)
    try:
        c = TcpClient(node.port)

        def monitor() -> dict:
            return c.request(action=104)

        def quiet() -> dict:
            """The node's monitor once its snapshot has stood still for 2.5 s."""
            seen: list = []

            def still() -> dict | None:
                m = monitor()
                key = (m["snapshot"]["snapshot_id"], m["snapshot"]["writing"])
                seen.append((time.monotonic(), key))
                if key[1] or any(k != key for t, k in seen if t > seen[-1][0] - 2.5):
                    return None
                return m if seen[-1][0] - seen[0][0] >= 2.5 else None
            return wait_until(still, step_s=0.1)

        produce_each(c, 300)
        first = quiet()
        since = first["trans_id"] - first["snapshot"]["snapshot_id"]
        assert first["snapshot"]["snapshot_id"] > 101 and since < 50, first
        produce_each(c, 75 - since, "n")
        last = monitor()["trans_id"]
        assert last - first["snapshot"]["snapshot_id"] == 75
        snap = wait_until(lambda: (lambda s: s["snapshot_id"] == last and s)(
            monitor()["snapshot"]))
        assert snap["failed"] == 0 and snap["taken"] == first["snapshot"]["taken"] + 1, snap
    finally:
        node.kill()
