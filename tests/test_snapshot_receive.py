"""SnapshotFiles receiving snapshot files from masters (engines/native/snapshots.py):
two streams can end in one loop turn (a deposed master's, started before
an election, and the new master's); the core takes at most one, and the
flush must install exactly that file and discard the other."""

from __future__ import annotations

import os

from qserver.engines.messages import Snapshot, SnapshotChunk
from qserver.engines.native.snapshots import SnapshotFiles
from qserver.state.entries import Produce
from qserver.state.store import Store
from qserver.storage import DiskStorage, snapshot_file_name, store_wire_iter, write_snapshot_file


class _Core:
    """What SnapshotFiles asks of the core: a store to build loaders from."""

    vote_id = 5
    snapshot_id = 0

    def __init__(self) -> None:
        self.store = Store(queue_size=100, virtual_queues={})


def _snapshot_bytes(tmp_path, trans_id: int, vote_id: int, data: str) -> bytes:
    store = Store(queue_size=100, virtual_queues={})
    store.apply(Produce(targets=(("q", 1),), data=data, ready_ms=1, ttl_ms=10**13, retry_ms=0))
    src = tmp_path / f"src-{trans_id}"
    src.mkdir()
    path = write_snapshot_file(str(src), trans_id, vote_id, store_wire_iter(store))
    with open(path, "rb") as f:
        return f.read()


def _receive(files: SnapshotFiles, peer: int, trans_id: int, vote_id: int, body: bytes) -> None:
    files.on_chunk(peer, SnapshotChunk(vote_id=vote_id, node_id=peer, trans_id=trans_id,
                                       log_vote_id=vote_id, offset=0, data=body, last=True))


def test_two_files_in_one_turn_install_the_one_the_core_took(tmp_path):
    new = _snapshot_bytes(tmp_path, 40, 4, "new master's")
    stale = _snapshot_bytes(tmp_path, 30, 3, "deposed master's")
    data = tmp_path / "data"
    storage = DiskStorage.open(str(data), "always")
    storage.recover()
    stepped: list[Snapshot] = []
    files = SnapshotFiles(core=_Core(), storage=storage, node_id=2, log_size=10,
                          send=lambda peer, msg: True, step=stepped.append,
                          schedule_flush=lambda: None)
    try:
        _receive(files, 3, 40, 4, new)  # the core takes this one...
        _receive(files, 1, 30, 3, stale)  # ...and ignores this older one
        assert [(s.trans_id, s.node_id) for s in stepped] == [(40, 3), (30, 1)]
        taken = stepped[0]
        files.install_into(storage, taken.trans_id, taken.state)
        files.discard_unwanted()
        names = sorted(os.listdir(data))
        assert snapshot_file_name(40) in names
        assert not [n for n in names if n.startswith("incoming-") or n == snapshot_file_name(30)]
    finally:
        storage.close()


def test_a_file_the_core_did_not_take_is_discarded(tmp_path):
    body = _snapshot_bytes(tmp_path, 30, 3, "x")
    stepped: list[Snapshot] = []
    files = SnapshotFiles(core=_Core(), storage=None, node_id=2, log_size=10,
                          send=lambda peer, msg: True, step=stepped.append,
                          schedule_flush=lambda: None)
    try:
        _receive(files, 1, 30, 3, body)
        files.discard_unwanted()
        assert not [n for n in os.listdir(files.dir) if n.startswith("incoming-")]
    finally:
        files.stop()
