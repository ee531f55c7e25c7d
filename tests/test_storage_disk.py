"""DiskStorage (qserver.storage.disk) on real files with real fsync: round
trips, torn tails, corruption, segments, truncation, snapshots, the vote,
and random crash schedules against a model of what must survive."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from qserver.errors import InvariantError, QServerError
from qserver.state.entries import Consume, Noop, Produce, Record
from qserver.storage import DiskStorage, StorageError
from qserver.storage import disk as disk_module
from qserver.storage import format as fmt
from qserver.storage.disk import PREALLOCATE_BYTES

SMALL = 400  # segment_bytes for tests: a few records per segment


def rec(trans_id: int, vote_id: int = 1, size: int = 20) -> Record:
    if trans_id % 3 == 0:
        return Record(trans_id, vote_id, Consume(queue="q", msg_id=trans_id, retry_at_ms=5))
    if trans_id % 7 == 0:
        return Record(trans_id, vote_id, Noop())
    return Record(trans_id, vote_id, Produce(targets=(("q", trans_id),), data="d" * size,
                                             ready_ms=1, ttl_ms=2, retry_ms=0))


def recs(first: int, last: int, vote_id: int = 1) -> list[Record]:
    return [rec(t, vote_id) for t in range(first, last + 1)]


def state_for(t: int) -> list:
    """A small store wire form that names the trans_id it stands for."""
    return [["q", t, [[t, f"state at {t}", 1, 2, 0, 0]]]] if t else []


def open_dir(path, fsync="always", segment_bytes=SMALL):
    storage = DiskStorage.open(str(path), fsync, segment_bytes=segment_bytes)
    return storage, storage.recover()


def segment_files(path) -> list[Path]:
    return sorted(Path(path).glob("log-*.seg"))


def test_fresh_directory_is_created_and_empty(tmp_path):
    d = tmp_path / "a" / "b"
    storage, got = open_dir(d)
    assert d.is_dir()
    assert got.vote == (0, 0) and got.snapshot is None and got.records == [] and got.reports == []
    assert storage.next_trans_id == 1
    storage.close()


def test_append_close_recover_round_trip(tmp_path):
    storage, _ = open_dir(tmp_path, segment_bytes=1 << 20)
    storage.append(recs(1, 50))
    storage.append([])
    storage.append(recs(51, 60, vote_id=2))
    storage.close()
    storage, got = open_dir(tmp_path, segment_bytes=1 << 20)
    assert got.records == recs(1, 50) + recs(51, 60, vote_id=2)
    assert got.reports == []
    assert storage.next_trans_id == 61
    storage.append(recs(61, 61, vote_id=2))
    storage.abandon()
    _, got = open_dir(tmp_path)
    assert got.records[-1] == rec(61, 2)


def test_process_crash_loses_nothing_appended(tmp_path):
    storage, _ = open_dir(tmp_path, fsync="off")
    storage.append(recs(1, 30))
    storage.abandon()  # no sync, no close: the page cache holds the writes
    _, got = open_dir(tmp_path)
    assert got.records == recs(1, 30)


def test_append_out_of_order_is_our_bug(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 2))
    with pytest.raises(InvariantError):
        storage.append([rec(4)])
    with pytest.raises(InvariantError):
        storage.append([rec(2)])


def test_second_open_of_a_directory_is_refused(tmp_path):
    storage, _ = open_dir(tmp_path)
    with pytest.raises(StorageError, match="another process"):
        DiskStorage.open(str(tmp_path))
    storage.close()
    open_dir(tmp_path)[0].close()


def test_unknown_fsync_policy(tmp_path):
    with pytest.raises(ValueError):
        DiskStorage.open(str(tmp_path), "sometimes")


# -- torn tails ---------------------------------------------------------------

def write_log(path, n=10, segment_bytes=1 << 20) -> Path:
    storage, _ = open_dir(path, segment_bytes=segment_bytes)
    storage.append(recs(1, n))
    storage.close()
    return segment_files(path)[-1]


def assert_only_records(seg: Path) -> None:
    """The file holds valid records, then at most zeros (space allocated
    ahead): nothing cut away is left behind them."""
    data = seg.read_bytes()
    result = fmt.scan(data)
    assert result.problem is None or data.count(0, result.good_end_offset) == \
        len(data) - result.good_end_offset, result.problem


FRAME_END_9 = sum(len(fmt.encode_record(r)) for r in recs(1, 9))


@pytest.mark.parametrize("damage", ["mid_payload", "partial_header", "garbage",
                                    "half_zeroed_frame"])
def test_torn_tail_is_cut_reported_and_appending_goes_on(tmp_path, damage):
    seg = write_log(tmp_path, n=10)
    data = seg.read_bytes()
    if damage == "mid_payload":
        seg.write_bytes(data[:-5])  # record 10 loses its last bytes
        expect, cut_at = recs(1, 9), FRAME_END_9
    elif damage == "partial_header":
        seg.write_bytes(data[:FRAME_END_9 + 6])  # the length and half the crc
        expect, cut_at = recs(1, 9), FRAME_END_9
    elif damage == "garbage":
        seg.write_bytes(data + bytes(random.Random(1).randrange(256) for _ in range(37)))
        expect, cut_at = recs(1, 10), len(data)
    else:  # record 10's first page reached the disk, its last bytes did not
        seg.write_bytes(data[:-5] + bytes(4096))
        expect, cut_at = recs(1, 9), FRAME_END_9
    storage, got = open_dir(tmp_path, segment_bytes=1 << 20)
    assert got.records == expect
    assert len(got.reports) == 1
    assert str(seg) in got.reports[0] and f"at offset {cut_at}" in got.reports[0]
    assert seg.stat().st_size == cut_at
    n = len(expect)
    storage.append(recs(n + 1, n + 5, vote_id=2))
    storage.close()
    _, got = open_dir(tmp_path, segment_bytes=1 << 20)
    assert got.records == expect + recs(n + 1, n + 5, vote_id=2)
    assert got.reports == []


def test_space_allocated_ahead_is_no_damage(tmp_path):
    """The current segment's file holds zeros after its records (allocated
    ahead, or after a crash never written): recovery keeps every record,
    reports nothing, and the next records go right after the last."""
    seg = write_log(tmp_path, n=10)
    data = seg.read_bytes()
    seg.write_bytes(data + bytes(100_000))
    storage, got = open_dir(tmp_path, segment_bytes=1 << 20)
    assert got.records == recs(1, 10) and got.reports == []
    storage.append(recs(11, 12, vote_id=2))
    storage.sync()
    storage.abandon()  # a crash: the zeros after record 12 stay
    assert seg.stat().st_size >= len(data) + 100_000
    storage, got = open_dir(tmp_path, segment_bytes=1 << 20)
    assert got.records == recs(1, 10) + recs(11, 12, vote_id=2) and got.reports == []
    storage.close()  # an orderly close trims the file to its records
    assert seg.read_bytes() == b"".join(fmt.encode_record(r) for r in got.records)


@pytest.mark.parametrize("block", [1, 7, 64, 1000])
def test_segments_read_in_blocks_of_any_size(tmp_path, monkeypatch, block):
    """Recovery reads a segment in blocks (recovery._SEGMENT_BLOCK), so
    frames, headers and the zeros allocated ahead straddle block ends:
    the records, the place of the next append, a torn tail (cut) and
    corruption before valid records (refused) come out as with the whole
    file."""
    from qserver.storage import recovery

    monkeypatch.setattr(recovery, "_SEGMENT_BLOCK", block)
    seg = write_log(tmp_path, n=10)
    storage, got = open_dir(tmp_path, segment_bytes=1 << 20)
    assert got.records == recs(1, 10) and got.reports == []
    storage.append(recs(11, 12, vote_id=2))
    storage.sync()
    storage.abandon()  # a crash: zeros allocated ahead stay after record 12
    storage, got = open_dir(tmp_path, segment_bytes=1 << 20)
    assert got.records == recs(1, 10) + recs(11, 12, vote_id=2) and got.reports == []
    storage.close()
    data = seg.read_bytes()
    seg.write_bytes(data[:-5] + bytes(100))  # the last record torn, zeros after it
    storage, got = open_dir(tmp_path, segment_bytes=1 << 20)
    assert got.records == recs(1, 10) + recs(11, 11, vote_id=2)
    assert len(got.reports) == 1 and "cut" in got.reports[0]
    storage.close()
    data = seg.read_bytes()
    first = len(fmt.encode_record(rec(1)))
    seg.write_bytes(data[:first + 9] + b"x" + data[first + 10:])  # record 2 damaged
    with pytest.raises(StorageError, match="before valid records"):
        open_dir(tmp_path, segment_bytes=1 << 20)


def test_records_covered_by_the_snapshot_are_checked_not_returned(tmp_path):
    """Records at or below the snapshot are read (damage there still stops
    the node) but not returned; those returned share their queue names."""
    storage, _ = open_dir(tmp_path, segment_bytes=1 << 20)
    storage.append(recs(1, 40))
    storage.write_snapshot(30, 1, state_for(30))
    storage.close()
    storage, got = open_dir(tmp_path, segment_bytes=1 << 20)
    assert got.snapshot[0] == 30 and got.records == recs(31, 40)
    names = {id(r.entry.targets[0][0]) for r in got.records if type(r.entry) is Produce}
    assert len(names) == 1
    storage.close()
    seg = segment_files(tmp_path)[0]
    data = seg.read_bytes()
    first = len(fmt.encode_record(rec(1)))
    seg.write_bytes(data[:first + 9] + b"x" + data[first + 10:])  # record 2, below the snapshot
    with pytest.raises(StorageError, match="before valid records"):
        open_dir(tmp_path, segment_bytes=1 << 20)


def test_the_current_segment_is_zero_filled_ahead_and_trimmed_when_done(tmp_path):
    storage, _ = open_dir(tmp_path, segment_bytes=1 << 20)
    storage.append(recs(1, 3))
    storage.sync()
    seg = segment_files(tmp_path)[-1]
    written = sum(len(fmt.encode_record(r)) for r in recs(1, 3))
    ahead = min(PREALLOCATE_BYTES, 1 << 20)
    assert seg.stat().st_size == written + ahead
    assert seg.read_bytes()[written:] == bytes(ahead)
    size = seg.stat().st_size
    storage.append(recs(4, 6))  # written over the zeros: the file does not grow
    assert seg.stat().st_size == size
    storage.close()
    assert seg.stat().st_size == sum(len(fmt.encode_record(r)) for r in recs(1, 6))


def test_zeros_before_valid_records_are_corruption(tmp_path):
    seg = write_log(tmp_path, n=10)
    data = bytearray(seg.read_bytes())
    start = sum(len(fmt.encode_record(r)) for r in recs(1, 4))
    end = sum(len(fmt.encode_record(r)) for r in recs(1, 5))
    data[start:end] = bytes(end - start)  # record 5 lost: a hole, not the end
    seg.write_bytes(bytes(data))
    with pytest.raises(StorageError) as info:
        open_dir(tmp_path)
    assert info.value.offset == start


def test_corrupt_last_frame_is_a_torn_tail(tmp_path):
    seg = write_log(tmp_path, n=10)
    data = bytearray(seg.read_bytes())
    data[-3] ^= 0xFF
    seg.write_bytes(bytes(data))
    _, got = open_dir(tmp_path)
    assert got.records == recs(1, 9)
    assert "crc mismatch" in got.reports[0] and f"offset {FRAME_END_9}" in got.reports[0]


@pytest.mark.parametrize("where", ["payload", "length"])
def test_corruption_before_the_tail_stops_with_file_and_offset(tmp_path, where):
    seg = write_log(tmp_path, n=10)
    data = bytearray(seg.read_bytes())
    start = sum(len(fmt.encode_record(r)) for r in recs(1, 4))  # frame of record 5
    if where == "payload":
        data[start + 12] ^= 0x01
    else:
        data[start + 1] ^= 0x40  # a length that runs past the end of the file
    seg.write_bytes(bytes(data))
    with pytest.raises(StorageError) as info:
        open_dir(tmp_path)
    err = info.value
    assert err.path == str(seg) and err.offset == start
    assert f"{seg}: offset {start}:" in str(err)
    assert isinstance(err, QServerError)
    assert seg.read_bytes() == bytes(data)  # nothing was cut


def test_damage_in_an_older_segment_stops(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 40))
    storage.close()
    first = segment_files(tmp_path)[0]
    first.write_bytes(first.read_bytes()[:-2])
    with pytest.raises(StorageError, match="not the last") as info:
        open_dir(tmp_path)
    assert info.value.path == str(first)


def test_missing_segment_is_a_gap(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 40))
    storage.close()
    files = segment_files(tmp_path)
    assert len(files) >= 3
    files[1].unlink()
    with pytest.raises(StorageError, match="log gap") as info:
        open_dir(tmp_path)
    assert info.value.path == str(files[2])


def test_log_not_starting_at_one_without_snapshot(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 40))
    storage.close()
    segment_files(tmp_path)[0].unlink()
    with pytest.raises(StorageError, match="no snapshot covers"):
        open_dir(tmp_path)


def test_empty_last_segment_is_removed(tmp_path):
    write_log(tmp_path, n=5)
    (tmp_path / f"log-{6:020d}.seg").write_bytes(b"")
    storage, got = open_dir(tmp_path)
    assert got.records == recs(1, 5)
    storage.append(recs(6, 8))
    storage.close()
    assert open_dir(tmp_path)[1].records == recs(1, 8)


# -- segments and truncation --------------------------------------------------

def test_segments_roll_and_are_named_by_first_trans_id(tmp_path):
    storage, _ = open_dir(tmp_path)
    for t in range(1, 101):
        storage.append([rec(t)])
    storage.append(recs(101, 150))  # one call spanning several segments
    storage.close()  # trims the last segment's space allocated ahead
    files = segment_files(tmp_path)
    assert len(files) > 10
    for f in files:
        result = fmt.scan(f.read_bytes())
        assert result.problem is None
        assert f.name == f"log-{result.records[0].trans_id:020d}.seg"
        assert f.stat().st_size <= SMALL or len(result.records) == 1
    assert open_dir(tmp_path)[1].records == recs(1, 150)


@pytest.mark.parametrize("segment_bytes", [SMALL, 1 << 20])
def test_append_frames_writes_what_append_writes(tmp_path, segment_bytes):
    """The fast path's append of records it encoded itself: the same files,
    byte for byte, and the same frame offsets (a truncation uses them), in
    one segment or rolling through several."""
    plain, _ = open_dir(tmp_path / "plain", segment_bytes=segment_bytes)
    framed, _ = open_dir(tmp_path / "framed", segment_bytes=segment_bytes)
    single, _ = open_dir(tmp_path / "single", segment_bytes=segment_bytes)  # append_payload
    sizes = random.Random(7).choices([0, 1, 2, 5, 9, 30], k=40)
    t = 1
    for i, n in enumerate(sizes):
        batch = recs(t, t + n - 1)
        plain.append(batch)
        framed.append_frames([fmt.encode_record(r) for r in batch])
        for r in batch:
            single.append_payload(fmt.encode_payload(*r))
        t += n
        if i == 25:  # back into an earlier segment, then on
            for storage in (plain, framed, single):
                storage.truncate_after(t - 40)
            t -= 39
    assert single.next_trans_id == framed.next_trans_id == plain.next_trans_id == t
    for storage in (plain, framed, single):
        storage.close()
    files = segment_files(tmp_path / "plain")
    for other in ("framed", "single"):
        assert [f.name for f in files] == [f.name for f in segment_files(tmp_path / other)]
        for f in files:
            assert (tmp_path / other / f.name).read_bytes() == f.read_bytes()
        assert open_dir(tmp_path / other)[1].records == recs(1, t - 1)


def _record_writes(monkeypatch) -> list[int]:
    """os.pwrite, counting the writes of records (not of zeros ahead)."""
    real = os.pwrite
    counted: list[int] = []

    def pwrite(fd, data, offset):
        if any(bytes(data)):
            counted.append(len(data))
        return real(fd, data, offset)

    monkeypatch.setattr(disk_module.os, "pwrite", pwrite)
    return counted


@pytest.mark.parametrize("cut", [5, 64, 65, 1000, 1037, 39_990])
def test_records_copied_into_the_mapping_survive_a_crash_and_cuts(tmp_path, monkeypatch, cut):
    """40,000 one-record appends (more than PREALLOCATE_BYTES, so the
    mapping is made again as the zeros grow), with no write(2) of a record
    on Linux; a cut among them (marks every MARK_SPACING records only),
    more records, a crash without sync: recovery reads them all back."""
    counted = _record_writes(monkeypatch)
    storage, _ = open_dir(tmp_path, fsync="off", segment_bytes=8 << 20)
    payloads = [fmt.encode_payload(*rec(t)) for t in range(1, 40_001)]
    assert sum(map(len, payloads)) > PREALLOCATE_BYTES
    for payload in payloads:
        storage.append_payload(payload)
    if sys.platform == "linux":
        assert counted == []
    storage.truncate_after(cut)
    for r in recs(cut + 1, cut + 70, vote_id=2):
        storage.append_payload(fmt.encode_payload(*r))
    storage.abandon()  # no sync, no close: the page cache holds the copies
    _, got = open_dir(tmp_path, segment_bytes=8 << 20)
    assert got.records == recs(1, cut) + recs(cut + 1, cut + 70, vote_id=2)
    assert got.reports == []


def test_records_go_by_pwrite_where_no_mapping_can_be_made(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.ENODEV, "no mapping here")

    monkeypatch.setattr(disk_module.mmap, "mmap", refuse)
    counted = _record_writes(monkeypatch)
    storage, _ = open_dir(tmp_path, fsync="off")
    for r in recs(1, 40):
        storage.append_payload(fmt.encode_payload(*r))
    storage.append(recs(41, 60))
    assert len(counted) >= 41  # each append_payload, then at least one append
    storage.abandon()
    assert open_dir(tmp_path)[1].records == recs(1, 60)


def test_oversized_record_gets_a_segment_of_its_own(tmp_path):
    storage, _ = open_dir(tmp_path)
    big = Record(2, 1, Produce(targets=(("q", 2),), data="x" * 2000, ready_ms=1, ttl_ms=2,
                               retry_ms=0))
    storage.append([rec(1), big, rec(3)])
    storage.close()
    assert [f.name for f in segment_files(tmp_path)] == [
        f"log-{t:020d}.seg" for t in (1, 2, 3)]
    assert open_dir(tmp_path)[1].records == [rec(1), big, rec(3)]


@pytest.mark.parametrize("cut", [0, 1, 2, 7, 13, 40, 79, 80, 85])
def test_truncate_after_across_segments(tmp_path, cut):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 80))
    storage.truncate_after(cut)
    assert storage.next_trans_id == cut + 1 or cut >= 80
    kept = min(cut, 80)
    storage.append(recs(kept + 1, kept + 10, vote_id=2))
    storage.abandon()
    _, got = open_dir(tmp_path)
    assert got.records == recs(1, kept) + recs(kept + 1, kept + 10, vote_id=2)
    assert got.reports == []
    for f in segment_files(tmp_path):
        assert_only_records(f)


@pytest.mark.parametrize("cut", range(0, 31))
def test_truncate_inside_a_write_of_many_records(tmp_path, cut):
    """Writes of 1, 7, 12 and 10 records into one segment: a cut at every
    trans_id, at a write's first record, inside one, at its last; then
    appending, cutting again and reading back."""
    storage, _ = open_dir(tmp_path, segment_bytes=1 << 20)
    for first, last in ((1, 1), (2, 8), (9, 20), (21, 30)):
        storage.append_frames([fmt.encode_record(r) for r in recs(first, last)])
    storage.truncate_after(cut)
    assert storage.next_trans_id == cut + 1
    storage.append(recs(cut + 1, cut + 5, vote_id=2))
    storage.truncate_after(cut + 2)
    storage.append(recs(cut + 3, cut + 4, vote_id=3))
    storage.abandon()
    _, got = open_dir(tmp_path)
    assert got.records == (recs(1, cut) + recs(cut + 1, cut + 2, vote_id=2)
                           + recs(cut + 3, cut + 4, vote_id=3))
    assert got.reports == []
    for f in segment_files(tmp_path):
        assert_only_records(f)


def test_truncate_at_a_segment_boundary(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 80))
    files = segment_files(tmp_path)
    second_first = int(files[1].name[4:24])
    storage.truncate_after(second_first - 1)
    assert segment_files(tmp_path) == files[:1]
    storage.append(recs(second_first, second_first + 2, vote_id=3))
    storage.close()
    _, got = open_dir(tmp_path)
    assert got.records == recs(1, second_first - 1) + recs(second_first, second_first + 2, 3)


# -- snapshots ----------------------------------------------------------------

def test_snapshot_then_log_after_it(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 60))
    storage.write_snapshot(20, 1, state_for(20))
    storage.write_snapshot(45, 1, state_for(45))
    snaps = sorted(p.name for p in tmp_path.glob("snapshot-*"))
    assert snaps == [f"snapshot-{45:020d}.snap"]
    firsts = [int(f.name[4:24]) for f in segment_files(tmp_path)]
    assert firsts[0] <= 46 and (len(firsts) == 1 or firsts[1] > 46)  # covered ones removed
    storage.append(recs(61, 70))
    storage.close()
    storage, got = open_dir(tmp_path)
    assert got.snapshot == (45, 1, [["q", 45, [(45, "state at 45", 1, 2, 0, 0)]]])
    assert got.records == recs(46, 70)
    with pytest.raises(InvariantError):
        storage.truncate_after(44)
    storage.truncate_after(45)
    storage.append(recs(46, 47, vote_id=2))
    storage.close()
    _, got = open_dir(tmp_path)
    assert got.snapshot[0] == 45 and got.records == recs(46, 47, vote_id=2)


def test_snapshot_outside_the_log_is_our_bug(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 5))
    with pytest.raises(InvariantError):
        storage.write_snapshot(6, 1, [])
    storage.write_snapshot(5, 1, [])
    with pytest.raises(InvariantError):
        storage.write_snapshot(4, 1, [])


def test_leftover_temp_files_are_ignored_and_removed(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 10))
    storage.write_snapshot(5, 1, state_for(5))
    storage.close()
    half = b"".join(fmt.encode_snapshot_chunks(9, 1, state_for(9)))[:30]
    (tmp_path / f"snapshot-{9:020d}.snap.tmp").write_bytes(half)
    (tmp_path / "vote.tmp").write_bytes(b"xx")
    _, got = open_dir(tmp_path)
    assert got.snapshot[0] == 5 and got.records == recs(6, 10)
    assert sum("unfinished write" in r for r in got.reports) == 2
    assert not list(tmp_path.glob("*.tmp"))


def test_corrupt_newest_snapshot_falls_back_when_the_log_covers(tmp_path):
    storage, _ = open_dir(tmp_path, segment_bytes=1 << 20)  # one segment: nothing removed
    storage.append(recs(1, 30))
    storage.write_snapshot(10, 1, state_for(10))
    storage.close()
    old = (tmp_path / f"snapshot-{10:020d}.snap").read_bytes()
    storage, _ = open_dir(tmp_path, segment_bytes=1 << 20)
    storage.write_snapshot(20, 1, state_for(20))
    storage.close()
    (tmp_path / f"snapshot-{10:020d}.snap").write_bytes(old)  # as if removal never happened
    newest = tmp_path / f"snapshot-{20:020d}.snap"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    _, got = open_dir(tmp_path)
    assert got.snapshot[:2] == (10, 1)
    assert got.records == recs(11, 30)
    assert any(str(newest) in r and "corrupt snapshot" in r for r in got.reports)
    assert Path(str(newest) + ".corrupt").exists() and not newest.exists()


def test_corrupt_snapshot_that_nothing_covers_stops(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 60))
    storage.write_snapshot(50, 1, state_for(50))  # removes the segments before it
    storage.close()
    snap = tmp_path / f"snapshot-{50:020d}.snap"
    snap.write_bytes(snap.read_bytes()[:-1])
    with pytest.raises(StorageError, match="neither an older snapshot nor the log") as info:
        open_dir(tmp_path)
    assert info.value.path == str(snap)


def test_install_snapshot_restarts_the_log(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 30))
    storage.write_snapshot(10, 1, state_for(10))
    storage.install_snapshot(100, 4, state_for(100))
    assert segment_files(tmp_path) == []
    assert storage.next_trans_id == 101
    storage.append(recs(101, 105, vote_id=4))
    storage.close()
    _, got = open_dir(tmp_path)
    assert got.snapshot[:2] == (100, 4) and got.records == recs(101, 105, vote_id=4)
    assert [p.name for p in tmp_path.glob("snapshot-*")] == [f"snapshot-{100:020d}.snap"]


def test_install_snapshot_inside_a_diverged_log(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 30, vote_id=1))
    storage.install_snapshot(20, 2, state_for(20))  # our 20 was from vote 1
    storage.append(recs(21, 22, vote_id=2))
    storage.close()
    _, got = open_dir(tmp_path)
    assert got.snapshot[:2] == (20, 2) and got.records == recs(21, 22, vote_id=2)


@pytest.mark.parametrize("snap_at", [20, 100])
def test_crash_between_install_and_log_removal(tmp_path, snap_at):
    """The snapshot was renamed into place, the old log not yet removed."""
    storage, _ = open_dir(tmp_path)
    storage.append(recs(1, 30, vote_id=1))
    storage.close()
    blob = b"".join(fmt.encode_snapshot_chunks(snap_at, 2, state_for(snap_at)))
    (tmp_path / f"snapshot-{snap_at:020d}.snap").write_bytes(blob)
    storage, got = open_dir(tmp_path)
    assert got.snapshot[:2] == (snap_at, 2) and got.records == []
    assert got.reports and all("predates the snapshot" in r for r in got.reports)
    assert segment_files(tmp_path) == []
    storage.append(recs(snap_at + 1, snap_at + 3, vote_id=2))
    storage.close()
    assert open_dir(tmp_path)[1].records == recs(snap_at + 1, snap_at + 3, vote_id=2)


def test_log_lost_after_snapshot_point_is_fine(tmp_path):
    """A snapshot is durable at once; the log before it may not be (power
    loss with fsync=off): the snapshot covers what the log lost."""
    storage, _ = open_dir(tmp_path, segment_bytes=1 << 20)
    storage.append(recs(1, 30))
    storage.write_snapshot(25, 1, state_for(25))
    storage.abandon()
    seg = segment_files(tmp_path)[0]
    seg.write_bytes(seg.read_bytes()[:FRAME_END_9 + 4])
    storage, got = open_dir(tmp_path)
    assert got.snapshot[0] == 25 and got.records == []
    assert storage.next_trans_id == 26


# -- the vote -----------------------------------------------------------------

def test_vote_is_persisted_and_replaced_atomically(tmp_path):
    storage, _ = open_dir(tmp_path, fsync="off")
    storage.save_vote(3, 2)
    storage.save_vote(4, 1)
    storage.abandon()
    storage, got = open_dir(tmp_path)
    assert got.vote == (4, 1)
    # no temporary file left; the spare is kept ready for the next vote
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LOCK", "vote", "vote.spare"]
    storage.close()
    vote = tmp_path / "vote"
    vote.write_bytes(vote.read_bytes()[:-1] + b"\0")
    with pytest.raises(StorageError, match="vote unreadable") as info:
        open_dir(tmp_path)
    assert info.value.path == str(vote)


def test_closed_storage_refuses_work(tmp_path):
    storage, _ = open_dir(tmp_path)
    storage.close()
    with pytest.raises(StorageError):
        storage.append([rec(1)])


# -- random schedules with crashes ---------------------------------------------

class Model:
    """What the log must hold: `log[i]` is the record at trans_id i + 1 (None
    at or below an installed snapshot); `durable` trans_ids are on disk
    whatever happens; `snapshots[t]` is the state written at t."""

    def __init__(self) -> None:
        self.log: list[Record | None] = []
        self.durable = 0
        self.base = 0
        self.base_vote_id = 0  # vote_id of the entry at base
        self.vote_id = 1
        self.snapshots: dict[int, list] = {}


def power_loss(path: Path, model: Model, keep: float, garbage: bytes) -> None:
    """Drop what the spec lets a power loss drop: every segment but the last
    is durable, the last up to `model.durable`; of the rest, a fraction
    `keep` survives, then optional garbage."""
    files = segment_files(path)
    if not files:
        return
    last = files[-1]
    first = int(last.name[4:24])
    durable_bytes = sum(len(fmt.encode_record(r))
                        for r in model.log[first - 1:model.durable])
    data = last.read_bytes()
    assert durable_bytes <= len(data)
    cut = durable_bytes + int((len(data) - durable_bytes) * keep)
    if cut == 0 and keep < 0.5 and first > model.durable:
        last.unlink()  # a new file whose directory entry never made it
        return
    last.write_bytes(data[:cut] + (garbage if cut < len(data) else b""))


ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 12)),
    st.tuples(st.just("sync"), st.just(0)),
    st.tuples(st.just("truncate"), st.integers(0, 15)),
    st.tuples(st.just("snapshot"), st.integers(0, 15)),
    st.tuples(st.just("install"), st.integers(0, 20)),
    st.tuples(st.just("kill"), st.just(0)),
    st.tuples(st.just("power"), st.tuples(st.floats(0, 1), st.binary(max_size=12))),
), max_size=25)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops)
def test_random_schedules_recover_the_synced_prefix(tmp_path, schedule):
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        path = Path(d)
        model = Model()
        storage, _ = open_dir(path, fsync="batch", segment_bytes=300)

        def last() -> int:
            return len(model.log)

        for op, arg in schedule:
            if op == "append":
                new = [rec(t, model.vote_id, size=(t * 7) % 40) for t in
                       range(last() + 1, last() + arg + 1)]
                before = segment_files(path)
                storage.append(new)
                model.log += new
                files = segment_files(path)
                if files and files != before and files[-1] not in before:
                    # a roll fsyncs the segments before the new one
                    model.durable = max(model.durable, int(files[-1].name[4:24]) - 1)
            elif op == "sync":
                storage.sync()
                model.durable = last()
            elif op == "truncate":
                t = max(model.base, last() - arg)
                storage.truncate_after(t)
                if t < last():
                    del model.log[t:]
                    model.durable = t  # durable on return
                    model.vote_id += 1
            elif op == "snapshot":
                t = max(model.base, last() - arg)
                vote = model.log[t - 1].vote_id if t > model.base else model.base_vote_id
                storage.write_snapshot(t, vote, state_for(t))
                model.snapshots = {t: state_for(t)}
                model.base, model.base_vote_id = t, vote
            elif op == "install":
                t = model.base + arg
                model.vote_id += 1
                storage.install_snapshot(t, model.vote_id, state_for(t))
                model.log = model.log[:min(t, last())] + [None] * (t - last())
                model.snapshots = {t: state_for(t)}
                model.base = model.durable = t
                model.base_vote_id = model.vote_id
            else:
                storage.abandon()
                if op == "power":
                    power_loss(path, model, *arg)
                storage, got = open_dir(path, fsync="batch", segment_bytes=300)
                snap_t = got.snapshot[0] if got.snapshot else 0
                assert snap_t == model.base
                if snap_t:
                    assert [[q, m, [list(x) for x in msgs]] for q, m, msgs in got.snapshot[2]] \
                        == model.snapshots[snap_t]
                recovered_last = snap_t + len(got.records)
                assert model.durable <= recovered_last <= last()
                assert got.records == model.log[snap_t:recovered_last]
                if op == "kill":
                    assert recovered_last == last() and got.reports == []
                event(f"{op}: {'lost records' if recovered_last < last() else 'kept all'}, "
                      f"{'with' if got.reports else 'no'} reports")
                del model.log[recovered_last:]
                model.durable = recovered_last  # recover() fsyncs what it keeps
                assert storage.next_trans_id == recovered_last + 1
        storage.close()
        storage, got = open_dir(path)
        assert (got.snapshot[0] if got.snapshot else 0) == model.base
        assert got.records == model.log[model.base:]
        storage.close()


def test_a_page_that_never_reached_the_disk_is_a_torn_tail(tmp_path):
    """Records written over the zeros ahead reach the disk page by page, in
    any order, until a sync; after a power loss a page of zeros can lie
    between records that did. Everything from the first damaged record on
    came after the last sync: it is cut and reported, not taken for
    corruption."""
    storage, _ = open_dir(tmp_path, segment_bytes=1 << 20)
    storage.append(recs(1, 10))
    storage.sync()
    storage.append(recs(11, 800))  # several pages, never synced
    storage.abandon()
    seg = segment_files(tmp_path)[-1]
    data = bytearray(seg.read_bytes())
    synced = sum(len(fmt.encode_record(r)) for r in recs(1, 10))
    page = (synced // 4096 + 1) * 4096  # the first page after the synced records
    data[page:page + 4096] = bytes(4096)  # it never arrived; later pages did
    seg.write_bytes(bytes(data))
    storage, got = open_dir(tmp_path, segment_bytes=1 << 20)
    kept = len(got.records)
    assert 10 <= kept < 800 and got.records == recs(1, kept)
    assert len(got.reports) == 1 and "out of order" in got.reports[0]
    storage.append(recs(kept + 1, kept + 3, vote_id=2))  # the log goes on after the cut
    storage.close()
    _, got = open_dir(tmp_path, segment_bytes=1 << 20)
    assert got.records == recs(1, kept) + recs(kept + 1, kept + 3, vote_id=2)


def test_a_page_of_zeros_before_records_in_an_older_segment_is_corruption(tmp_path):
    storage, _ = open_dir(tmp_path, segment_bytes=8192)
    storage.append(recs(1, 400))
    storage.close()
    first = segment_files(tmp_path)[0]
    data = bytearray(first.read_bytes())
    assert len(data) > 4096 + 1024
    data[4096:4096 + 512] = bytes(512)  # older segments were synced whole when the log rolled
    first.write_bytes(bytes(data))
    with pytest.raises(StorageError, match="before valid records"):
        open_dir(tmp_path, segment_bytes=8192)


def test_temporary_directories_of_killed_nodes_are_removed_and_others_kept(tmp_path):
    """A node without storage keeps its raft dump or snapshot files in a
    private temporary directory, locked while its process lives; one killed
    never removes it. The next such node's start removes those whose lock
    can be taken, and nothing else."""
    from qserver.storage import disk

    def made(name: str, lock: bool = True) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "raft.dump").write_bytes(b"state")
        if lock:
            (tmp_path / name / ".owner.lock").touch()

    made("qserver-raft-4242-ab12cd")  # its owner was killed: nobody holds the lock
    made("qserver-snap-4343-qr90st")
    made("qserver-snap-4444-uv12wx")  # its owner lives (the child below holds the lock)
    made("qserver-raft-4545-yz34ab", lock=False)  # being made: no lock file yet
    made("qserver-raft-mn78op")  # an older release's name
    made("something-else")
    hold = ("import fcntl, os, sys, time; "
            "fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path / "qserver-snap-4444-uv12wx" / ".owner.lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        removed = disk.remove_stale_tmp_dirs(str(tmp_path))
        assert sorted(removed) == [str(tmp_path / "qserver-raft-4242-ab12cd"),
                                   str(tmp_path / "qserver-snap-4343-qr90st")]
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "qserver-raft-4545-yz34ab", "qserver-raft-mn78op", "qserver-snap-4444-uv12wx",
            "something-else"]
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()  # type: ignore[union-attr]
    # this process's own directory stays while it holds it, and goes with it
    mine = disk.private_tmp_dir("test")
    try:
        assert os.path.basename(mine).startswith(f"qserver-test-{os.getpid()}-")
        assert mine not in disk.remove_stale_tmp_dirs(os.path.dirname(mine))
        assert os.path.isdir(mine)
    finally:
        disk.remove_private_tmp_dir(mine)
    assert not os.path.exists(mine)
