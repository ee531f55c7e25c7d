"""A step of the wall clock (NTP, an operator, a VM resumed) must not look
like a silent master: the cluster's timers run on time.monotonic, while the
times of messages (delay, ttl, ready and retry times: what the store
decides with) stay unix wall-clock times.

Three real nodes in one process (one event loop, loopback sockets), so that
the test can step the wall clock of all of them at once.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import qserver.server
from procs import ask_async, cluster_config, free_port, until_async
from qserver.config import load_config
from qserver.engines.messages import Push, message_from_wire
from qserver.node import Node

STEP_S = 3600.0  # the wall clock jumps an hour ahead
# Pushes (heartbeats included) every slave must take after the step: a few
# election timeouts' worth (heartbeats every 100 ms, elections after
# 600-1200 ms, a master checks its majority every election timeout).
PUSHES_AFTER_STEP = 30
DEADLINE_S = 60.0


async def ask(port: int, request: dict) -> dict:
    return await ask_async(port, request, DEADLINE_S)


async def until(predicate, what: str):
    return await until_async(predicate, what, DEADLINE_S)


def agreed_master(nodes: list[Node]) -> int | None:
    masters = [n for n in nodes if n.engine.core.is_master]
    if len(masters) != 1:
        return None
    m = masters[0].config.node_id
    if all(n.engine.core.leader_id == m for n in nodes):
        return m
    return None


@pytest.fixture
def three_nodes(tmp_path):
    ports: set[int] = set()
    while len(ports) < 6:
        ports.add(free_port())
    ports_l = sorted(ports)
    client_ports, internal_ports = ports_l[:3], ports_l[3:]
    configs = []
    for node_id in (1, 2, 3):
        path = tmp_path / f"node{node_id}.xml"
        path.write_text(cluster_config(node_id, client_ports, internal_ports))
        configs.append(load_config(str(path)))
    return configs


def test_a_wall_clock_step_starts_no_election_and_message_times_stay_wall_clock(
        three_nodes, monkeypatch):
    async def run() -> None:
        nodes = [Node(config) for config in three_nodes]
        for node in nodes:
            await node.start()
        try:
            master_id = await until(lambda: agreed_master(nodes), "a master")
            master = nodes[master_id - 1]
            votes = [n.engine.core.vote_id for n in nodes]
            slaves = [n for n in nodes if n is not master]
            pushes = {n.config.node_id: 0 for n in slaves}
            roles_seen = {n.config.node_id: set() for n in nodes}

            for n in nodes:
                # at the link's delivery: a compiled engine's methods
                # (qserver.compiled) cannot be replaced
                def counting(peer_id, obj, n=n, deliver=n.engine.net._on_message):
                    if type(message_from_wire(obj)) is Push:
                        pushes[n.config.node_id] = pushes.get(n.config.node_id, 0) + 1
                    deliver(peer_id, obj)
                    roles_seen[n.config.node_id].add(n.engine.core.role)
                n.engine.net._on_message = counting

            real_time, real_time_ns = time.time, time.time_ns
            monkeypatch.setattr(time, "time", lambda: real_time() + STEP_S)
            monkeypatch.setattr(time, "time_ns",
                                lambda: real_time_ns() + int(STEP_S * 1_000_000_000))
            monkeypatch.setattr(qserver.server, "_time_ns", time.time_ns)
            for n in slaves:
                pushes[n.config.node_id] = 0
            await until(lambda: (all(v >= PUSHES_AFTER_STEP for v in pushes.values())
                                 or agreed_master(nodes) != master_id
                                 or [n.engine.core.vote_id for n in nodes] != votes),
                        "heartbeats after the step, or a change of master")

            assert agreed_master(nodes) == master_id
            assert [n.engine.core.vote_id for n in nodes] == votes
            assert all(len(roles) == 1 for roles in roles_seen.values()), roles_seen

            # Message times are wall-clock: a message whose absolute delay
            # is half an hour from the real time is, an hour later on the
            # stepped clock, ready at once.
            delay = int(real_time()) + 1800
            r = await ask(master.config.port, {"action": 1, "queue": "q", "data": "d",
                                               "delay": delay})
            assert r["code"] == 0, r
            r = await ask(master.config.port, {"action": 2, "queue": "q"})
            assert r.get("data") == "d", r
        finally:
            for node in nodes:
                node.stop()
                await node.shutdown()

    asyncio.run(run())
