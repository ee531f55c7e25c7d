"""Randomized schedules on the simulated network (tests/sim.py).

Each schedule is one seed: a 3- or 5-node cluster in quorum or async mode,
2-5 s of virtual time of random client requests (produce; consume, now
and then with count, from two queues or with a lease; confirm, nack and
touch, with or without a receipt, stale ones too; config of
max_deliveries and dead_letter; issue 15's produces with a dedup_id, a
priority or a batch of messages, resent with the same dedup ids after no
answer or as a restarted producer does, clear, config of dedup_window,
max_size and paused, one schedule in three with a short dedup window from
the start; sent to any node, forwarded to the master, retried on a
timeout, an "outcome unknown" or "no leader", on the same node or
another; the master moves out final deliveries whose lease ran out) and
random faults (message loss up to 50%, delays up to 400 ms that reorder
messages, one-way link cuts, partitions, isolated masters, paused nodes,
crashes and restarts, now and then of every node at once; in one
schedule in two, leader transfers amid them, asked of the master or a
slave, to another node, the master itself or a stranger, whose answers
sim.Transfers checks: writes refused meanwhile, one answer each, a new
master named only if it was master in a later vote_id), then every
fault healed and every node restarted: the cluster must converge on one
master that every node follows with an identical log and store, and take a
new write. Three schedules in four run the cluster adapter's configuration
(snapshot files written by a simulated fork, streamed in chunks and
installed; in quorum mode fsync=always with the master's own fsync off the
loop, a crash losing what it had not fsynced); the others the sim's own
(snapshots as one message, every flush durable). In async mode a master
answers a produce, a plain consume or a confirm at once by the fast path
(NativeCore.append_now, as ClusterEngine.commit_now does, whenever its
conditions hold: its record written before the answer and before the
Ready's records), and pushes may be coalesced (push_interval_ms 0, 2 or
20 ms). Invariants 1 to 4 of
design.md are checked after every delivered message, timer and event;
invariants 6 and 7 on every answer a client accepted, against the
committed history (what async mode does not promise is checked in quorum
mode only), and on every entry as it commits: a receipt confirms only the
delivery it names, `deliveries` never exceeds max_deliveries, deliveries
and leases keep their times, retry=0 messages are delivered once, across
failovers; a dedup id is never stored twice within its window and every
answer names the message the committed history accepted it as (a
`duplicate: true` never one a master lost), across failovers, snapshots
and restarts; a batch is committed whole; paused and full queues take no
produce, paused-out ones deliver nothing (sim.Workload).

The default run covers 2,400 schedules (about 105 s on the shared 2-core
machine; 3,200 took 138 s of a suite near its 15-minute budget). A change
to replication should run more than that: QSERVER_SIM_SEEDS=N runs N seeds
for each of the four configurations instead, QSERVER_SIM_SEED_START=S
starts at seed S (to explore new ones). A failure names its seed;
`run_schedule(seed, n=..., async_mode=...)` replays it.
"""

from __future__ import annotations

import os

import pytest

from sim import run_schedule

CHUNK = 100  # seeds per test item: few items, each failure still names its seed

# (nodes, async_mode) -> default number of seeds, weighted by what a
# schedule costs (a 5-node schedule costs about three 3-node ones).
DEFAULT_SEEDS = {(3, False): 900, (3, True): 600, (5, False): 600, (5, True): 300}


def _items():
    start = int(os.environ.get("QSERVER_SIM_SEED_START", "0"))
    override = os.environ.get("QSERVER_SIM_SEEDS")
    for (n, async_mode), count in DEFAULT_SEEDS.items():
        if override is not None:
            count = int(override)
        for lo in range(start, start + count, CHUNK):
            hi = min(lo + CHUNK, start + count)
            mode = "async" if async_mode else "quorum"
            yield pytest.param(n, async_mode, lo, hi, id=f"{n}nodes-{mode}-seeds{lo}-{hi - 1}")


@pytest.mark.parametrize("n, async_mode, lo, hi", list(_items()))
def test_random_schedules_keep_the_invariants(n, async_mode, lo, hi):
    failures = []
    for seed in range(lo, hi):
        try:
            run_schedule(seed, n=n, async_mode=async_mode)
        except AssertionError as exc:
            failures.append((seed, str(exc)))
    assert not failures, (
        f"{len(failures)} of seeds {lo}..{hi - 1} failed (n={n}, async={async_mode}): "
        f"seeds {[s for s, _ in failures]}; first: {failures[0][1]}")
