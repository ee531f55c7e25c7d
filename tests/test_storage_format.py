"""The storage byte formats (qserver.storage.format): record frames, scan,
snapshots and the vote. No files here; see test_storage_disk.py."""

from __future__ import annotations

import struct
import zlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qserver.state.entries import Confirm, Consume, Noop, Produce, Record
from qserver.state.store import Store
from qserver.storage import format as fmt
from qserver.wire.requests import ProduceRequest
from test_core_purity import CORE
from test_entries import records as any_records


def make_records(n: int, start: int = 1, vote_id: int = 1) -> list[Record]:
    entries = [
        Produce(targets=(("q", 1),), data="hello", ready_ms=5, ttl_ms=9, retry_ms=0),
        Consume(queue="q", msg_id=1, retry_at_ms=77),
        Confirm(queue="q", msg_id=1),
        Noop(),
        Produce(targets=(("a", 3), ("b", 4)), data="é" * 40, ready_ms=1, ttl_ms=2, retry_ms=3),
    ]
    return [Record(start + i, vote_id, entries[i % len(entries)]) for i in range(n)]


def test_format_module_is_checked_as_core():
    # Its docstring says it does no I/O, so test_core_purity checks that.
    assert "qserver.storage.format" in CORE


# -- record frames ------------------------------------------------------------

def test_frame_layout():
    record = make_records(1)[0]
    frame = fmt.encode_record(record)
    length, crc = struct.unpack(">II", frame[:8])
    payload = frame[8:]
    assert length == len(payload)
    assert crc == zlib.crc32(payload)
    assert payload[:1] == b"\x93"  # resync relies on it
    assert msgpack.unpackb(payload)[0] == 1


def test_scan_round_trip_whole_and_with_base_offset():
    records = make_records(12, start=40)
    buf = fmt.encode_records(records)
    result = fmt.scan(buf, base_offset=1000, first_trans_id=40)
    assert result.records == records
    assert result.good_end_offset == 1000 + len(buf)
    assert result.problem is None


def test_scan_every_cut_point_is_torn_and_keeps_whole_frames():
    records = make_records(4)
    frames = [fmt.encode_record(r) for r in records]
    buf = b"".join(frames)
    ends = [sum(len(f) for f in frames[:i]) for i in range(len(frames) + 1)]
    for cut in range(len(buf) + 1):
        result = fmt.scan(buf[:cut])
        whole = max(i for i, e in enumerate(ends) if e <= cut)
        assert result.records == records[:whole]
        assert result.good_end_offset == ends[whole]
        if cut == ends[whole]:
            assert result.problem is None
        else:
            assert result.problem.kind == "torn"
            assert result.problem.offset == ends[whole]


def test_scan_flipped_byte_is_corrupt_at_its_frame():
    records = make_records(5)
    frames = [fmt.encode_record(r) for r in records]
    buf = bytearray(b"".join(frames))
    start = len(frames[0]) + len(frames[1])
    buf[start + 8 + 3] ^= 0x40  # inside the third payload
    result = fmt.scan(bytes(buf))
    assert result.records == records[:2]
    assert result.problem == fmt.Problem("corrupt", start, "crc mismatch")


def test_scan_length_over_bound_is_corrupt():
    buf = struct.pack(">II", fmt.MAX_RECORD_BYTES + 1, 0) + b"x" * 20
    result = fmt.scan(buf)
    assert result.problem.kind == "corrupt"
    assert "MAX_RECORD_BYTES" in result.problem.reason


def test_scan_zero_frame_is_corrupt():
    # A zero-filled tail (what a crash can leave) has a valid crc for an
    # empty payload; it must still not pass.
    result = fmt.scan(fmt.encode_record(make_records(1)[0]) + bytes(32))
    assert len(result.records) == 1
    assert result.problem.kind == "corrupt"


def test_scan_undecodable_payload_with_good_crc_is_corrupt():
    payload = msgpack.packb([1, 1, [99]])  # an unknown entry kind
    buf = struct.pack(">II", len(payload), zlib.crc32(payload)) + payload
    result = fmt.scan(buf)
    assert result.problem.kind == "corrupt"
    assert "not a record" in result.problem.reason


def test_scan_trans_id_gap_is_corrupt():
    records = make_records(3)
    buf = fmt.encode_records([records[0], records[2]])
    result = fmt.scan(buf)
    assert result.records == [records[0]]
    assert result.problem.kind == "corrupt"
    assert "trans_id 3 where 2 was due" in result.problem.reason
    assert fmt.scan(fmt.encode_records(records), first_trans_id=2).problem.offset == 0


def test_encode_record_refuses_what_it_could_not_read_back(monkeypatch):
    monkeypatch.setattr(fmt, "MAX_RECORD_BYTES", 10)
    with pytest.raises(ValueError):
        fmt.encode_record(make_records(1)[0])
    with pytest.raises(ValueError):
        fmt.encode_payload(*make_records(1)[0])


@given(any_records)
def test_a_record_of_any_kind_is_encoded_as_record_to_wire_says(record):
    """encode_payload (the fast path's encoder, whose frame header
    DiskStorage.append_payload writes in place) gives record_to_wire's
    bytes for every kind of entry, and encode_record frames exactly them."""
    from qserver.state.entries import record_to_wire

    payload = msgpack.packb(record_to_wire(record))
    assert fmt.encode_payload(*record) == payload
    frame = struct.pack(">II", len(payload), zlib.crc32(payload)) + payload
    assert fmt.encode_record(record) == frame
    assert fmt.FRAME_HEADER.pack(len(payload), zlib.crc32(payload)) == frame[:8]
    assert fmt.scan(frame).records == [record]


def test_resync_finds_the_next_valid_frame_only():
    records = make_records(4)
    frames = [fmt.encode_record(r) for r in records]
    buf = bytearray(b"".join(frames))
    buf[8 + 2] ^= 1  # corrupt the first payload
    assert fmt.resync(bytes(buf), 1) == len(frames[0])
    assert fmt.resync(bytes(buf), 1, after_trans_id=4) is None  # none beyond 4
    assert fmt.resync(b"\x93" * 100 + bytes(50), 0) is None
    assert fmt.resync(bytes(buf[:len(frames[0]) + 5]), 1) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_scan_any_bytes_gives_records_or_a_problem(junk):
    good = fmt.encode_records(make_records(2))
    for buf in (junk, good + junk):
        result = fmt.scan(buf)
        assert (result.problem is None) == (result.good_end_offset == len(buf))
        if result.problem is not None:
            assert result.problem.kind in ("torn", "corrupt")
            assert result.problem.offset == result.good_end_offset
        fmt.resync(buf, 0)  # never raises


def test_frame_offsets():
    frames = [fmt.encode_record(r) for r in make_records(5)]
    buf = b"".join(frames)
    starts = [sum(len(f) for f in frames[:i]) for i in range(5)]
    assert fmt.frame_offsets(buf) == starts
    assert fmt.frame_offsets(buf, limit=2) == starts[:2]
    assert fmt.frame_offsets(buf[:-1]) == starts[:4]


# -- snapshots ----------------------------------------------------------------

def small_store() -> Store:
    store = Store(queue_size=1000)
    for i in range(30):
        req = ProduceRequest(queue=f"q{i % 3}", data=f"m{i}" * (i + 1), delay_s=None,
                             ttl_s=None, retry_s=float(i % 2))
        store.apply(store.decide_produce(req, 1_700_000_000_000 + i))
    store.apply(Consume(queue="q1", msg_id=1, retry_at_ms=1_800_000_000_000))
    return store


def reload(state) -> list:
    store = Store(queue_size=1000)
    store.load_wire(state)
    store._check()
    return store.to_wire()


@pytest.mark.parametrize("source", ["to_wire", "iter"])
def test_snapshot_round_trip(source):
    store = small_store()
    state = store.to_wire() if source == "to_wire" else fmt.store_wire_iter(store)
    pieces = list(fmt.encode_snapshot_chunks(17, 3, state))
    blob = b"".join(pieces)
    trans_id, vote_id, decoded = fmt.decode_snapshot(blob)
    assert (trans_id, vote_id) == (17, 3)
    assert reload(decoded) == store.to_wire()
    # the same bytes in other pieces: as produced, one byte at a time, odd blocks
    for chunks in (pieces, [blob[i:i + 1] for i in range(len(blob))],
                   [blob[i:i + 7] for i in range(0, len(blob), 7)]):
        assert reload(fmt.decode_snapshot(iter(chunks))[2]) == store.to_wire()


def test_snapshot_of_an_unknown_version_is_refused():
    blob = bytearray(b"".join(fmt.encode_snapshot_chunks(1, 1, small_store().to_wire())))
    assert blob[4] == 3
    for version in (0, 4, 255):
        blob[4] = version
        with pytest.raises(ValueError, match=f"version {version} unknown"):
            fmt.decode_snapshot(bytes(blob))


def test_snapshot_of_empty_state():
    blob = b"".join(fmt.encode_snapshot_chunks(0, 0, []))
    assert fmt.decode_snapshot(blob) == (0, 0, [])


def test_snapshot_large_queue_is_chunked():
    msgs = [(i, "x" * 100, 1, 2, 0, 0) for i in range(1, 20_001)]
    pieces = list(fmt.encode_snapshot_chunks(5, 1, [("big", 20_000, iter(msgs))]))
    assert len(pieces) > 2
    assert max(len(p) for p in pieces) < 2 * 1024 * 1024
    _, _, state = fmt.decode_snapshot(pieces)
    assert state == [["big", 20_000, msgs]]


def test_snapshot_every_truncation_and_flipped_byte_is_refused():
    blob = b"".join(fmt.encode_snapshot_chunks(9, 2, small_store().to_wire()))
    for cut in range(0, len(blob), 97):
        with pytest.raises(ValueError):
            fmt.decode_snapshot(blob[:cut])
    with pytest.raises(ValueError):
        fmt.decode_snapshot(blob[:-1])
    for i in range(0, len(blob), 89):
        bad = bytearray(blob)
        bad[i] ^= 0x10
        with pytest.raises(ValueError):
            fmt.decode_snapshot(bytes(bad))
    with pytest.raises(ValueError, match="after the snapshot"):
        fmt.decode_snapshot(blob + b"\0")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_snapshot_any_bytes_decode_or_value_error(junk):
    headers = [struct.pack(">4sBQQ", b"QSNP", version, 1, 1) for version in (1, 2)]
    for buf in (junk, headers[0] + junk, headers[1] + junk):
        try:
            fmt.decode_snapshot(buf)
        except ValueError:
            pass


# -- the vote -----------------------------------------------------------------

def test_vote_round_trip_and_damage():
    blob = fmt.encode_vote(7, 3)
    assert fmt.decode_vote(blob) == (7, 3)
    assert fmt.decode_vote(fmt.encode_vote(0, 0)) == (0, 0)
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 1
        with pytest.raises(ValueError):
            fmt.decode_vote(bytes(bad))
    with pytest.raises(ValueError):
        fmt.decode_vote(blob[:-1])


@settings(max_examples=300, deadline=None)
@given(trans_id=st.integers(1, 2**63 - 1), vote_id=st.integers(0, 2**63 - 1),
       targets=st.lists(st.tuples(st.text(min_size=1, max_size=20), st.integers(1, 2**63 - 1)),
                        min_size=1, max_size=4, unique_by=lambda t: t[0]),
       data=st.text(max_size=300), times=st.tuples(st.integers(0, 2**62), st.integers(0, 2**62),
                                                   st.integers(0, 2**40)))
def test_a_produce_record_is_encoded_as_record_to_wire_says(trans_id, vote_id, targets, data,
                                                            times):
    """encode_record builds a produce's list itself (its hot path): the
    bytes must be exactly record_to_wire's, and read back the same."""
    from qserver.state.entries import record_to_wire

    record = Record(trans_id, vote_id, Produce(targets=tuple(targets), data=data,
                                               ready_ms=times[0], ttl_ms=times[1],
                                               retry_ms=times[2]))
    payload = msgpack.packb(record_to_wire(record))
    frame = struct.pack(">II", len(payload), zlib.crc32(payload)) + payload
    assert fmt.encode_record(record) == frame
    assert fmt.scan(frame).records == [record]
