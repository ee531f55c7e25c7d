"""The byte formats of a node's storage: log record frames, snapshots, the vote.

Theory of operation
-------------------
Nothing here touches a file: every function takes and returns bytes (or an
iterable of bytes), so that the formats can be tested, fuzzed and reasoned
about apart from the disk. `qserver.storage.disk` does the I/O and decides
what a problem found here means (a torn tail to cut, or corruption that stops
the node).

Record frame (the log, `encode_record` / `scan`; `encode_payload` gives the
payload alone, for a writer that packs the header, FRAME_HEADER, in place)::

    [u32 length][u32 crc32 of payload][payload = msgpack(record_to_wire(record))]

big-endian. A segment file is a run of frames with consecutive trans_ids.
`scan` walks a buffer of frames and stops at the first problem:

- "torn": the buffer ends inside a frame (header or payload incomplete), what
  a crash in the middle of a write leaves;
- "corrupt": a complete frame whose crc does not match, whose payload is not
  a record, whose length is over `MAX_RECORD_BYTES` (no record we write is
  that long, so waiting for more bytes would be wrong), or whose trans_id
  does not follow the previous one.

`resync` looks for a valid frame after a problem: the disk layer cuts a
problem off as a torn tail only when nothing valid follows it.

Snapshot (`encode_snapshot_chunks` / `decode_snapshot`)::

    header  [4s magic "QSNP"][u8 version][u64 trans_id][u64 vote_id]
    chunks  [u32 length][msgpack payload], each one of
              [0, name, max_id]                  a queue begins
              [0, name, max_id, extras]          ...with settings and counters
                                                 (`Queue.extras()`, version 2)
              [1, [[msg_id, data, ready_ms, ttl_ms, retry_ms, retry_at_ms], ...]]
                                                 messages of that queue; one
                                                 delivered before has 4 more
                                                 fields, a dead letter 7
                                                 (store.py: Message; version 2)
              [2, n_queues, n_messages]          the end, with the counts
    trailer [u32 crc32 of every byte before it]

Version 1 (before receipts and queue settings) is read as well; version 2
is written.

The counts are in the end chunk rather than in the header so that a snapshot
can be encoded from a generator over the store, without first building its
whole wire form (a million messages would otherwise be one giant list).
trans_id is the last entry the state covers and vote_id that entry's vote_id
(what `Log.base_trans_id` / `base_vote_id` become on load).

Vote (`encode_vote` / `decode_vote`)::

    [4s magic "QVOT"][u8 version][u64 vote_id][u64 voted_for][u32 crc32 of the rest]

Rules
- Decoders raise `ValueError` on anything malformed (as `entry_from_wire`
  does) and never return half a value; `scan` reports problems as values.
- Every length read from bytes is checked against a named bound before
  anything is allocated for it.

This module does no I/O.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack

from ..state.entries import (
    PRODUCE_WIRE_HEAD,
    Confirm,
    Consume,
    Entry,
    Noop,
    Produce,
    Record,
    entry_to_wire,
    record_from_wire,
    record_to_wire,
)

if TYPE_CHECKING:
    from ..state.store import Store

__all__ = [
    "MAX_RECORD_BYTES",
    "MAX_SNAPSHOT_CHUNK_BYTES",
    "FRAME_HEADER",
    "FRAME_HEADER_BYTES",
    "Problem",
    "ScanResult",
    "encode_payload",
    "encode_record",
    "framed",
    "encode_records",
    "record_size_bound",
    "scan",
    "resync",
    "frame_offsets",
    "encode_snapshot_chunks",
    "decode_snapshot",
    "store_wire_iter",
    "encode_vote",
    "decode_vote",
    "VOTE_BYTES",
]

# A record holds one entry, and the largest entry carries one request's data
# (config.MAX_REQUEST_SIZE, 64 MiB). Twice that leaves room for the encoding;
# a length above it cannot be a record we wrote, so it is corruption, not a
# record whose end has yet to arrive.
MAX_RECORD_BYTES = 128 * 1024 * 1024

# A frame's header: the payload's length and its crc32 (zlib.crc32).
FRAME_HEADER = _FRAME = struct.Struct(">II")
FRAME_HEADER_BYTES = _FRAME.size

# record_to_wire gives a 3-element list, which msgpack encodes as a fixarray:
# every payload starts with this byte. `resync` looks for it.
_RECORD_FIRST_BYTE = b"\x93"

_UNPACK_ERRORS = (ValueError, TypeError, msgpack.UnpackException, RecursionError)


class Problem(NamedTuple):
    """The first frame `scan` could not accept."""

    kind: str  # "torn" (the buffer ends inside it) or "corrupt"
    offset: int  # where the frame starts (absolute: base_offset counted)
    reason: str


class ScanResult(NamedTuple):
    records: list[Record]  # every valid record before the problem, in order (above keep_after)
    good_end_offset: int  # end of the last valid frame (absolute)
    problem: Problem | None  # None: the buffer held whole, valid frames only
    last_trans_id: int | None = None  # of the last valid record, kept or not (None: none)
    vote_at_keep_after: int | None = None  # vote_id of the record at keep_after, if seen


# -- log records ------------------------------------------------------------

# One Packer for every record (msgpack.packb builds one per call); the event
# loop's thread is the only one that encodes records.
_pack = msgpack.Packer().pack


def encode_payload(trans_id: int, vote_id: int, entry: Entry) -> bytes:
    """The payload of the frame `encode_record` makes for the record
    (trans_id, vote_id, entry): for a writer that puts the frame's header
    beside it (DiskStorage.append_payload) instead of joining the two.
    Raises ValueError if it is over MAX_RECORD_BYTES (it could never be
    read back)."""
    if type(entry) is Produce:
        # record_to_wire's list, built here for the most common entry (its
        # fields in order, unpacked: targets, data, ready_ms, ttl_ms,
        # retry_ms): msgpack writes the tuples of `targets` as the arrays
        # that record_to_wire's lists are (the same bytes; a test holds it).
        payload: bytes = _pack((trans_id, vote_id, PRODUCE_WIRE_HEAD + entry))
    else:
        payload = _pack(record_to_wire(Record(trans_id, vote_id, entry)))
    if len(payload) > MAX_RECORD_BYTES:
        raise ValueError(f"record {trans_id} is {len(payload)} bytes, "
                         f"over MAX_RECORD_BYTES ({MAX_RECORD_BYTES})")
    return payload


def framed(payload: bytes) -> bytes:
    """The frame that holds `payload`: its header, then the payload."""
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def encode_record(record: Record) -> bytes:
    """One record as a frame. Raises ValueError if it is over MAX_RECORD_BYTES
    (it could never be read back)."""
    return framed(encode_payload(*record))


# record_size_bound: a frame header, the record's 3-element list header, and
# trans_id and vote_id as msgpack uint64 at most (9 bytes each).
_RECORD_OVERHEAD = FRAME_HEADER_BYTES + 1 + 9 + 9
_INT = 9  # the most bytes msgpack spends on an int below 2**64


def _str_bound(text: str) -> int:
    """The most bytes msgpack spends on `text`: a str32 header and 4 bytes
    per code point, or 1 for ASCII (str.isascii() is O(1) in CPython)."""
    return 5 + (len(text) if text.isascii() else 4 * len(text))


def record_size_bound(entry: Entry) -> int:
    """An upper bound on the bytes `encode_record` writes for a record that
    holds `entry`, whatever its trans_id and vote_id: what the node reserves
    on disk before it accepts a write (see storage.disk, "A full disk").
    O(1) for a plain queue (O(k) for k real queues)."""
    if type(entry) is Produce:
        size = _RECORD_OVERHEAD + 1 + 1 + 5 + _str_bound(entry.data) + 3 * _INT
        for name, _msg_id in entry.targets:
            size += 1 + _str_bound(name) + _INT
        return size
    if type(entry) is Consume:
        # msg_id, retry_at_ms, epoch, final
        return _RECORD_OVERHEAD + 1 + 1 + _str_bound(entry.queue) + 4 * _INT
    if type(entry) is Confirm:
        return _RECORD_OVERHEAD + 1 + 1 + _str_bound(entry.queue) + _INT
    if type(entry) is Noop:
        return _RECORD_OVERHEAD + 1 + 1
    # The rarer kinds: their exact size, plus the room for any trans_id and
    # vote_id that _RECORD_OVERHEAD stands for.
    return _RECORD_OVERHEAD + len(msgpack.packb(entry_to_wire(entry)))


def encode_records(records: Iterable[Record]) -> bytes:
    """Several records as consecutive frames."""
    return b"".join([encode_record(r) for r in records])


def _decode_payload(payload: Any) -> Record | str:
    """A record, or why the payload is not one."""
    try:
        return record_from_wire(msgpack.unpackb(payload))
    except _UNPACK_ERRORS as exc:
        return f"payload is not a record: {exc}"


def scan(buf: bytes | bytearray | memoryview, base_offset: int = 0, *,
         first_trans_id: int | None = None, keep_after: int | None = None) -> ScanResult:
    """Decode the frames in `buf`, stopping at the first problem.

    Args:
        buf: frames, e.g. a segment file's content.
        base_offset: the file offset of buf[0]; offsets in the result count it.
        first_trans_id: the trans_id the first record must have (a segment's
            name); None accepts any. Later records must follow one by one.
        keep_after: records at or below this trans_id are checked like the
            others but not returned (recovery: what a snapshot covers; their
            memory is reused at once instead of held until the whole log is
            read). None keeps all.
    Returns:
        ScanResult; `problem` is None when the whole buffer was valid. The
        records returned share equal queue names and times between
        neighbours (as the store's produces do), so that a long recovered
        log holds one string per queue, not one per record.
    Cost: O(len(buf)).
    """
    view = memoryview(buf)
    size = len(view)
    unpack_from = _FRAME.unpack_from
    records: list[Record] = []
    expect = first_trans_id
    last_id: int | None = None
    vote_at: int | None = None
    keep_from = -1 if keep_after is None else keep_after
    share = _Sharer()
    pos = 0

    def stop(kind: str, reason: str) -> ScanResult:
        return ScanResult(records, base_offset + pos, Problem(kind, base_offset + pos, reason),
                          last_id, vote_at)

    while pos < size:
        if size - pos < FRAME_HEADER_BYTES:
            return stop("torn", f"incomplete frame header ({size - pos} of "
                                f"{FRAME_HEADER_BYTES} bytes)")
        length, crc = unpack_from(view, pos)
        if length > MAX_RECORD_BYTES:
            return stop("corrupt", f"frame length {length} over MAX_RECORD_BYTES")
        end = pos + FRAME_HEADER_BYTES + length
        if end > size:
            return stop("torn", f"incomplete frame payload ({size - pos - FRAME_HEADER_BYTES}"
                                f" of {length} bytes)")
        payload = view[pos + FRAME_HEADER_BYTES:end]
        if zlib.crc32(payload) != crc:
            return stop("corrupt", "crc mismatch")
        record = _decode_payload(payload)
        if isinstance(record, str):
            return stop("corrupt", record)
        trans_id = record.trans_id
        if expect is not None and trans_id != expect:
            return stop("corrupt", f"trans_id {trans_id} where {expect} was due")
        expect = trans_id + 1
        last_id = trans_id
        if trans_id > keep_from:
            records.append(share(record))
        elif trans_id == keep_from:
            vote_at = record.vote_id
        pos = end
    return ScanResult(records, base_offset + pos, None, last_id, vote_at)


class _Sharer:
    """Makes decoded produce records share what neighbours have in common:
    the queue name (one string per queue instead of one per record) and the
    (ready_ms, ttl_ms) pair, as `Store._apply_produce` does for the
    messages. About 100 bytes less per record held, e.g. for the records a
    recovered cluster node keeps in its in-memory log. Other kinds pass
    unchanged."""

    __slots__ = ("names", "times")

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self.times: tuple[int, int] = (-1, -1)

    def __call__(self, record: Record) -> Record:
        entry = record[2]
        if type(entry) is not Produce or len(entry[0]) != 1:
            return record
        ((name, msg_id),), data, ready_ms, ttl_ms, retry_ms = entry
        name = self.names.setdefault(name, name)
        times = self.times
        if ready_ms == times[0] and ttl_ms == times[1]:
            ready_ms, ttl_ms = times
        else:
            self.times = (ready_ms, ttl_ms)
        entry = _new(Produce, (((name, msg_id),), data, ready_ms, ttl_ms, retry_ms))
        return _new(Record, (record[0], record[1], entry))


_new = tuple.__new__


def resync(buf: bytes | bytearray | memoryview, start: int, *,
           after_trans_id: int = 0) -> int | None:
    """The offset of the first complete, valid frame at or after `start`
    whose record's trans_id is over `after_trans_id`, or None.

    Used after a problem: a valid later record means the problem is not a
    torn tail but corruption in the middle of the log. Candidates are found by
    the first byte every record payload has, so the cost is O(len(buf)) in C
    plus one header check per candidate.
    """
    if isinstance(buf, memoryview):
        buf = buf.tobytes()
    find = buf.find
    view = memoryview(buf)
    size = len(view)
    unpack_from = _FRAME.unpack_from
    p = start + FRAME_HEADER_BYTES  # a payload starts after a header
    while True:
        p = find(_RECORD_FIRST_BYTE, p)
        if p < 0:
            return None
        h = p - FRAME_HEADER_BYTES
        length, crc = unpack_from(view, h)
        if 0 < length <= MAX_RECORD_BYTES and p + length <= size \
                and zlib.crc32(view[p:p + length]) == crc:
            record = _decode_payload(view[p:p + length])
            if not isinstance(record, str) and record.trans_id > after_trans_id:
                return h
        p += 1


def frame_offsets(buf: bytes | bytearray | memoryview, limit: int | None = None) -> list[int]:
    """Start offsets of the complete frames in `buf` (at most `limit`),
    reading headers only: for buffers `scan` has already accepted.
    Cost: O(number of frames)."""
    view = memoryview(buf)
    size = len(view)
    unpack_from = _FRAME.unpack_from
    out: list[int] = []
    pos = 0
    while pos + FRAME_HEADER_BYTES <= size and (limit is None or len(out) < limit):
        length, _crc = unpack_from(view, pos)
        end = pos + FRAME_HEADER_BYTES + length
        if end > size:
            break
        out.append(pos)
        pos = end
    return out


# -- snapshots --------------------------------------------------------------

_SNAP_MAGIC = b"QSNP"
_SNAP_VERSION = 3
_SNAP_VERSIONS = (1, 2, 3)  # what decode_snapshot reads
# The lengths of a message row: 1 + a message tuple's (store.py, Message),
# and from version 3, + 1 for a prioritized message's priority.
_ROW_LENGTHS = (6, 10, 13)
_ROW_LENGTHS_V3 = (6, 7, 10, 11, 13, 14)
_SNAP_HEADER = struct.Struct(">4sBQQ")  # magic, version, trans_id, vote_id
_U32 = struct.Struct(">I")
_QUEUE, _MESSAGES, _END = 0, 1, 2

# A message chunk is closed once it holds this many messages or about this
# many bytes of data: small enough that neither side ever holds more than a
# few MiB of one chunk, large enough that per-chunk costs vanish.
_CHUNK_MESSAGES = 4096
_CHUNK_DATA_BYTES = 1024 * 1024
# Chunks are handed out grouped in pieces of about this size (one write each).
_PIECE_BYTES = 1024 * 1024
# A chunk holds at least one message, and a message at most one request's
# data: the same bound as a record. Anything longer is corruption.
MAX_SNAPSHOT_CHUNK_BYTES = MAX_RECORD_BYTES


def store_wire_iter(
        store: Store) -> Iterator[tuple[str, int, Iterator[tuple[Any, ...]], dict[str, Any]]]:
    """The state of a `Store` in `Store.to_wire()`'s order and shape, lazily:
    (name, max_id, messages, extras) per queue, messages as (msg_id,
    *message) tuples.

    Feeding this to `encode_snapshot_chunks` never builds the whole wire form.
    The store must not change until the iteration ends (the disk layer
    consumes it within one call). Cost: O(n log n) for the sorts, O(n) ids
    held at a time for the largest queue.
    """
    return store.wire_items()


def encode_snapshot_chunks(trans_id: int, vote_id: int,
                           state: Iterable[Any]) -> Iterator[bytes]:
    """Encode a snapshot as a series of byte pieces (about 1 MiB each).

    Args:
        trans_id: the last entry the state covers; vote_id: that entry's.
        state: `Store.to_wire()`, or anything iterable in its shape
            ((name, max_id, messages[, extras]) with messages as rows of
            _ROW_LENGTHS), such as `store_wire_iter(store)`.
    Yields: bytes whose concatenation is the snapshot.
    Raises: TypeError if the state holds something msgpack cannot encode.
    """
    if trans_id < 0 or vote_id < 0:
        raise ValueError("trans_id and vote_id must be non-negative")
    pack = msgpack.Packer().pack
    u32 = _U32.pack
    crc = 0
    pending: list[bytes] = [_SNAP_HEADER.pack(_SNAP_MAGIC, _SNAP_VERSION, trans_id, vote_id)]
    pending_bytes = len(pending[0])
    n_queues = n_messages = 0

    for item in state:
        name, max_id, messages = item[0], item[1], item[2]
        extras = item[3] if len(item) > 3 else None
        payload = pack((_QUEUE, name, max_id, extras) if extras else (_QUEUE, name, max_id))
        pending.append(u32(len(payload)))
        pending.append(payload)
        pending_bytes += 4 + len(payload)
        n_queues += 1
        batch: list[Any] = []
        batch_bytes = 0
        for message in messages:
            batch.append(message)
            batch_bytes += len(message[1]) + 48  # data plus ~ the numbers
            if len(batch) >= _CHUNK_MESSAGES or batch_bytes >= _CHUNK_DATA_BYTES:
                payload = pack((_MESSAGES, batch))
                pending.append(u32(len(payload)))
                pending.append(payload)
                pending_bytes += 4 + len(payload)
                n_messages += len(batch)
                batch = []
                batch_bytes = 0
                if pending_bytes >= _PIECE_BYTES:
                    piece = b"".join(pending)
                    crc = zlib.crc32(piece, crc)
                    yield piece
                    pending, pending_bytes = [], 0
        if batch:
            payload = pack((_MESSAGES, batch))
            pending.append(u32(len(payload)))
            pending.append(payload)
            pending_bytes += 4 + len(payload)
            n_messages += len(batch)
        if pending_bytes >= _PIECE_BYTES:
            piece = b"".join(pending)
            crc = zlib.crc32(piece, crc)
            yield piece
            pending, pending_bytes = [], 0

    payload = pack((_END, n_queues, n_messages))
    pending.append(u32(len(payload)))
    pending.append(payload)
    piece = b"".join(pending)
    crc = zlib.crc32(piece, crc)
    yield piece
    yield u32(crc)


class _Source:
    """Bytes read in order from one buffer or from an iterable of pieces,
    with a running crc32 of what has been read."""

    def __init__(self, data: bytes | bytearray | memoryview | Iterable[bytes]) -> None:
        self.crc = 0
        self._pos = 0
        if isinstance(data, (bytes, bytearray, memoryview)):
            self._view: memoryview | None = memoryview(data)  # one buffer: no copies
            self._buf = bytearray()
            self._pieces: Iterator[bytes] = iter(())
        else:
            self._view = None
            self._buf = bytearray()  # unread bytes start at _pos
            self._pieces = iter(data)

    def read(self, n: int, what: str, *, count: bool = True) -> bytes | memoryview:
        pos = self._pos
        if self._view is not None:
            if pos + n > len(self._view):
                raise ValueError(f"snapshot truncated in {what}")
            out: bytes | memoryview = self._view[pos:pos + n]
            self._pos = pos + n
        else:
            buf = self._buf
            if pos > _PIECE_BYTES:  # drop what was read, now and then
                del buf[:pos]
                pos = 0
            while len(buf) - pos < n:
                piece = next(self._pieces, None)
                if piece is None:
                    raise ValueError(f"snapshot truncated in {what}")
                buf += piece
            with memoryview(buf) as view:
                out = bytes(view[pos:pos + n])
            self._pos = pos + n
        if count:
            self.crc = zlib.crc32(out, self.crc)
        return out

    def at_end(self) -> bool:
        if self._view is not None:
            return self._pos == len(self._view)
        while self._pos == len(self._buf):
            piece = next(self._pieces, None)
            if piece is None:
                return True
            if piece:
                self._buf += piece
        return False


def decode_snapshot(data: bytes | bytearray | memoryview | Iterable[bytes],
                    sink: Any = None) -> tuple[int, int, Any]:
    """Decode and check a snapshot.

    Args:
        data: the whole snapshot, or its bytes in pieces (e.g. a file read
            in blocks: nothing forces the pieces to match the encoder's).
        sink: None, or an object that takes the state as it is decoded,
            `sink.queue(name, max_id)` then `sink.messages(batch)` per chunk
            (batch: a tuple of message tuples), so that a million messages
            never exist twice in memory (`Store.snapshot_loader()`). A sink
            must not make anything visible before the call returns: the crc
            is checked last.
    Returns:
        (trans_id, vote_id, state). Without a sink, state is in
        `Store.to_wire()`'s shape: [name, max_id, [message tuple, ...]] per
        queue, which `Store.load_wire` accepts (messages are tuples, not
        lists: they are smaller and the garbage collector does not track
        them). With a sink, state is the sink.
    Raises:
        ValueError when anything is wrong: magic, version, structure, counts,
        the crc, trailing bytes. The state is returned only once the crc of
        the whole snapshot has matched.
    Cost: O(size); holds the decoded state plus one chunk.
    """
    src = _Source(data)
    magic, version, trans_id, vote_id = _SNAP_HEADER.unpack(src.read(_SNAP_HEADER.size, "header"))
    if magic != _SNAP_MAGIC:
        raise ValueError(f"not a snapshot (magic {bytes(magic)!r})")
    if version not in _SNAP_VERSIONS:
        raise ValueError(f"snapshot version {version} unknown (this build reads "
                         f"{', '.join(map(str, _SNAP_VERSIONS))})")
    rows = (6,) if version == 1 else _ROW_LENGTHS if version == 2 else _ROW_LENGTHS_V3
    state: list[Any] = []
    messages: list[Any] | None = None
    n_messages = 0
    while True:
        (length,) = _U32.unpack(src.read(4, "chunk length"))
        if length > MAX_SNAPSHOT_CHUNK_BYTES:
            raise ValueError(f"snapshot chunk length {length} over the bound")
        payload = src.read(length, "chunk")
        try:
            chunk = msgpack.unpackb(payload, use_list=False)
        except _UNPACK_ERRORS as exc:
            raise ValueError(f"snapshot chunk does not decode: {exc}") from None
        if type(chunk) is not tuple or not chunk:
            raise ValueError("snapshot chunk is not a list")
        kind = chunk[0]
        if kind == _MESSAGES and len(chunk) == 2 and messages is not None:
            batch = chunk[1]
            if type(batch) is not tuple \
                    or not all(type(m) is tuple and len(m) in rows for m in batch):
                raise ValueError("snapshot message chunk is malformed")
            if sink is None:
                messages.extend(batch)
            else:
                sink.messages(batch)
            n_messages += len(batch)
        elif kind == _QUEUE and (len(chunk) == 3 or (len(chunk) == 4 and version > 1)) \
                and type(chunk[1]) is str and type(chunk[2]) is int and chunk[2] >= 0:
            extras = chunk[3] if len(chunk) == 4 else None
            if extras is not None and type(extras) is not dict:
                raise ValueError("snapshot queue extras are not a map")
            messages = []
            state.append([chunk[1], chunk[2], messages, extras] if extras
                         else [chunk[1], chunk[2], messages])
            if sink is not None:
                sink.queue(chunk[1], chunk[2], extras)
        elif kind == _END and len(chunk) == 3:
            if chunk[1] != len(state) or chunk[2] != n_messages:
                raise ValueError(f"snapshot counts {chunk[1]} queues, {chunk[2]} messages; "
                                 f"read {len(state)}, {n_messages}")
            break
        else:
            raise ValueError(f"snapshot chunk of kind {kind!r} out of place or malformed")
    expected = src.crc
    (stored,) = _U32.unpack(src.read(4, "trailer", count=False))
    if stored != expected:
        raise ValueError("snapshot crc mismatch")
    if not src.at_end():
        raise ValueError("bytes after the snapshot's trailer")
    return trans_id, vote_id, (state if sink is None else sink)


# -- the vote ---------------------------------------------------------------

_VOTE_MAGIC = b"QVOT"
_VOTE_VERSION = 1
_VOTE_BODY = struct.Struct(">4sBQQ")  # magic, version, vote_id, voted_for
VOTE_BYTES = _VOTE_BODY.size + 4


def encode_vote(vote_id: int, voted_for: int) -> bytes:
    """The persisted vote: (vote_id, voted_for), voted_for 0 = nobody."""
    body = _VOTE_BODY.pack(_VOTE_MAGIC, _VOTE_VERSION, vote_id, voted_for)
    return body + _U32.pack(zlib.crc32(body))


def decode_vote(buf: bytes) -> tuple[int, int]:
    """(vote_id, voted_for); raises ValueError if the bytes are not a vote."""
    if len(buf) != VOTE_BYTES:
        raise ValueError(f"vote is {len(buf)} bytes, not {VOTE_BYTES}")
    body = buf[:_VOTE_BODY.size]
    (crc,) = _U32.unpack_from(buf, _VOTE_BODY.size)
    if zlib.crc32(body) != crc:
        raise ValueError("vote crc mismatch")
    magic, version, vote_id, voted_for = _VOTE_BODY.unpack(body)
    if magic != _VOTE_MAGIC or version != _VOTE_VERSION:
        raise ValueError(f"not a vote (magic {magic!r}, version {version})")
    return vote_id, voted_for
