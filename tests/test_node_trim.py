"""A node gives the C heap's free memory back to the system once its log
stops moving after it moved (qserver.node.TRIM_CHECK_S, MALLOC_TRIM): once
after a burst of writes, not while it is busy, not again while quiet.

A real node in this process on a free loopback port, a TCP client, and
malloc_trim replaced by a recorder (and a check every 20 ms)."""

from __future__ import annotations

import asyncio
import json

import qserver.node
from procs import free_port
from qserver.config import Config
from qserver.node import MALLOC_TRIM, Node
from test_node_shutdown import until

CHECK_S = 0.02


def test_malloc_trim_is_found_on_this_system():
    assert MALLOC_TRIM is not None  # glibc (Linux): what the node calls


def test_a_node_gives_freed_memory_back_once_its_writes_stop(monkeypatch):
    trims: list[int] = []

    def trim(pad: int) -> int:
        trims.append(pad)
        return 1

    monkeypatch.setattr(qserver.node, "MALLOC_TRIM", trim)
    monkeypatch.setattr(qserver.node, "TRIM_CHECK_S", CHECK_S)

    async def main():
        node = Node(Config(port=free_port(), host="127.0.0.1"))
        await node.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", node.address[1])
        try:
            await until(lambda: len(trims) == 1, "the trim after start-up")
            await asyncio.sleep(10 * CHECK_S)
            assert trims == [0]  # quiet since: nothing more to give back
            # writes over many checks: no trim while they go on
            loop = asyncio.get_running_loop()
            end = loop.time() + 20 * CHECK_S
            n = 0
            while loop.time() < end:
                writer.write(json.dumps({"action": 1, "queue": "q", "data": f"m{n}"}).encode())
                assert json.loads(await reader.readline())["code"] == 0
                n += 1
                if n % 20 == 0:
                    await asyncio.sleep(CHECK_S / 4)  # other checks run meanwhile
            assert len(trims) == 1, f"trimmed while busy, after {n} writes"
            await until(lambda: len(trims) == 2, "the trim once the writes stopped")
            await asyncio.sleep(10 * CHECK_S)
            assert trims == [0, 0]
        finally:
            writer.close()
            await node.shutdown()

    asyncio.run(main())


def test_a_node_whose_start_fails_leaves_no_timer_behind(tmp_path):
    """The trim and full-GC timers are armed once the engine started: a
    node whose cluster port is taken raises, and nothing of it runs on."""
    import socket

    from procs import cluster_config
    from qserver.config import parse_xml

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    internal = [taken.getsockname()[1], free_port(), free_port()]
    config = parse_xml(cluster_config(1, [free_port() for _ in range(3)], internal))

    async def main():
        node = Node(config)
        try:
            await node.start()
        except OSError:
            pass
        else:
            await node.shutdown()
            raise AssertionError("the node started on a taken port")
        assert node._trim_timer is None and node._gc_timer is None

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        taken.close()
