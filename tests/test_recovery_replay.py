"""DiskStorage.recover(replay=...) on real files: the log after the snapshot
handed over as it is read (a node alone applies it at once; node._recover)
gives exactly what recovery would have returned, each record once and in
order, and only from a log that continues the snapshot; a node alone that
replays so comes back with every message and goes on where it stopped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from procs import NodeProcess, TcpClient
from qserver.state.entries import Record
from qserver.storage import DiskStorage, StorageError, recovery
from qserver.storage import format as fmt
from test_snapshots import produce_each, start_single
from test_storage_disk import recs, segment_files, state_for


class Replay:
    """What recover's `replay` saw: the snapshot, then each call's records."""

    def __init__(self) -> None:
        self.snapshot: object = "never called"
        self.calls: list[list[Record]] = []

    def __call__(self, snapshot):
        self.snapshot = snapshot
        return self.calls.append

    @property
    def records(self) -> list[Record]:
        return [r for call in self.calls for r in call]


def recover_both(path: Path, tmp_path: Path, segment_bytes: int = 1 << 20):
    """Recover two copies of the directory at `path`: as before, and with
    replay. Returns (held, replayed, replay, next_trans_ids)."""
    plain, streamed = tmp_path / "plain", tmp_path / "streamed"
    shutil.copytree(path, plain)
    shutil.copytree(path, streamed)
    a = DiskStorage.open(str(plain), "always", segment_bytes=segment_bytes)
    held = a.recover()
    b = DiskStorage.open(str(streamed), "always", segment_bytes=segment_bytes)
    replay = Replay()
    replayed = b.recover(replay=replay)
    nexts = (a.next_trans_id, b.next_trans_id)
    a.close()
    b.close()
    return held, replayed, replay, nexts


def write(path: Path, last: int, snapshot_at: int | None = None, segment_bytes=1 << 20) -> None:
    storage = DiskStorage.open(str(path), "always", segment_bytes=segment_bytes)
    storage.recover()
    storage.append(recs(1, last))
    if snapshot_at is not None:
        storage.write_snapshot(snapshot_at, 1, state_for(snapshot_at))
    storage.close()


@pytest.mark.parametrize("block", [64, 1000, 1 << 22])
@pytest.mark.parametrize("snapshot_at", [None, 15, 40])
def test_replay_hands_over_what_recovery_returns_as_it_reads(tmp_path, monkeypatch, block,
                                                             snapshot_at):
    monkeypatch.setattr(recovery, "_SEGMENT_BLOCK", block)
    src = tmp_path / "src"
    write(src, 40, snapshot_at)
    held, replayed, replay, (next_a, next_b) = recover_both(src, tmp_path)
    assert replay.snapshot == held.snapshot == replayed.snapshot
    assert replayed.records == [] and replay.records == held.records
    assert replayed.applied_to == ((40, 1) if snapshot_at != 40 else None)
    assert next_a == next_b == 41 and replayed.reports == held.reports
    if block == 64 and snapshot_at is None:  # read in many blocks: handed over in many
        assert len(replay.calls) > 5


@pytest.mark.parametrize("older", ["removed", "kept"])
def test_a_snapshot_at_a_segment_end_is_continued_and_handed_over(tmp_path, older):
    """The snapshot ends a segment: once that segment is gone (as writing
    the snapshot removes it) the log starts right after the snapshot; while
    it is there, its last record carries the snapshot's vote_id, seen in
    the segment before the first record handed over. Either way the log
    continues the snapshot and goes to `replay`, none of it held."""
    src = tmp_path / "src"
    write(src, 40, segment_bytes=400)
    firsts = [int(f.name[4:24]) for f in segment_files(src)]
    snap = firsts[1] - 1
    blob = b"".join(fmt.encode_snapshot_chunks(snap, 1, state_for(snap)))
    (src / f"snapshot-{snap:020d}.snap").write_bytes(blob)
    if older == "removed":
        segment_files(src)[0].unlink()
    held, replayed, replay, (next_a, next_b) = recover_both(src, tmp_path, segment_bytes=400)
    assert held.records == recs(snap + 1, 40) and held.reports == []
    assert replay.records == held.records and replayed.records == []
    assert replayed.applied_to == (40, 1) and next_a == next_b == 41


@pytest.mark.parametrize("block", [64, 1 << 22])
@pytest.mark.parametrize("damage", ["torn", "zeros_then_records"])
def test_a_torn_tail_after_records_handed_over_gives_each_once(tmp_path, monkeypatch, block,
                                                               damage):
    """A damaged last segment is read again whole: what the blocks handed
    over before the damage was found is not handed over twice."""
    monkeypatch.setattr(recovery, "_SEGMENT_BLOCK", block)
    src = tmp_path / "src"
    write(src, 40)
    seg = segment_files(src)[-1]
    data = seg.read_bytes()
    end_38 = sum(len(fmt.encode_record(r)) for r in recs(1, 38))
    if damage == "torn":
        seg.write_bytes(data[:-5])  # record 40 torn
        expect = recs(1, 39)
    else:  # record 39 torn, a sector of zeros, record 40 whole (a power loss)
        end_39 = end_38 + len(fmt.encode_record(recs(39, 39)[0]))
        torn = data[:end_39 - 5]
        pad = bytes(-len(torn) % 512 + 512)
        seg.write_bytes(torn + pad + fmt.encode_record(recs(40, 40)[0]))
        expect = recs(1, 38)
    held, replayed, replay, (next_a, next_b) = recover_both(src, tmp_path)
    assert held.records == expect and replay.records == expect
    assert replayed.records == [] and replayed.applied_to == (expect[-1].trans_id, 1)
    assert len(replayed.reports) == 1 and replayed.reports == [
        r.replace("/plain/", "/streamed/") for r in held.reports]
    assert next_a == next_b == len(expect) + 1


def test_a_log_from_before_the_snapshot_is_never_handed_over(tmp_path):
    """A crash between installing a master's snapshot (another vote_id at
    its trans_id) and removing the old log: the log goes, unapplied."""
    src = tmp_path / "src"
    write(src, 30)
    blob = b"".join(fmt.encode_snapshot_chunks(20, 2, state_for(20)))
    (src / f"snapshot-{20:020d}.snap").write_bytes(blob)
    held, replayed, replay, (next_a, next_b) = recover_both(src, tmp_path)
    assert replay.calls == [] and replayed.applied_to is None
    assert held.records == replayed.records == [] and replayed.snapshot[:2] == (20, 2)
    assert any("predates the snapshot" in r for r in replayed.reports)
    assert next_a == next_b == 21


@pytest.mark.parametrize("gap", ["no_snapshot", "after_snapshot"])
def test_a_log_with_a_gap_is_refused_before_anything_is_handed_over(tmp_path, gap):
    """Without a snapshot the log must start at trans_id 1; with one (at 5),
    right after it or before it: the first segment (records 1 to about 10)
    gone leaves a gap either way."""
    write(tmp_path, 40, snapshot_at=None if gap == "no_snapshot" else 5, segment_bytes=400)
    segment_files(tmp_path)[0].unlink()
    storage = DiskStorage.open(str(tmp_path), "always", segment_bytes=400)
    replay = Replay()
    with pytest.raises(StorageError):
        storage.recover(replay=replay)
    assert replay.calls == []


def test_a_node_alone_replays_its_log_into_the_store_as_it_reads(tmp_path):
    """A real node alone (log_size 100,000: no snapshot of 300 writes),
    killed with -9: it restarts with every message from the log, whose
    records it applied as it read them (its in-memory log starts after
    them; it has no snapshot still), and goes on with the next msg_id and
    the next message to deliver; twice."""
    node, data, cfg = start_single(tmp_path, log_size=100_000)
    port = node.port
    try:
        c = TcpClient(port)
        produce_each(c, 300)
        assert c.request(action=2, queue="s")["data"] == "m0"  # (retry 0: gone)
        before = c.request(action=104, queue="s")
        assert before["snapshot"]["snapshot_id"] == 0 and before["size"] == 299
    finally:
        node.kill()
    for round_ in range(2):
        node = NodeProcess(cfg, port)
        node.wait_ready()
        try:
            c = TcpClient(port)
            after = c.request(action=104, queue="s")
            assert after["snapshot"]["snapshot_id"] == 0 and after["trans_id"] > before["trans_id"]
            assert (after["size"], after["max_id"]) == (before["size"], before["max_id"])
            assert after["log_size"] <= 2, after  # the records replayed are not held
            got = c.request(action=1, queue="s", data=f"next{round_}")
            assert got["code"] == 0 and got["msg_id"] == before["max_id"] + 1
            assert c.request(action=2, queue="s")["data"] == f"m{round_ + 1}"
            before = c.request(action=104, queue="s")
        finally:
            node.kill()
