"""A node alone with storage (fsync off or batch) commits at once
(ClusterEngine.commit_now): the service answers in the call that read the
request, and the record is written (copied into the log's mapping) before
that call returns. These tests hold it to what the general path promised:
nothing is answered before its record is written, the log keeps trans_id
order when fast and general writes interleave in one turn, and every
acknowledged write survives kill -9."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from procs import (
    NodeProcess,
    TcpClient,
    UdpClient,
    free_port,
    pipelined,
    write_config,
)
from qserver.config import load_config
from qserver.node import Node
from qserver.server import ClientTcpProtocol
from qserver.storage import DiskStorage
from qserver.storage.format import encode_record


class _Transport:
    """What a client protocol writes, kept."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def get_extra_info(self, name: str, default=None):
        return default

    def close(self) -> None:
        pass


def _config(tmp_path, fsync: str):
    path = write_config(tmp_path / "node.xml", free_port(),
                        f'  <storage dir="{tmp_path}/data" fsync="{fsync}"/>\n')
    return load_config(str(path))


async def _on_the_fast_path(node: Node):
    """The node's engine once it is master and commits at once (a node alone
    elects itself at its first tick)."""
    engine = node.engine
    for _ in range(2000):
        if engine.commits_at_once:
            return engine
        await asyncio.sleep(0.01)
    raise AssertionError("the fast path did not come on")


def _in_the_log_file(engine, trans_id: int) -> bool:
    """Whether the record at trans_id is in the log's current segment file,
    as another process would read it (the page cache)."""
    frame = encode_record(engine.core.log.get(trans_id))
    directory = engine.storage.directory
    newest = max(f for f in os.listdir(directory) if f.endswith(".seg"))
    with open(os.path.join(directory, newest), "rb") as f:
        return frame in f.read()


@pytest.mark.parametrize("fsync", ["off", "batch"])
def test_an_answer_leaves_with_its_record_written(tmp_path, fsync):
    async def main() -> None:
        node = Node(_config(tmp_path, fsync))
        await node.start()
        try:
            engine = await _on_the_fast_path(node)
            storage = engine.storage

            conn = ClientTcpProtocol(node)
            transport = _Transport()
            conn.connection_made(transport)  # type: ignore[arg-type]
            before = storage.records_written
            conn.data_received(b'{"action":1,"queue":"q","data":"x","delay":0,"ttl":60,'
                               b'"retry":0}\n')
            # answered in that call, its record written in it too
            assert [json.loads(w) for w in transport.written] == [
                {"action": 1, "queue": "q", "code": 0, "msg_id": 1}]
            assert storage.records_written == before + 1
            assert _in_the_log_file(engine, engine.core.log.last_trans_id)
            conn.connection_lost(None)
        finally:
            node.stop()
            await node.shutdown()

    asyncio.run(main())


def test_a_general_write_turns_the_fast_path_off_until_its_turn_is_written(tmp_path):
    async def main() -> None:
        node = Node(_config(tmp_path, "batch"))
        await node.start()
        try:
            engine = await _on_the_fast_path(node)

            conn = ClientTcpProtocol(node)
            transport = _Transport()
            conn.connection_made(transport)  # type: ignore[arg-type]
            plain = b'{"action":1,"queue":"q","data":"p","delay":0,"ttl":60,"retry":0}\n'
            batch = (b'{"action":1,"queue":"q","messages":[{"data":"b1"},{"data":"b2"}]}\n')
            # fast, general (a batch: proposed), then fast again: in one read
            conn.data_received(plain + batch + plain)
            assert not engine.commits_at_once  # the batch's Ready is not carried out
            for _ in range(100):
                if len(conn.slots) == 0:
                    break
                await asyncio.sleep(0.01)
            answers = [json.loads(line) for w in transport.written
                       for line in w.splitlines()]
            assert [a["code"] for a in answers] == [0, 0, 0]
            assert answers[0]["msg_id"] == 1 and answers[1]["msg_ids"] == [2, 3]
            assert answers[2]["msg_id"] == 4
            assert engine.commits_at_once  # back on after the flush
            conn.connection_lost(None)
        finally:
            node.stop()
            await node.shutdown()
        # the log on disk is in trans_id order and holds all three writes
        storage = DiskStorage.open(str(tmp_path / "data"), node.config.fsync)
        try:
            recovered = storage.recover()
            ids = [r.trans_id for r in recovered.records]
            assert ids == list(range(ids[0], ids[0] + len(ids)))
            assert len(ids) >= 4  # the election's Noop, then the three writes
        finally:
            storage.close()

    asyncio.run(main())


def _node_process(tmp_path, fsync: str) -> tuple[NodeProcess, int, Path]:
    """A `qserver run` alone with storage in tmp_path/data: the process,
    its port and its config file."""
    port = free_port()
    config = write_config(tmp_path / "node.xml", port,
                          f'  <storage dir="{tmp_path}/data" fsync="{fsync}"/>\n')
    return NodeProcess(config, port), port, config


@pytest.mark.parametrize("fsync", ["off", "batch"])
def test_every_acknowledged_write_survives_kill_9(tmp_path, fsync):
    node, port, config = _node_process(tmp_path, fsync)
    try:
        node.wait_ready()
        requests: list[dict] = []
        for i in range(300):  # fast-path writes with general ones among them
            requests.append({"action": 1, "queue": "q", "data": f"m{i}", "retry": 30})
            if i % 25 == 0:
                requests.append({"action": 1, "queue": "q", "messages": [
                    {"data": f"b{i}.{k}"} for k in range(3)]})
            if i % 40 == 0:
                requests.append({"action": 1, "queue": "q", "data": f"p{i}", "priority": 5})
            if i % 10 == 9:
                requests.append({"action": 2, "queue": "q"})
        answers = pipelined(port, requests)
        assert all(a["code"] == 0 for a in answers), [a for a in answers if a["code"]]
        udp = UdpClient(port)
        for i in range(20):
            assert udp.request(action=1, queue="u", data=f"u{i}")["code"] == 0
        # confirm half of what was delivered
        delivered = [a["msg_id"] for a, r in zip(answers, requests)
                     if r["action"] == 2 and "msg_id" in a]
        assert delivered
        client = TcpClient(port)
        for msg_id in delivered[::2]:
            assert client.request(action=3, queue="q", msg_id=msg_id)["code"] == 0
        before = {q: client.request(action=4, queue=q) for q in ("q", "u")}
        trans_id = client.request(action=104)["trans_id"]
        client.close()
    finally:
        node.kill()
    node = NodeProcess(config, port)
    try:
        node.wait_ready()
        client = TcpClient(port)
        assert client.request(action=104)["trans_id"] >= trans_id
        after = {q: client.request(action=4, queue=q) for q in ("q", "u")}
        for q in ("q", "u"):
            for key in ("size", "max_id", "in_flight"):
                assert after[q].get(key) == before[q].get(key), (q, key, before, after)
    finally:
        node.stop()


def test_the_answer_to_a_forwarded_write_leaves_with_its_record_written(tmp_path):
    """A master answers a slave's forwarded write on the fast path too: by
    the time its answer is sent back over the peer link, the record is in
    the log file, as for a client's."""
    async def main() -> None:
        node = Node(_config(tmp_path, "batch"))
        await node.start()
        try:
            engine = await _on_the_fast_path(node)
            sent: list[tuple[dict, bool]] = []

            def respond(answer: dict) -> None:
                sent.append((answer, _in_the_log_file(engine, engine.core.log.last_trans_id)))

            before = engine.storage.records_written
            engine.handle_forwarded({"action": 1, "queue": "q", "data": "f", "retry": 0},
                                    1_700_000_000_000, respond, None)
            assert engine.storage.records_written == before + 1
            assert [(a["code"], written) for a, written in sent] == [(0, True)]
        finally:
            node.stop()
            await node.shutdown()

    asyncio.run(main())


def test_a_log_file_cut_under_the_node_stops_it_loudly(tmp_path):
    """Records are copied into a mapping of the log's current segment
    (storage.disk, "Writing"): a page that cannot be read in (a disk
    error, here the file cut under the node) reaches the node as SIGBUS.
    It dies at once, the write unanswered (fail-stop, as a StorageError
    stops it), and its stderr says where: faulthandler's stack, in the
    log's write."""
    node, port, _ = _node_process(tmp_path, "batch")
    try:
        node.wait_ready()
        client = TcpClient(port)
        assert client.request(action=1, queue="q", data="before")["code"] == 0
        os.truncate(max((tmp_path / "data").glob("log-*.seg")), 0)
        with pytest.raises(ConnectionError):  # (reset, or closed by the server)
            client.request(action=1, queue="q", data="after")
        client.close()
        node.proc.wait(timeout=30)
    finally:
        node.kill()
    assert node.proc.returncode == -signal.SIGBUS
    assert "Bus error" in node.stderr_text and "append_payload" in node.stderr_text, \
        node.stderr_text[-2000:]
