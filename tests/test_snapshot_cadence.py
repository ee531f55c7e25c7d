"""When a node writes its own snapshot (engines.native.snapshots.snapshot_due):
a cluster node every log_size entries; a node alone also waits until the
entries since its newest snapshot are as many as the messages that snapshot
held, at most LONE_SNAPSHOT_MAX_LOGS * log_size entries."""

from __future__ import annotations

import pytest

from procs import NodeProcess, TcpClient, wait_until
from qserver.engines.native.snapshots import LONE_SNAPSHOT_MAX_LOGS, snapshot_due
from test_snapshots import replayed_state, start_single


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
    thresholds are 50, 100, 200, 400, then every 200 (the cap): 7 at most
    (fewer if a writer is still busy when one is due). The restart then
    replays the log after the newest one: every message is there."""
    node, data, cfg = start_single(tmp_path, log_size=50)
    port = node.port
    try:
        c = TcpClient(port)
        for i in range(1000):
            assert c.request(action=1, queue="s", data=f"m{i}")["code"] == 0
        # once idle, the newest snapshot is less than the cap (200) behind
        snap = wait_until(lambda: (lambda s: not s["writing"] and s["snapshot_id"] > 800 and s)(
            c.request(action=104)["snapshot"]))
        assert snap["failed"] == 0
        assert 1 <= snap["taken"] <= 7, snap
        before = c.request(action=104, queue="s")
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
