"""The client wire codec: TCP framing, UDP datagrams, responses.

Every framing input is fed three ways (whole, one byte at a time, and whole
followed by the next request's prefix) and must give the same values in the
same order (h11's tests/test_io.py does the same). Hypothesis then feeds
arbitrary bytes and random chunkings of random JSON objects.
"""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qserver.errors import BadRequest, ProtocolError
from qserver.wire.codec import (
    DEFAULT_MAX_REQUEST_SIZE,
    MAX_DEPTH,
    StreamDecoder,
    decode_datagram,
    encode_response,
    error_response,
    too_deep,
)

# The start of the request that follows the input under test.
NEXT_PREFIX = b'{"action": 2, "queue": "nex'
NEXT_REST = b't", "seq": 9}'
NEXT_VALUE = {"action": 2, "queue": "next", "seq": 9}


def norm(items: list) -> list:
    """Items as comparable values: errors by class and reason."""
    out = []
    for item in items:
        if isinstance(item, BadRequest):  # ProtocolError included
            out.append((type(item).__name__, item.reason))
        else:
            out.append(item)
    return out


def feed_chunks(chunks, max_size: int = DEFAULT_MAX_REQUEST_SIZE) -> tuple[list, StreamDecoder]:
    d = StreamDecoder(max_size)
    out: list = []
    for chunk in chunks:
        out += d.feed(chunk)
    return out, d


def whole(data: bytes, max_size: int = DEFAULT_MAX_REQUEST_SIZE) -> list:
    return norm(feed_chunks([data], max_size)[0])


def bytewise(data: bytes, max_size: int = DEFAULT_MAX_REQUEST_SIZE) -> list:
    return norm(feed_chunks([data[i:i + 1] for i in range(len(data))], max_size)[0])


def assert_three_ways(data: bytes, expected: list,
                      max_size: int = DEFAULT_MAX_REQUEST_SIZE) -> None:
    """`data` gives `expected` whole, byte by byte, and with trailing data;
    and when the stream is still usable the trailing request completes."""
    expected = norm(expected)
    assert whole(data, max_size) == expected
    assert bytewise(data, max_size) == expected
    out, d = feed_chunks([data + NEXT_PREFIX], max_size)
    assert norm(out) == expected
    poisoned = any(e[0] == "ProtocolError" for e in expected if isinstance(e, tuple))
    if poisoned:
        assert d.poisoned
        assert d.feed(NEXT_REST) == []
    else:
        assert not d.poisoned
        assert d.feed(NEXT_REST) == [NEXT_VALUE]
        assert d.pending_bytes == 0


# -- values ------------------------------------------------------------------

VALID_CASES = {
    "single object": (b'{"action": 1, "queue": "q", "data": "x"}',
                      [{"action": 1, "queue": "q", "data": "x"}]),
    "compact object": (b'{"a":1}', [{"a": 1}]),
    "empty object": (b"{}", [{}]),
    "newline terminated": (b'{"a":1}\n', [{"a": 1}]),
    "back to back": (b'{"a":1}{"b":2}{"c":3}', [{"a": 1}, {"b": 2}, {"c": 3}]),
    "spaces between": (b'{"a":1}  {"b":2} \t {"c":3}', [{"a": 1}, {"b": 2}, {"c": 3}]),
    "newlines between": (b'{"a":1}\n{"b":2}\n{"c":3}\n', [{"a": 1}, {"b": 2}, {"c": 3}]),
    "crlf and blank lines": (b'\r\n{"a":1}\r\n\r\n{"b":2}\r\n', [{"a": 1}, {"b": 2}]),
    "leading whitespace": (b'   \n\t{"a":1}', [{"a": 1}]),
    "mixed separators": (b'{"a":1}{"b":2}\n{"c":3} {"d":4}\n',
                         [{"a": 1}, {"b": 2}, {"c": 3}, {"d": 4}]),
    "nested": (b'{"a":{"b":{"c":[1,[2,{"d":[]}]]}},"e":[{}]}',
               [{"a": {"b": {"c": [1, [2, {"d": []}]]}}, "e": [{}]}]),
    "string with braces": (b'{"data":"}}{{]]["}{"b":"{"}', [{"data": "}}{{]]["}, {"b": "{"}]),
    "string with quotes": (b'{"data":"say \\"hi\\" {"}{"x":1}', [{"data": 'say "hi" {'}, {"x": 1}]),
    "escaped backslash before quote": (b'{"data":"c:\\\\"}{"x":"\\\\\\""}',
                                       [{"data": "c:\\"}, {"x": '\\"'}]),
    "unicode escapes": (b'{"data":"\\u00e9\\ud83d\\ude00"}', [{"data": "\u00e9\U0001F600"}]),
    "raw utf-8": ('{"data":"h\u00e9llo \u4e16\u754c \U0001F600"}'.encode(),
                  [{"data": "h\u00e9llo \u4e16\u754c \U0001F600"}]),
    "pretty printed": (json.dumps({"action": 1, "queue": "q", "nested": {"a": [1, 2]}},
                                  indent=4).encode()
                       + b"\n" + json.dumps({"b": "}"}, indent=2).encode(),
                       [{"action": 1, "queue": "q", "nested": {"a": [1, 2]}}, {"b": "}"}]),
    "top-level array": (b'[1, {"a": "]"}, [2]]', [[1, {"a": "]"}, [2]]]),
    "array then object": (b'[]\n{"a":1}', [[], {"a": 1}]),
    "multi-line object then line objects": (b'{\n"a": 1\n}\n{"b":2}\n', [{"a": 1}, {"b": 2}]),
}


@pytest.mark.parametrize("data,expected", VALID_CASES.values(), ids=VALID_CASES.keys())
def test_values_three_ways(data, expected):
    assert_three_ways(data, expected)


@pytest.mark.parametrize("data,expected", VALID_CASES.values(), ids=VALID_CASES.keys())
def test_values_every_two_way_split(data, expected):
    expected = norm(expected)
    for i in range(len(data) + 1):
        out, _ = feed_chunks([data[:i], data[i:]])
        assert norm(out) == expected, i


def test_backslash_at_chunk_boundary():
    # The escape and the byte it escapes arrive in different reads.
    d = StreamDecoder()
    assert d.feed(b'{"data":"a\\') == []
    assert d.feed(b'"}') == []  # the quote was escaped: still inside the string
    assert d.feed(b'"}') == [{"data": 'a"}'}]
    assert d.feed(b'{"x":"\\') == []
    assert d.feed(b'\\') == []
    assert d.feed(b'"}') == [{"x": "\\"}]
    assert d.pending_bytes == 0


def test_multibyte_utf8_split_across_feeds():
    text = "\u00e9\u4e16\U0001F600"
    data = orjson.dumps({"data": text})
    for i in range(len(data) + 1):
        d = StreamDecoder()
        assert d.feed(data[:i]) + d.feed(data[i:]) == [{"data": text}]
    # split inside one code point explicitly
    smile = "\U0001F600".encode()
    d = StreamDecoder()
    assert d.feed(b'{"data":"' + smile[:1]) == []
    assert d.feed(smile[1:3]) == []
    assert d.feed(smile[3:] + b'"}') == [{"data": "\U0001F600"}]


def test_unfinished_request_is_kept_until_complete():
    d = StreamDecoder()
    assert d.feed(b'{"a":1}{"b":') == [{"a": 1}]
    assert d.pending_bytes == len(b'{"b":')
    assert d.feed(b"2}") == [{"b": 2}]
    assert d.pending_bytes == 0


def test_a_large_request_in_many_reads_ending_in_a_newline():
    # A batch produce of ~600 KB arrives in 64 KB reads; the newline that
    # ends it lets the decoder parse it whole (StreamDecoder._finish_line),
    # with whatever follows it in the same read.
    batch = {"action": 1, "queue": "q",
             "messages": [{"data": f"m{i} " + "x" * 500, "dedup_id": f"d{i}"}
                          for i in range(1200)]}
    raw = orjson.dumps(batch) + b"\n" + b'{"action":8}\n{"action":7,'
    decoder = StreamDecoder(1024 * 1024)
    out: list = []
    for i in range(0, len(raw), 65536):
        out += decoder.feed(raw[i:i + 65536])
    assert out == [batch, {"action": 8}]
    assert decoder.feed(b'"pattern":"q"}\n') == [{"action": 7, "pattern": "q"}]
    assert decoder.pending_bytes == 0


def test_a_request_spanning_lines_in_several_reads_is_still_framed():
    # Pretty-printed: the first newline does not end the value.
    decoder = StreamDecoder(1024)
    out = decoder.feed(b'{"action": 1,\n')
    out += decoder.feed(b' "queue": "q",\n "data": "a\\nb"\n')
    out += decoder.feed(b'}\n{"action":8}')
    assert out == [{"action": 1, "queue": "q", "data": "a\nb"}, {"action": 8}]


def test_whitespace_only_returns_nothing():
    d = StreamDecoder()
    assert d.feed(b"  \n\r\t ") == []
    assert d.feed(b"") == []
    assert not d.poisoned
    assert d.feed(b'{"a":1}') == [{"a": 1}]


# -- errors ------------------------------------------------------------------

ERROR_CASES = {
    "brace-balanced garbage": (b'{abc}{"a":1}', [BadRequest("invalid json"), {"a": 1}]),
    "invalid then newline": (b'{"a":}\n{"b":2}\n', [BadRequest("invalid json"), {"b": 2}]),
    "trailing comma": (b'{"a":1,}[1,]{"c":3}',
                       [BadRequest("invalid json"), BadRequest("invalid json"), {"c": 3}]),
    "mismatched brackets": (b'{"a":[1}]{"c":3}', [BadRequest("invalid json"), {"c": 3}]),
    "invalid utf-8 inside a string": (b'{"a":"\xff\xfe"}{"c":3}',
                                      [BadRequest("invalid json"), {"c": 3}]),
    "raw newline in a string": (b'{"a":"x\ny"}\n{"c":3}\n', [BadRequest("invalid json"), {"c": 3}]),
    "word at top level": (b"hello", [ProtocolError("invalid json")]),
    "number at top level": (b"123", [ProtocolError("invalid json")]),
    "number line then object": (b'123\n{"a":1}\n', [ProtocolError("invalid json")]),
    "string line then object": (b'"x"\n{"a":1}\n', [ProtocolError("invalid json")]),
    "true line then object": (b'true\n{"a":1}\n', [ProtocolError("invalid json")]),
    "object then number line": (b'{"a":1}\n5\n{"b":2}\n',
                                [{"a": 1}, ProtocolError("invalid json")]),
    "closing brace at top level": (b'}{"a":1}', [ProtocolError("invalid json")]),
    "object then garbage": (b'{"a":1} x {"b":2}', [{"a": 1}, ProtocolError("invalid json")]),
    "garbage after newline objects": (b'{"a":1}\n{"b":2}\nGET / HTTP/1.1\r\n',
                                      [{"a": 1}, {"b": 2}, ProtocolError("invalid json")]),
    "byte order mark": (b'\xef\xbb\xbf{"a":1}', [ProtocolError("invalid json")]),
    "nul between requests": (b'{"a":1}\x00{"b":2}', [{"a": 1}, ProtocolError("invalid json")]),
}


@pytest.mark.parametrize("data,expected", ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_errors_three_ways(data, expected):
    assert_three_ways(data, expected)


def _nested_request(depth: int, brackets_in_strings: int = 0) -> bytes:
    """A produce with `depth` lists nested inside it (in `seq`), and a data
    string full of brackets."""
    seq = "[" * depth + "]" * depth
    return orjson.dumps({"action": 1, "queue": "q", "data": "{[" * brackets_in_strings,
                         "seq": orjson.Fragment(seq.encode())})


@pytest.mark.parametrize("brackets_in_strings", [0, 400])
def test_a_request_nested_past_what_an_answer_can_carry_is_that_request_only(
        brackets_in_strings):
    # As deep as orjson writes (an answer echoes the request's fields): kept,
    # and its answer can be encoded. One level more: refused, the stream goes
    # on; whole, byte by byte, newline-framed, after a split read, by UDP.
    ok = _nested_request(MAX_DEPTH, brackets_in_strings)
    deep = _nested_request(MAX_DEPTH + 1, brackets_in_strings)
    very = _nested_request(900, brackets_in_strings)  # orjson reads up to 1024
    (value,) = whole(ok)
    assert type(value) is dict and not too_deep(value)
    assert encode_response(value).endswith(b"\n")
    refused = ("BadRequest", f"request nests deeper than {MAX_DEPTH} levels")
    for bad in (deep, very):
        assert_three_ways(bad, [BadRequest(refused[1])])
        assert whole(ok + bad + ok) == norm([value, BadRequest(refused[1]), value])
        assert whole(bad + b"\n" + ok + b"\n") == norm([BadRequest(refused[1]), value])
        d = StreamDecoder()
        assert d.feed(bad[:40]) == []
        assert norm(d.feed(bad[40:] + b"\n")) == [refused]
        assert norm([decode_datagram(bad, 65_507)]) == [refused]
    assert decode_datagram(ok, 65_507) == value


def test_bad_frame_is_that_request_only():
    d = StreamDecoder()
    out = d.feed(b"{abc}")
    assert norm(out) == [("BadRequest", "invalid json")]
    assert type(out[0]) is BadRequest
    assert not d.poisoned
    assert d.feed(b'{"action": 8}') == [{"action": 8}]


def test_garbage_poisons_the_decoder():
    for garbage in (b"hello", b"123", b"null", b"]"):
        d = StreamDecoder()
        out = d.feed(garbage)
        assert len(out) == 1 and type(out[0]) is ProtocolError, garbage
        assert isinstance(out[0], BadRequest)  # answered like any bad request
        assert d.poisoned
        assert d.feed(b'{"a":1}') == []
        assert d.feed(b'{"a":1}\n') == []
        assert d.pending_bytes == 0


def test_complete_request_over_max_size_is_bad_request_and_stream_goes_on():
    max_size = 256
    big = orjson.dumps({"data": "x" * 400})
    small = b'{"a":1}'
    for data in (big + small, big + b"\n" + small + b"\n", small + big + small):
        out, d = feed_chunks([data], max_size)
        got = norm(out)
        assert ("BadRequest", "request too large") in got
        assert got.count({"a": 1}) == data.count(small)
        assert got[-1] == {"a": 1}
        assert not d.poisoned
        assert d.feed(b'{"b":2}') == [{"b": 2}]


def test_request_of_exactly_max_size_is_accepted():
    max_size = 256
    obj = {"data": "x" * (max_size - len(b'{"data":""}'))}
    data = orjson.dumps(obj)
    assert len(data) == max_size
    assert_three_ways(data, [obj], max_size)
    over = orjson.dumps({"data": obj["data"] + "x"})
    assert whole(over, max_size) == [("BadRequest", "request too large")]
    # one byte over, fed byte by byte: never unfinished over the limit
    assert bytewise(over, max_size) == [("BadRequest", "request too large")]


def test_unfinished_request_over_max_size_poisons():
    max_size = 256
    d = StreamDecoder(max_size)
    assert d.feed(b'{"a":1}{"data":"') == [{"a": 1}]
    out = d.feed(b"x" * 300)
    assert norm(out) == [("ProtocolError", "request too large")]
    assert d.poisoned
    assert d.pending_bytes == 0
    assert d.feed(b'"}{"a":1}') == []


def test_unfinished_request_growing_byte_by_byte_over_max_size_poisons():
    max_size = 256
    d = StreamDecoder(max_size)
    out: list = []
    fed = 0
    for b in b'{"data":"' + b"y" * 1000:
        out += d.feed(bytes([b]))
        fed += 1
        if out:
            break
    assert norm(out) == [("ProtocolError", "request too large")]
    assert fed == max_size + 1  # poisoned as soon as it passes the limit
    assert d.feed(b'"}') == []


def test_whitespace_between_requests_does_not_count_towards_the_limit():
    max_size = 256
    d = StreamDecoder(max_size)
    assert d.feed(b" " * 1000) == []
    assert d.feed(b"\n" * 1000 + b'{"a":1}') == [{"a": 1}]
    assert not d.poisoned


# -- fuzz --------------------------------------------------------------------

# Bytes that matter to the framer, plus some that do not.
TOKENS = [b"{", b"}", b"[", b"]", b'"', b"\\", b" ", b"\n", b"\r", b":", b",", b"1", b"a",
          b"null", b'"k"', b"\xc3\xa9", b"\xff", b"\x00", b"\xf0\x9f\x98", b"\x80"]


@st.composite
def chunkings(draw, data: bytes):
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=8))
    cuts = sorted(set(cuts))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def check_items(items: list) -> None:
    for i, item in enumerate(items):
        if isinstance(item, BadRequest):
            assert type(item) in (BadRequest, ProtocolError)
            assert isinstance(item.reason, str) and item.reason
            if type(item) is ProtocolError:
                assert i == len(items) - 1  # nothing after the poison
        else:
            assert isinstance(item, (dict, list))


# Whole JSON texts, valid requests or not, as a client might send them.
SNIPPETS = [b"{}", b'{"a":1}', b'{"s":"}\\"}', b"[1]", b"[]", b"1", b"-2.5", b'"x"', b"null",
            b"true", b"{abc}", b"{", b"}", b"hello", b'{"a":"\xff"}', b"\xef\xbb\xbf{}"]
SNIPPET_SEPARATORS = [b"", b" ", b"\n", b"\r\n", b"\n\n"]


@st.composite
def snippet_streams(draw):
    parts = []
    for snippet in draw(st.lists(st.sampled_from(SNIPPETS), max_size=8)):
        parts.append(draw(st.sampled_from(SNIPPET_SEPARATORS)))
        parts.append(snippet)
    parts.append(draw(st.sampled_from(SNIPPET_SEPARATORS)))
    return b"".join(parts)


fuzz_bytes = st.one_of(
    st.binary(max_size=200),
    st.lists(st.sampled_from(TOKENS), max_size=60).map(b"".join),
    snippet_streams(),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), raw=fuzz_bytes, max_size=st.sampled_from([16, 64, DEFAULT_MAX_REQUEST_SIZE]))
def test_fuzz_any_bytes_give_values_or_errors(data, raw, max_size):
    d = StreamDecoder(max_size)
    items = d.feed(raw)  # must not raise
    check_items(items)
    if any(type(i) is ProtocolError for i in items):
        assert d.poisoned and d.feed(b'{"a":1}') == []
    chunks = data.draw(chunkings(raw))
    out, _ = feed_chunks(chunks, max_size)
    check_items(out)
    if max_size == DEFAULT_MAX_REQUEST_SIZE:
        # Far below the limit, framing does not depend on how bytes arrive.
        assert norm(out) == norm(items)
        assert bytewise(raw, max_size) == norm(items)


json_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(),
)
json_values = st.recursive(
    json_scalars,
    lambda children: (st.lists(children, max_size=4)
                      | st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=10), json_values, max_size=5)
SEPARATORS = [b"", b" ", b"\n", b"\r\n", b"\t", b"  \n\n  ", b"\n\n"]


def serialize(obj: dict, style: int) -> bytes:
    if style == 0:
        return orjson.dumps(obj)
    if style == 1:
        return json.dumps(obj).encode()  # ", " and ": " separators, \\u escapes
    if style == 2:
        return json.dumps(obj, indent=2, ensure_ascii=False).encode()  # multi-line
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), objs=st.lists(json_objects, min_size=1, max_size=6))
def test_fuzz_objects_with_random_separators_and_chunkings(data, objs):
    parts = []
    for obj in objs:
        parts.append(data.draw(st.sampled_from(SEPARATORS)))
        parts.append(serialize(obj, data.draw(st.integers(0, 3))))
    parts.append(data.draw(st.sampled_from(SEPARATORS)))
    stream = b"".join(parts)
    chunks = data.draw(chunkings(stream))
    out, d = feed_chunks(chunks)
    assert out == objs
    assert d.pending_bytes == 0
    assert not d.poisoned
    assert bytewise(stream) == objs


# -- datagrams and responses -------------------------------------------------

def test_decode_datagram():
    assert decode_datagram(b'{"action": 8, "seq": 1}', 1000) == {"action": 8, "seq": 1}
    assert decode_datagram(b' {"a":1}\n', 1000) == {"a": 1}
    assert decode_datagram(b"[1]", 1000) == [1]
    assert decode_datagram(b"5", 1000) == 5  # any JSON value; parse_request rejects it
    for bad in (b"", b"{abc}", b'{"a":1}{"b":2}', b"\xff", b'{"a":1', b"hello"):
        out = decode_datagram(bad, 1000)
        assert type(out) is BadRequest and out.reason == "invalid json", bad


def test_decode_datagram_size_limit():
    data = orjson.dumps({"data": "x" * 100})
    assert decode_datagram(data, len(data)) == {"data": "x" * 100}
    out = decode_datagram(data, len(data) - 1)
    assert type(out) is BadRequest and out.reason == "request too large"


def test_encode_response_is_one_line_of_json():
    resp = {"code": 0, "msg_id": 7, "data": "line1\nline2 \u00e9", "seq": "abc"}
    wire = encode_response(resp)
    assert wire.endswith(b"\n") and wire.count(b"\n") == 1
    assert orjson.loads(wire) == resp
    # a stream of responses decodes back with the same framer
    d = StreamDecoder()
    error = {"code": -1, "reason": "x"}
    assert d.feed(wire + encode_response(error)) == [resp, error]


def test_error_response_echoes_request_without_data():
    req = {"action": 1, "queue": "q", "data": "payload", "seq": 42}
    resp = error_response("queue full: q", req)
    assert resp == {"action": 1, "queue": "q", "seq": 42, "code": -1, "reason": "queue full: q"}
    assert "data" not in resp


@pytest.mark.parametrize("request_obj", [None, [1, 2], 5, "x", True])
def test_error_response_for_non_objects(request_obj):
    assert error_response("request must be a JSON object", request_obj) == {
        "code": -1, "reason": "request must be a JSON object"}
