"""parse_request: every action, and every class of bad input with the exact
reason the client reads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qserver.errors import BadRequest
from qserver.wire.requests import (
    MAX_QUEUE_NAME,
    MAX_TIME_S,
    ConfirmRequest,
    ConsumeRequest,
    LeaderRequest,
    ListRequest,
    MonitorRequest,
    ProduceRequest,
    UnsupportedRequest,
    parse_request,
)


def reason(obj) -> str:
    with pytest.raises(BadRequest) as info:
        parse_request(obj)
    assert type(info.value) is BadRequest
    assert info.value.code == -1
    return info.value.reason


# -- every action --------------------------------------------------------------

def test_produce_minimal():
    req = parse_request({"action": 1, "queue": "q", "data": "x"})
    assert req == ProduceRequest(queue="q", data="x", delay_s=None, ttl_s=None, retry_s=0)


def test_produce_full():
    req = parse_request({"action": 1, "queue": "q", "data": "", "delay": 1_700_000_000,
                         "ttl": 1_700_003_600.5, "retry": 30, "seq": 5})
    assert req == ProduceRequest(queue="q", data="", delay_s=1_700_000_000,
                                 ttl_s=1_700_003_600.5, retry_s=30)


def test_produce_null_optionals_mean_absent():
    req = parse_request({"action": 1, "queue": "q", "data": "x", "delay": None, "ttl": None,
                         "retry": None})
    assert req == ProduceRequest(queue="q", data="x", delay_s=None, ttl_s=None, retry_s=0)


def test_produce_times_at_bounds():
    req = parse_request({"action": 1, "queue": "q", "data": "x", "delay": 0, "ttl": MAX_TIME_S,
                         "retry": MAX_TIME_S})
    assert (req.delay_s, req.ttl_s, req.retry_s) == (0, MAX_TIME_S, MAX_TIME_S)
    req = parse_request({"action": 1, "queue": "q", "data": "x", "delay": 30, "retry": 0.5})
    assert (req.delay_s, req.retry_s) == (30, 0.5)  # relative seconds stay as sent


def test_consume():
    assert parse_request({"action": 2, "queue": "q"}) == ConsumeRequest(("q",), None, 0, 0, False)


def test_confirm():
    assert (parse_request({"action": 3, "queue": "q", "msg_id": 7})
            == ConfirmRequest(queue="q", msg_id=7))


@pytest.mark.parametrize("raw,value", [("7", 7), ("0012", 12), ("123456789", 123456789)])
def test_confirm_numeric_string_msg_id(raw, value):
    assert (parse_request({"action": 3, "queue": "q", "msg_id": raw})
            == ConfirmRequest(queue="q", msg_id=value))


def test_monitor():
    assert parse_request({"action": 4, "queue": "q"}) == MonitorRequest(queue="q", local=False)
    assert parse_request({"action": 4}) == MonitorRequest(queue=None, local=False)
    assert parse_request({"action": 104, "queue": "q"}) == MonitorRequest(queue="q", local=True)
    assert parse_request({"action": 104}) == MonitorRequest(queue=None, local=True)


def test_list():
    assert parse_request({"action": 7}) == ListRequest(pattern="", local=False)
    assert parse_request({"action": 7, "pattern": "ab"}) == ListRequest(pattern="ab", local=False)
    assert parse_request({"action": 107, "pattern": None}) == ListRequest(pattern="", local=True)
    assert parse_request({"action": 107, "pattern": "x"}) == ListRequest(pattern="x", local=True)


def test_leader():
    assert parse_request({"action": 8}) == LeaderRequest()
    assert parse_request({"action": 8, "queue": 5}) == LeaderRequest()  # fields it does not use


@pytest.mark.parametrize("action", [5, 6])
def test_unsupported(action):
    assert parse_request({"action": action, "queue": "q"}) == UnsupportedRequest(action=action)


def test_extra_fields_are_ignored():
    req = parse_request({"action": 2, "queue": "q", "seq": "abc", "whatever": [1]})
    assert req == ConsumeRequest(("q",), None, 0, 0, False)


# -- bad input ---------------------------------------------------------------

@pytest.mark.parametrize("obj", [None, 1, 1.5, "x", True, [], [{"action": 1}]])
def test_not_an_object(obj):
    assert reason(obj) == "request must be a JSON object"


@pytest.mark.parametrize("obj", [{}, {"queue": "q"}, {"action": None}])
def test_missing_action(obj):
    assert reason(obj) == "missing field: action"


@pytest.mark.parametrize("action", ["1", 1.0, 2.5, True, False, [1], {"a": 1}])
def test_non_integer_action(action):
    # bool is an int subclass in Python; JSON true is not an action.
    assert reason({"action": action, "queue": "q", "data": "x"}) == "action must be an integer"


@pytest.mark.parametrize("action", [0, -1, 9, 99, 100, 101, 105, 106, 108, 2**70])
def test_unknown_action(action):
    assert reason({"action": action, "queue": "q"}) == "invalid action"


QUEUE_ACTIONS = [{"action": 1, "data": "x"}, {"action": 2}, {"action": 3, "msg_id": 1}]
OPTIONAL_QUEUE_ACTIONS = [{"action": 4}, {"action": 104}]


@pytest.mark.parametrize("base", QUEUE_ACTIONS)
def test_missing_queue(base):
    assert reason(dict(base)) == "missing field: queue"
    assert reason(dict(base, queue=None)) == "missing field: queue"


@pytest.mark.parametrize("base", QUEUE_ACTIONS + OPTIONAL_QUEUE_ACTIONS)
@pytest.mark.parametrize("queue", [1, 1.5, True, ["q"], {"q": 1}])
def test_non_string_queue(base, queue):
    assert reason(dict(base, queue=queue)) == "queue must be a string"


@pytest.mark.parametrize("base", QUEUE_ACTIONS + OPTIONAL_QUEUE_ACTIONS)
def test_empty_queue(base):
    assert reason(dict(base, queue="")) == "queue must not be empty"


@pytest.mark.parametrize("base", QUEUE_ACTIONS + OPTIONAL_QUEUE_ACTIONS)
def test_queue_name_length(base):
    ok = parse_request(dict(base, queue="q" * MAX_QUEUE_NAME))
    assert ok.queue == "q" * MAX_QUEUE_NAME
    assert reason(dict(base, queue="q" * (MAX_QUEUE_NAME + 1))) == (
        f"queue name longer than {MAX_QUEUE_NAME} characters")


def test_queue_name_length_counts_characters():
    name = "\u4e16" * MAX_QUEUE_NAME  # 3 bytes each in utf-8
    assert parse_request({"action": 2, "queue": name}).queue == name


PRODUCE = {"action": 1, "queue": "q", "data": "x"}


def test_produce_missing_data():
    assert reason({"action": 1, "queue": "q"}) == "missing field: data"
    assert reason(dict(PRODUCE, data=None)) == "missing field: data"


@pytest.mark.parametrize("data", [1, 1.5, True, ["x"], {"x": 1}])
def test_produce_data_not_a_string(data):
    assert reason(dict(PRODUCE, data=data)) == "data must be a string"


@pytest.mark.parametrize("field", ["delay", "ttl"])
@pytest.mark.parametrize("value", ["10", "1700000000", True, False, [1], {"a": 1}])
def test_time_not_a_number(field, value):
    assert reason(dict(PRODUCE, **{field: value})) == f"{field} must be a number"


@pytest.mark.parametrize("field", ["delay", "ttl"])
@pytest.mark.parametrize("value", [-1, -0.001, -1_700_000_000])
def test_time_negative(field, value):
    assert reason(dict(PRODUCE, **{field: value})) == f"{field} must not be negative"


@pytest.mark.parametrize("field", ["delay", "ttl", "retry"])
@pytest.mark.parametrize("value", [MAX_TIME_S + 1, MAX_TIME_S + 0.5, 2**64, 1e300])
def test_time_out_of_range(field, value):
    assert reason(dict(PRODUCE, **{field: value})) == f"{field} out of range"


@pytest.mark.parametrize("value", ["1", True, [0], {"a": 0}])
def test_retry_not_a_number(value):
    assert reason(dict(PRODUCE, retry=value)) == "retry must be a number"


@pytest.mark.parametrize("value", [-1, -0.5])
def test_retry_negative(value):
    assert reason(dict(PRODUCE, retry=value)) == "retry must not be negative"


CONFIRM = {"action": 3, "queue": "q"}


def test_confirm_missing_msg_id():
    assert reason(dict(CONFIRM)) == "missing field: msg_id"
    assert reason(dict(CONFIRM, msg_id=None)) == "missing field: msg_id"


@pytest.mark.parametrize("msg_id", [
    1.0, 1.5, True, [1], {"a": 1}, "", "abc", "1.5", "-1", " 1", "1e3", "0x10",
    "1" * 20,  # too long to be an id
    "\u00b2",  # superscript two: str.isdigit() says yes, int() says no
    "\u0663",  # Arabic-Indic three: not an id a client would send
])
def test_confirm_non_integer_msg_id(msg_id):
    assert reason(dict(CONFIRM, msg_id=msg_id)) == "msg_id must be an integer"


@pytest.mark.parametrize("msg_id", [0, -1, -(2**40), "0", "000"])
def test_confirm_msg_id_not_positive(msg_id):
    assert reason(dict(CONFIRM, msg_id=msg_id)) == "msg_id must be positive"


@pytest.mark.parametrize("action", [7, 107])
@pytest.mark.parametrize("pattern", [1, True, ["a"], {"a": 1}])
def test_pattern_not_a_string(action, pattern):
    assert reason({"action": action, "pattern": pattern}) == "pattern must be a string"


def test_first_problem_wins():
    # action is checked before the fields; queue before data.
    assert reason({"action": "x", "queue": 1}) == "action must be an integer"
    assert reason({"action": 1, "queue": 1, "data": 1}) == "queue must be a string"
    assert reason({"action": 1, "queue": "q", "data": 1, "delay": "x"}) == "data must be a string"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=8,
)
FIELDS = ["action", "queue", "data", "delay", "ttl", "retry", "msg_id", "pattern", "seq"]


@settings(max_examples=500, deadline=None)
@given(obj=json_values | st.dictionaries(
    st.sampled_from(FIELDS),
    st.one_of(json_values, st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 104, 107]),
              st.sampled_from(["q", "", "7", "\u00b2"])),
))
def test_fuzz_parse_request_returns_a_request_or_raises_bad_request(obj):
    try:
        req = parse_request(obj)
    except BadRequest as exc:
        assert type(exc) is BadRequest and isinstance(exc.reason, str) and exc.reason
        return
    assert type(req) in (ProduceRequest, ConsumeRequest, ConfirmRequest, MonitorRequest,
                         ListRequest, LeaderRequest, UnsupportedRequest)
    if type(req) is ConfirmRequest:
        assert type(req.msg_id) is int and req.msg_id >= 1
