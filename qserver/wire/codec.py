"""The client wire codec: JSON objects over a TCP stream or UDP datagrams.

Theory of operation
-------------------
queue_server's clients write JSON objects back to back, with or without
whitespace or newlines between them, and a request may arrive split across
reads. `StreamDecoder.feed(bytes)` returns every value completed by those
bytes, in order; it keeps the unfinished tail for the next call.

Framing scans for the brackets that close the top-level value, skipping
string contents (and their escapes), and resumes where it stopped, so a
request fed one byte at a time costs O(n) overall. Most reads hold exactly
one request, or whole newline-terminated requests; those are handed to
orjson directly without scanning.

Rules
- A framed value that is not valid JSON is an error for that request only
  (`BadRequest` in the output); the stream goes on.
- Bytes that cannot start a value (anything but whitespace, `{` or `[`
  between requests), or an unfinished request longer than the limit, poison
  the decoder: `ProtocolError` in the output, and every later feed returns
  nothing. The server answers once and closes the connection.
- A complete request longer than the limit is a `BadRequest`; the stream
  goes on (its end is known).
- So is one that nests deeper than MAX_DEPTH (containers inside the top
  value): orjson reads four times as deep as it writes, and an answer
  echoes the request's fields, so such a request would be carried out and
  its answer could not be written. Brackets bound the depth, so only a
  request with more than MAX_DEPTH + 1 of them is walked (`too_deep`).

Responses are one JSON object and a newline (`encode_response`).

This module does no I/O.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ..errors import BadRequest, ProtocolError

__all__ = [
    "MAX_DEPTH",
    "too_deep",
    "StreamDecoder",
    "decode_datagram",
    "encode_response",
    "error_response",
    "DEFAULT_MAX_REQUEST_SIZE",
    "MAX_UDP_PAYLOAD",
]

# The default <limits max_request_size>: 1 MiB, so that a batch produce of
# 1,000 messages (protocol-v2's largest batch) fits in one request (design.md
# had 64 KiB before batches; queue_server advised TCP above 2 KiB of data).
# UDP stays bounded by the datagram (Config.max_udp_request_size).
DEFAULT_MAX_REQUEST_SIZE = 1024 * 1024

# The largest payload one IPv4 UDP datagram can carry.
MAX_UDP_PAYLOAD = 65_507

_WS = b" \t\r\n"
_STRUCT = re.compile(rb'["{}\[\]]')
_STR_SPECIAL = re.compile(rb'["\\]')
_NON_WS = re.compile(rb"[^ \t\r\n]")
_OPEN = frozenset(b"{[")
_QUOTE = ord('"')
_OPEN_CHARS = (ord("{"), ord("["))


# The deepest a request may nest: containers inside the top value, as
# orjson encodes them (a map of 253 nested levels is written, 254 is not).
MAX_DEPTH = 253
# A value nested deeper than MAX_DEPTH has MAX_DEPTH + 2 pairs of brackets
# at least: a shorter frame needs no look (the usual request, a few hundred
# bytes at most, costs one length test); a longer one with at most
# _BRACKETS_OK opening brackets needs no walk.
_SHORT_OK = 2 * (MAX_DEPTH + 2)
_BRACKETS_OK = MAX_DEPTH + 1
TOO_DEEP = f"request nests deeper than {MAX_DEPTH} levels"


def too_deep(value: object) -> bool:
    """Whether `value` has containers nested more than MAX_DEPTH deep inside
    it. Walked without recursion (a peer's or client's deep value costs no
    stack)."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if type(item) is dict:
            stack.extend((v, depth + 1) for v in item.values()
                         if type(v) is dict or type(v) is list)
        elif type(item) is list:
            stack.extend((v, depth + 1) for v in item if type(v) is dict or type(v) is list)
    return False


def _bounded(value: object, frame: bytes | bytearray, start: int = 0,
             end: int | None = None) -> object:
    """`value`, decoded from frame[start:end] (at least _SHORT_OK bytes: the
    callers test the length first), or a BadRequest if it nests too deep."""
    if (frame.count(b"{", start, end) + frame.count(b"[", start, end) > _BRACKETS_OK
            and too_deep(value)):
        return BadRequest(TOO_DEEP)
    return value


def _loads(frame: bytes | bytearray | memoryview) -> object:
    try:
        return orjson.loads(frame)
    except orjson.JSONDecodeError:
        return BadRequest("invalid json")


class StreamDecoder:
    """Frames a byte stream into JSON values (see the module docstring)."""

    __slots__ = ("max_size", "_buf", "_pos", "_start", "_depth", "_in_str", "poisoned")

    def __init__(self, max_size: int = DEFAULT_MAX_REQUEST_SIZE) -> None:
        self.max_size = max_size
        self._buf = bytearray()  # unconsumed bytes; _buf[:_pos] already scanned
        self._pos = 0  # next byte to scan
        self._start = -1  # start of the unfinished value in _buf, -1 between values
        self._depth = 0  # bracket depth of the unfinished value
        self._in_str = False  # _pos is inside a string literal
        self.poisoned = False  # the stream cannot be framed any more

    def feed(self, data: bytes) -> list[object]:
        """Consume `data`; return the values it completed, in order. Each item
        is a decoded JSON value, a BadRequest (that request only) or a final
        ProtocolError. O(len(data))."""
        if self.poisoned:
            return []
        if not self._buf:
            fast = self._fast(data)
            if fast is not None:
                return fast
        elif self._start == 0:
            done = self._finish_line(data)
            if done is not None:
                return done
        self._buf += data
        return self._scan()

    def _finish_line(self, data: bytes) -> list[object] | None:
        """A request that came in several reads, ended by a newline in
        `data`: decoded whole rather than scanned byte class by byte class
        (a 1 MiB batch produce arrives in many reads). A raw newline is
        never inside a JSON string, so the unfinished value (at the start
        of the buffer) either ends before it or goes on past it; only the
        first parses. None, having changed nothing, when it does not."""
        nl = data.find(b"\n")
        if nl < 0 or len(self._buf) + nl > self.max_size:
            return None
        buf = self._buf
        buf += data[:nl]
        try:
            value = orjson.loads(buf)
            if len(buf) >= _SHORT_OK:
                value = _bounded(value, buf)
        except orjson.JSONDecodeError:
            del buf[len(buf) - nl:]  # as it was: the scanner judges
            return None
        self._buf = bytearray()
        self._pos, self._start, self._depth, self._in_str = 0, -1, 0, False
        rest = data[nl + 1:]
        return [value, *self.feed(rest)] if rest else [value]

    def _fast(self, data: bytes) -> list[object] | None:
        # One whole request, or whole newline-terminated requests: the
        # common shapes, decoded without scanning.
        tail = data.rstrip(_WS)
        if not tail or tail[-1] != 0x7D:  # '}'
            return None
        if len(data) <= self.max_size:
            try:
                value = orjson.loads(data)
            except orjson.JSONDecodeError:
                pass
            else:
                return [value if len(data) < _SHORT_OK else _bounded(value, data)]
        if b"\n" not in tail:
            return None
        out: list[object] = []
        for line in tail.split(b"\n"):
            if len(line) > self.max_size:
                return None
            stripped = line.strip(_WS)
            if not stripped:
                continue
            if stripped[0] not in _OPEN:
                # orjson would take a bare number, string or literal; the
                # framer refuses it (a stream poison): let it judge.
                return None
            try:
                value = orjson.loads(line)
                out.append(value if len(line) < _SHORT_OK else _bounded(value, line))
            except orjson.JSONDecodeError:
                return None  # a value spanning lines: frame it properly
        return out

    def _scan(self) -> list[object]:
        out: list[object] = []
        buf = self._buf
        pos, start, depth, in_str = self._pos, self._start, self._depth, self._in_str
        end = len(buf)
        max_size = self.max_size
        while pos < end:
            if start < 0:
                m = _NON_WS.search(buf, pos)
                if m is None:
                    pos = end
                    break
                pos = m.start()
                if buf[pos] not in _OPEN_CHARS:
                    self._poison(out, "invalid json")
                    return out
                start, depth = pos, 1
                pos += 1
                continue
            if in_str:
                m = _STR_SPECIAL.search(buf, pos)
                if m is None:
                    pos = end
                elif buf[m.start()] == _QUOTE:
                    in_str = False
                    pos = m.start() + 1
                elif m.start() + 1 < end:
                    pos = m.start() + 2  # skip the escaped byte
                else:
                    pos = m.start()  # the escaped byte has not arrived yet
                    break
                continue
            m = _STRUCT.search(buf, pos)
            if m is None:
                pos = end
                continue
            pos = m.start() + 1
            c = buf[m.start()]
            if c == _QUOTE:
                in_str = True
            elif c in _OPEN:
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    if pos - start > max_size:
                        out.append(BadRequest("request too large"))
                    else:
                        value = _loads(memoryview(buf)[start:pos])
                        out.append(value if pos - start < _SHORT_OK
                                   else _bounded(value, buf, start, pos))
                    start = -1
        if start >= 0 and end - start > max_size:
            self._poison(out, "request too large")
            return out
        # Drop what is consumed so the buffer holds at most one request.
        cut = start if start >= 0 else pos
        if cut:
            del buf[:cut]
            pos -= cut
            if start >= 0:
                start = 0
        self._pos, self._start, self._depth, self._in_str = pos, start, depth, in_str
        return out

    def _poison(self, out: list[object], reason: str) -> None:
        out.append(ProtocolError(reason))
        self.poisoned = True
        self._buf = bytearray()

    @property
    def pending_bytes(self) -> int:
        """Bytes held for an unfinished request."""
        return len(self._buf)


def decode_datagram(data: bytes, max_size: int) -> object:
    """Decode one UDP datagram: a JSON value or a BadRequest."""
    if len(data) > max_size:
        return BadRequest("request too large")
    value = _loads(data)
    return value if len(data) < _SHORT_OK else _bounded(value, data)


_DUMPS = orjson.dumps
_NEWLINE = orjson.OPT_APPEND_NEWLINE


def encode_response(response: dict[str, Any]) -> bytes:
    """One response object as JSON plus a newline."""
    return _DUMPS(response, option=_NEWLINE)


def error_response(reason: str, request: object = None) -> dict[str, Any]:
    """A code -1 response; echoes the request's fields when it was an object
    (so that `seq` comes back), except its data (and a batch's messages:
    up to 1 MiB the client already has)."""
    if type(request) is dict:
        request.pop("data", None)
        request.pop("messages", None)
        request["code"] = -1
        request["reason"] = reason
        return request
    return {"code": -1, "reason": reason}
