"""A disk that fills up: writes are refused with "disk full" before they
reach the log, nothing acknowledged is lost, a slave that cannot store
replicated records does not acknowledge them, and the node serves again
once space is freed. Any other write error still stops the node.

Storage-level tests simulate the full disk (a write that would extend a
file fails with ENOSPC); the real-process tests make a small tmpfs, which
needs root (skipped otherwise).
"""

from __future__ import annotations

import errno
import os
import select
import socket
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from procs import Cluster, NodeProcess, TcpClient, free_port, wait_until
from qserver.state.entries import (
    Configure,
    Confirm,
    Consume,
    ConsumeMany,
    DeadLetter,
    Nack,
    Noop,
    Produce,
    Record,
    Touch,
)
from qserver.storage import DiskStorage, StorageError, disk, record_size_bound
from qserver.storage.format import encode_record

# -- storage, with a simulated full disk ---------------------------------------


class SimulatedDisk:
    """os.pwrite that fails with `error` when it would extend a file while
    `full`: writes over zeros already there still succeed, as on a real file
    system that overwrites in place."""

    def __init__(self, monkeypatch) -> None:
        self.full = False
        self.error = errno.ENOSPC
        real = os.pwrite

        def pwrite(fd, data, offset):
            if self.full and offset + len(data) > os.fstat(fd).st_size:
                raise OSError(self.error, os.strerror(self.error))
            return real(fd, data, offset)

        monkeypatch.setattr(disk.os, "pwrite", pwrite)


def produce_rec(trans_id: int, size: int = 40) -> Record:
    return Record(trans_id, 1, Produce(targets=(("q", trans_id),), data="d" * size,
                                       ready_ms=1, ttl_ms=2, retry_ms=0))


def open_dir(path, segment_bytes: int = disk.SEGMENT_BYTES) -> DiskStorage:
    storage = DiskStorage.open(str(path), "always", segment_bytes=segment_bytes)
    storage.recover()
    return storage


def recovered_ids(path) -> list[int]:
    storage = DiskStorage.open(str(path), "always")
    try:
        return [r.trans_id for r in storage.recover().records]
    finally:
        storage.close()


def test_make_room_then_appends_within_it_survive_a_full_disk(tmp_path, monkeypatch):
    fs = SimulatedDisk(monkeypatch)
    storage = open_dir(tmp_path)
    assert storage.room == 0 and storage.make_room(10_000)  # starts the first segment
    assert storage.room >= 10_000
    storage.append([produce_rec(t) for t in range(1, 11)])
    fs.full = True
    storage.append([produce_rec(t) for t in range(11, 21)])  # in the room: no allocation
    storage.sync()
    assert not storage.make_room(storage.room + 1)  # no more: refused, not poisoned
    assert storage.make_room(100)  # what is there still counts
    storage.append([produce_rec(21)])
    fs.full = False
    assert storage.make_room(storage.room + 1)  # space is back
    storage.append([produce_rec(22)])
    storage.close()
    assert recovered_ids(tmp_path) == list(range(1, 23))


def test_a_roll_without_space_stays_in_the_current_segment(tmp_path, monkeypatch):
    fs = SimulatedDisk(monkeypatch)
    storage = open_dir(tmp_path, segment_bytes=400)
    assert storage.make_room(20 * 100)
    fs.full = True
    # far past segment_bytes: the new segment cannot be made, the room can
    storage.append([produce_rec(t) for t in range(1, 21)])
    assert len(list(tmp_path.glob("log-*.seg"))) == 1
    assert not list(tmp_path.glob("*.tmp"))
    fs.full = False
    assert storage.make_room(200)
    storage.append([produce_rec(21)])  # rolls now
    assert len(list(tmp_path.glob("log-*.seg"))) == 2
    storage.abandon()  # a crash: the last segment keeps its zeros
    assert recovered_ids(tmp_path) == list(range(1, 22))


def test_a_segment_started_by_make_room_and_never_written_recovers(tmp_path):
    storage = open_dir(tmp_path)
    storage.append([produce_rec(t) for t in range(1, 4)])
    storage.close()  # trimmed: no room left
    storage = open_dir(tmp_path, segment_bytes=disk.SEGMENT_BYTES)
    storage.append([produce_rec(t) for t in range(4, 6)])
    storage.abandon()
    assert recovered_ids(tmp_path) == [1, 2, 3, 4, 5]
    fresh = tmp_path / "fresh"
    storage = open_dir(fresh)
    assert storage.make_room(1000)
    storage.abandon()  # an empty segment of zeros, named for trans_id 1
    storage = open_dir(fresh)
    assert storage.next_trans_id == 1
    storage.append([produce_rec(1)])
    storage.close()
    assert recovered_ids(fresh) == [1]


def test_an_io_error_while_making_room_stops_the_storage(tmp_path, monkeypatch):
    fs = SimulatedDisk(monkeypatch)
    storage = open_dir(tmp_path)
    storage.append([produce_rec(1)])
    fs.full, fs.error = True, errno.EIO
    with pytest.raises(StorageError, match="write failed"):
        storage.make_room(storage.room + 1)
    with pytest.raises(StorageError):
        storage.append([produce_rec(2)])
    storage.abandon()


def test_a_write_past_the_room_on_a_full_disk_stops_the_storage(tmp_path, monkeypatch):
    """Records the node did not reserve room for (its bug): the write
    itself meets ENOSPC, and what reached the file is unknown: fail-stop."""
    fs = SimulatedDisk(monkeypatch)
    storage = open_dir(tmp_path)
    storage.append([produce_rec(1)])
    storage.append([produce_rec(2, size=storage.room)])  # uses up the room and more
    fs.full = True
    with pytest.raises(StorageError):
        storage.append([produce_rec(3, size=storage.room + 100)])
    with pytest.raises(StorageError):
        storage.append([produce_rec(4)])
    storage.abandon()
    assert recovered_ids(tmp_path) == [1, 2]


names = st.text(min_size=1, max_size=40)
ids = st.integers(1, 2**64 - 1)
times = st.integers(0, 2**64 - 1)
finals = st.sampled_from([0, 1, 2])  # entries.FINAL_*
entries = st.one_of(
    st.builds(lambda targets, data, a, b, c: Produce(targets=tuple(targets), data=data,
                                                     ready_ms=a, ttl_ms=b, retry_ms=c),
              st.lists(st.tuples(names, ids), min_size=1, max_size=4,
                       unique_by=lambda t: t[0]),
              st.text(max_size=300), times, times, times),
    st.builds(Consume, queue=names, msg_id=ids, retry_at_ms=times, epoch=times,
              final=finals),
    st.builds(Confirm, queue=names, msg_id=ids),
    st.just(Noop()),
    st.builds(ConsumeMany, items=st.lists(st.tuples(names, ids, times, finals), min_size=1,
                                          max_size=8, unique_by=lambda t: t[:2]).map(tuple),
              epoch=times),
    st.builds(Nack, queue=names, msg_id=ids, ready_ms=times),
    st.builds(Touch, queue=names, msg_id=ids, retry_at_ms=ids, final=finals),
    st.builds(DeadLetter, queue=names, msg_id=ids, reason=st.sampled_from([1, 2]),
              targets=st.lists(st.tuples(names, ids), max_size=4,
                               unique_by=lambda t: t[0]).map(tuple),
              ready_ms=times, ttl_ms=times),
    st.builds(Configure, queue=names, settings=st.lists(st.one_of(
        st.tuples(st.just("max_deliveries"), st.integers(0, 1_000_000)),
        st.tuples(st.just("dead_letter"), st.text(max_size=255))), max_size=2).map(tuple)))


@settings(max_examples=500, deadline=None)
@given(entry=entries, trans_id=ids, vote_id=times)
def test_record_size_bound_is_an_upper_bound(entry, trans_id, vote_id):
    assert len(encode_record(Record(trans_id, vote_id, entry))) <= record_size_bound(entry)


# -- real processes on a small tmpfs -------------------------------------------------

FS_BYTES = 8 * 1024 * 1024


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of FS_BYTES mounted for the test (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small-fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(directory: Path, name: str = "filler") -> Path:
    """Take every free byte of the file system holding `directory`."""
    filler = directory / name
    block = bytes(64 * 1024)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    for size in (4096, 512, 1):  # the last partial blocks too
        try:
            with open(filler, "ab") as f:
                while True:
                    f.write(bytes(size))
                    f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def start_single(tmp_path: Path, port: int, data: Path) -> NodeProcess:
    path = tmp_path / "node.xml"
    path.write_text(f'<config><node_info node_id="1" host="127.0.0.1" port="{port}"/>'
                    f'<storage dir="{data}" fsync="always"/></config>')
    node = NodeProcess(path, port)
    node.wait_ready()
    return node


def drain(c: TcpClient, queue: str) -> list[str]:
    """Consume (retry=0 messages: deleted on delivery) until empty."""
    out = []
    while True:
        r = c.request(action=2, queue=queue)
        assert r["code"] == 0, r
        if "data" not in r:
            return out
        out.append(r["data"])


def test_a_full_disk_refuses_writes_loses_nothing_and_serves_again(tmp_path, small_fs):
    port, data = free_port(), small_fs / "data"
    node = start_single(tmp_path, port, data)
    payload = "x" * 2000
    acked: list[str] = []
    try:
        c = TcpClient(port)
        for i in range(50):
            r = c.request(action=1, queue="q", data=f"{i}:{payload}")
            assert r["code"] == 0
            acked.append(f"{i}:{payload}")
        filler = fill(small_fs)
        refused = None
        for i in range(50, 5000):  # the room reserved ahead runs out within ~1 MiB
            r = c.request(action=1, queue="q", data=f"{i}:{payload}")
            if r["code"] != 0:
                refused = r
                break
            acked.append(f"{i}:{payload}")
        assert refused is not None and refused["code"] == -1, refused
        assert refused["reason"] == "disk full"
        # every write is refused now, reads are answered
        assert c.request(action=2, queue="q")["reason"] == "disk full"
        info = c.request(action=104, queue="q")
        assert info["size"] == len(acked) and info["storage"]["disk_full"] is True
        filler.unlink()
        r = wait_until(lambda: (r := c.request(action=1, queue="q", data="after"))
                       ["code"] == 0 and r, deadline_s=60)
        acked.append("after")
        c.close()
    finally:
        node.kill()  # a crash: everything acknowledged must be on disk
    node = start_single(tmp_path, port, data)
    try:
        c = TcpClient(port)
        assert drain(c, "q") == acked  # all of it, in order, nothing else
    finally:
        node.kill()
    assert " CRITICAL " not in node.stderr_text


def test_a_slave_with_a_full_disk_does_not_acknowledge(tmp_path, small_fs):
    """Three nodes; a slave's data directory is on the small file system.
    While it is full, the master and the other slave commit on their own;
    with the other slave gone too, a write waits: the full slave must not
    acknowledge what it cannot store. Once space is freed it stores the
    records, the write is answered, and after all three crash everything
    acknowledged is there."""
    c = Cluster(tmp_path, extra='  <storage dir="{data}" fsync="always"/>\n')
    dirs = {1: tmp_path / "d1", 2: tmp_path / "d2", 3: tmp_path / "d3"}

    def config_path(node_id: int) -> Path:
        path = tmp_path / f"node{node_id}.xml"
        data = small_fs / "data" if node_id == full_id else dirs[node_id]
        path.write_text(c.config_path(node_id).read_text().replace("{data}", str(data)))
        return path

    full_id = None
    try:
        # start all three on ordinary directories to learn the master, then
        # restart one slave on the small file system
        for i in (1, 2, 3):
            c.nodes[i] = NodeProcess(config_path(i), c.port(i))
        for node in c.nodes.values():
            node.wait_ready()
        master = c.wait_master()
        full_id, other = [i for i in (1, 2, 3) if i != master]
        c.nodes[full_id].kill()
        c.nodes[full_id] = NodeProcess(config_path(full_id), c.port(full_id))
        c.nodes[full_id].wait_ready()
        wait_until(lambda: c.master() == master)
        acked = []
        client = TcpClient(c.port(master))
        for i in range(20):
            assert client.request(action=1, queue="q", data=f"m{i}")["code"] == 0
            acked.append(f"m{i}")
        wait_until(lambda: (c.ask(full_id, action=104) or {}).get("commit_id", 0)
                   >= (c.ask(master, action=104) or {}).get("trans_id", 1))
        filler = fill(small_fs)
        payload = "y" * 4000
        for i in range(400):  # more than the room the slave had reserved
            assert client.request(action=1, queue="q", data=f"p{i}:{payload}")["code"] == 0
            acked.append(f"p{i}:{payload}")
        assert wait_until(lambda: (c.ask(full_id, action=104) or {}).get("storage", {})
                          .get("disk_full"))
        c.nodes[other].kill()
        # this write can only commit with the full slave's acknowledgement
        pending = socket.create_connection(("127.0.0.1", c.port(master)), timeout=60)
        pending.sendall(b'{"action":1,"queue":"q","data":"last","seq":1}')
        wait_until(lambda: (c.ask(master, action=104) or {}).get("trans_id", 0)
                   > (c.ask(full_id, action=104) or {}).get("trans_id", 0))
        readable, _, _ = select.select([pending], [], [], 1.0)
        assert not readable, pending.recv(4096)  # not acknowledged
        filler.unlink()
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = pending.recv(4096)
            assert chunk
            answer += chunk
        assert b'"code":0' in answer, answer
        acked.append("last")
        pending.close()
        client.close()
    finally:
        c.stop_all()  # kill -9 of every node
    for i in (1, 2, 3):
        assert " CRITICAL " not in c.nodes[i].stderr_text, c.nodes[i].stderr_text
    for i in (1, 2, 3):
        c.nodes[i] = NodeProcess(config_path(i), c.port(i))
    try:
        for node in c.nodes.values():
            node.wait_ready()
        m = c.wait_master()
        client = TcpClient(c.port(m))
        assert drain(client, "q") == acked
    finally:
        c.stop_all()


def test_votes_are_saved_on_a_full_disk(tmp_path, small_fs):
    """An election must not stop a node whose disk is full: the vote is
    written over a spare file kept for it, and the next spare takes the
    space the old vote leaves."""
    from qserver.storage.recovery import read_vote

    data = small_fs / "data"
    storage = open_dir(data)
    storage.save_vote(1, 1)
    fill(small_fs)
    for vote_id in range(2, 7):
        storage.save_vote(vote_id, 2)
    storage.close()
    assert read_vote(str(data / "vote")) == (6, 2)
    (data / "vote.spare").unlink()  # no spare and no space: the node must stop
    fill(small_fs, "filler2")  # the spare's space too
    storage = open_dir(data)  # (recover() cannot make a spare either)
    assert not (data / "vote.spare").exists()
    with pytest.raises(StorageError):
        storage.save_vote(7, 1)
    storage.abandon()
    assert read_vote(str(data / "vote")) == (6, 2)
