"""parse_request: every action, and every class of bad input with the exact
reason the client reads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qserver.errors import BadRequest
from qserver.wire.requests import (
    MAX_COUNT,
    MAX_DELIVERIES,
    MAX_QUEUE_NAME,
    MAX_QUEUES,
    MAX_TIME_S,
    AuthRequest,
    ClearRequest,
    ConfigRequest,
    ConfirmRequest,
    ConsumeRequest,
    DrainRequest,
    HealthRequest,
    LeaderRequest,
    ListRequest,
    MonitorRequest,
    NackRequest,
    PeekRequest,
    ProduceBatchRequest,
    ProduceRequest,
    ShowRequest,
    TouchRequest,
    TransferLeaderRequest,
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


def test_unsupported():
    # Action 6 (clear) is still queue_server's "not support"; 5 is config now.
    assert parse_request({"action": 6, "queue": "q"}) == ClearRequest("q")


def test_config_read():
    assert parse_request({"action": 5, "queue": "q"}) == ConfigRequest("q", {})
    assert parse_request({"action": 5, "queue": "q", "set": None}) == ConfigRequest("q", {})


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


@pytest.mark.parametrize("action", [-1, 13, 19, 21, 99, 100, 101, 105, 106, 110, 2**70])
def test_unknown_action(action):
    assert reason({"action": action, "queue": "q"}) == "invalid action"


def test_auth_action():
    # Action 0 (protocol-v2): parsed on a node without <security>, which
    # answers it code 0 (qserver.auth answers it on a node with one).
    assert parse_request({"action": 0, "token": "x" * 16}) == AuthRequest()


QUEUE_ACTIONS = [{"action": 1, "data": "x"}, {"action": 2}, {"action": 3, "msg_id": 1},
                 {"action": 5}, {"action": 9, "msg_id": 1}, {"action": 10, "msg_id": 1},
                 {"action": 11, "msg_id": 1}, {"action": 12}]
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
    if type(ok) is ConsumeRequest:
        assert ok.queues == ("q" * MAX_QUEUE_NAME,)
    else:
        assert ok.queue == "q" * MAX_QUEUE_NAME
    assert reason(dict(base, queue="q" * (MAX_QUEUE_NAME + 1))) == (
        f"queue name longer than {MAX_QUEUE_NAME} characters")


def test_queue_name_length_counts_characters():
    name = "\u4e16" * MAX_QUEUE_NAME  # 3 bytes each in utf-8
    assert parse_request({"action": 2, "queue": name}).queues == (name,)


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


# -- the consumer controls (protocol-v2, issue 14) ------------------------------

CONSUME = {"action": 2, "queue": "q"}


def test_consume_with_every_new_field():
    req = parse_request({"action": 2, "queues": ["a", "b"], "count": 10, "wait": 1.5,
                         "lease": 30})
    assert req == ConsumeRequest(("a", "b"), 10, 1500, 30_000, True)
    # null is absent, as for produce's optional fields
    req = parse_request(dict(CONSUME, count=None, wait=None, lease=None, queues=None))
    assert req == ConsumeRequest(("q",), None, 0, 0, False)


@pytest.mark.parametrize("count", [1, MAX_COUNT])
def test_consume_count_bounds(count):
    assert parse_request(dict(CONSUME, count=count)).batch == count


@pytest.mark.parametrize("count", [0, -1, MAX_COUNT + 1, "x", "5", True, False, 1.0, [1], {}])
def test_consume_bad_count(count):
    assert reason(dict(CONSUME, count=count)) == f"count must be an integer from 1 to {MAX_COUNT}"


@pytest.mark.parametrize("wait,ms", [(0, 0), (0.0, 0), (1, 1000), (0.25, 250), (30, 30_000)])
def test_consume_wait(wait, ms):
    assert parse_request(dict(CONSUME, wait=wait)).wait_ms == ms


@pytest.mark.parametrize("wait,why", [
    ("5", "wait must be a number of seconds"),
    (True, "wait must be a number of seconds"),
    ([1], "wait must be a number of seconds"),
    (-1, "wait must be at least 0"),
    (-0.001, "wait must be at least 0"),
    (MAX_TIME_S + 1, "wait out of range"),
    (1e300, "wait out of range"),
])
def test_consume_bad_wait(wait, why):
    assert reason(dict(CONSUME, wait=wait)) == why


@pytest.mark.parametrize("field", ["lease"])
@pytest.mark.parametrize("action", [2, 10])
@pytest.mark.parametrize("value,why", [
    (0, "{f} must be positive"),
    (0.0, "{f} must be positive"),
    (-1, "{f} must be positive"),
    (0.0004, "{f} must be at least 0.001 s"),  # rounds to 0 ms
    ("1", "{f} must be a number of seconds"),
    (True, "{f} must be a number of seconds"),
    (MAX_TIME_S + 1, "{f} out of range"),
])
def test_bad_lease(field, action, value, why):
    obj = {"action": action, "queue": "q", "msg_id": 1, field: value}
    assert reason(obj) == why.format(f=field)


def test_lease_in_ms():
    assert parse_request(dict(CONSUME, lease=0.001)).lease_ms == 1
    assert parse_request(dict(CONSUME, lease=2.5)).lease_ms == 2500
    assert parse_request({"action": 10, "queue": "q", "msg_id": 1, "lease": 7}).lease_ms == 7000


def test_consume_queues_bounds():
    names = [f"q{i}" for i in range(MAX_QUEUES)]
    assert parse_request({"action": 2, "queues": names}).queues == tuple(names)
    assert parse_request({"action": 2, "queues": ["x" * MAX_QUEUE_NAME]}).many is True
    # `queue` null next to `queues` is absent, not "both"
    assert parse_request({"action": 2, "queue": None, "queues": ["a"]}).queues == ("a",)


LIST_REASON = f"queues must be a list of 1 to {MAX_QUEUES} queue names"
NAMES_REASON = (f"queues must hold queue names (strings of 1 to {MAX_QUEUE_NAME} "
                f"characters)")


@pytest.mark.parametrize("queues,why", [
    ([], LIST_REASON),
    ([f"q{i}" for i in range(MAX_QUEUES + 1)], LIST_REASON),
    ("q", LIST_REASON),
    ({"q": 1}, LIST_REASON),
    (5, LIST_REASON),
    (["a", 1], NAMES_REASON),
    (["a", None], NAMES_REASON),
    ([["a"]], NAMES_REASON),
    (["a", ""], NAMES_REASON),
    (["x" * (MAX_QUEUE_NAME + 1)], NAMES_REASON),
    (["a", "b", "a"], "queues names a queue twice"),
])
def test_consume_bad_queues(queues, why):
    assert reason({"action": 2, "queues": queues}) == why


def test_consume_queue_and_queues():
    assert reason({"action": 2, "queue": "a", "queues": ["b"]}) == "give queue or queues, not both"
    assert reason({"action": 2, "queue": "a", "queues": ["a"]}) == "give queue or queues, not both"
    assert reason({"action": 2}) == "missing field: queue"


def test_confirm_with_receipt():
    req = parse_request({"action": 3, "queue": "q", "msg_id": 7, "receipt": "12.7.3"})
    assert req == ConfirmRequest("q", 7, (12, 7, 3))
    assert parse_request({"action": 3, "queue": "q", "msg_id": 7, "receipt": None}).receipt is None


@pytest.mark.parametrize("action", [3, 9, 10])
@pytest.mark.parametrize("receipt,why", [
    (1, "receipt must be a string"),
    (1.5, "receipt must be a string"),
    (True, "receipt must be a string"),
    (["1.2.3"], "receipt must be a string"),
    ({}, "receipt must be a string"),
    ("", "receipt must be 1 to 64 characters"),
    ("1" * 65, "receipt must be 1 to 64 characters"),
])
def test_bad_receipt(action, receipt, why):
    assert reason({"action": action, "queue": "q", "msg_id": 1, "receipt": receipt}) == why


@pytest.mark.parametrize("action", [3, 9, 10])
@pytest.mark.parametrize("receipt", [
    "x", "1.2", "1.2.3.4", "1..3", "-1.2.3", "1.2.a", " 1.2.3", "1.2.3 ", "\u00b2.1.1",
    "1.1.\u0663", "1" * 20 + ".1.1", "1" * 64,
])
def test_garbage_receipt_is_a_receipt_that_matches_nothing(action, receipt):
    # Not an error at parse time: the service answers "stale receipt".
    req = parse_request({"action": action, "queue": "q", "msg_id": 1, "receipt": receipt})
    assert req.receipt == (0, 0, 0)


def test_nack():
    assert (parse_request({"action": 9, "queue": "q", "msg_id": 4})
            == NackRequest("q", 4, None, 0))
    assert (parse_request({"action": 9, "queue": "q", "msg_id": "4", "receipt": "1.4.2",
                           "delay": 2.5})
            == NackRequest("q", 4, (1, 4, 2), 2.5))
    assert parse_request({"action": 9, "queue": "q", "msg_id": 4, "delay": None}).delay_s == 0


@pytest.mark.parametrize("delay,why", [
    ("1", "delay must be a number"),
    (True, "delay must be a number"),
    (-1, "delay must not be negative"),
    (MAX_TIME_S + 1, "delay out of range"),
])
def test_nack_bad_delay(delay, why):
    assert reason({"action": 9, "queue": "q", "msg_id": 4, "delay": delay}) == why


def test_touch_show_peek():
    assert (parse_request({"action": 10, "queue": "q", "msg_id": 4})
            == TouchRequest("q", 4, None, 0))
    assert parse_request({"action": 11, "queue": "q", "msg_id": 4}) == ShowRequest("q", 4)
    assert parse_request({"action": 12, "queue": "q"}) == PeekRequest("q", 1)
    assert parse_request({"action": 12, "queue": "q", "count": MAX_COUNT}) == PeekRequest(
        "q", MAX_COUNT)


@pytest.mark.parametrize("action", [9, 10, 11])
def test_new_actions_need_a_msg_id(action):
    assert reason({"action": action, "queue": "q"}) == "missing field: msg_id"
    assert reason({"action": action, "queue": "q", "msg_id": 0}) == "msg_id must be positive"
    assert reason({"action": action, "queue": "q", "msg_id": 1.5}) == "msg_id must be an integer"


@pytest.mark.parametrize("count", [0, MAX_COUNT + 1, "x", True])
def test_peek_bad_count(count):
    assert reason({"action": 12, "queue": "q", "count": count}) == (
        f"count must be an integer from 1 to {MAX_COUNT}")


def test_config_set():
    req = parse_request({"action": 5, "queue": "q",
                         "set": {"max_deliveries": 3, "dead_letter": "dlq"}})
    assert req == ConfigRequest("q", {"max_deliveries": 3, "dead_letter": "dlq"})
    # null and "" both mean no dead-letter queue
    for none in (None, ""):
        req = parse_request({"action": 5, "queue": "q", "set": {"dead_letter": none}})
        assert req == ConfigRequest("q", {"dead_letter": ""})
    req = parse_request({"action": 5, "queue": "q", "set": {"max_deliveries": MAX_DELIVERIES}})
    assert req.settings == {"max_deliveries": MAX_DELIVERIES}


MAX_DELIVERIES_REASON = (f"bad value for max_deliveries: must be an integer from 0 "
                         f"(unlimited) to {MAX_DELIVERIES}")
DEAD_LETTER_REASON = (f"bad value for dead_letter: must be a queue name (1 to "
                      f"{MAX_QUEUE_NAME} characters), or null for none")


@pytest.mark.parametrize("settings_,why", [
    ([], "set must be an object of settings"),
    ("max_deliveries=3", "set must be an object of settings"),
    (3, "set must be an object of settings"),
    ({"paused": "sideways"}, "bad value for paused: must be one of none, in, out, all"),
    ({"max_deliveries": 1, "colour": "red"}, "unknown setting: colour"),
    ({"max_deliveries": -1}, MAX_DELIVERIES_REASON),
    ({"max_deliveries": MAX_DELIVERIES + 1}, MAX_DELIVERIES_REASON),
    ({"max_deliveries": "3"}, MAX_DELIVERIES_REASON),
    ({"max_deliveries": 3.0}, MAX_DELIVERIES_REASON),
    ({"max_deliveries": True}, MAX_DELIVERIES_REASON),
    ({"max_deliveries": None}, MAX_DELIVERIES_REASON),
    ({"dead_letter": 5}, DEAD_LETTER_REASON),
    ({"dead_letter": ["d"]}, DEAD_LETTER_REASON),
    ({"dead_letter": False}, DEAD_LETTER_REASON),
    ({"dead_letter": "d" * (MAX_QUEUE_NAME + 1)}, DEAD_LETTER_REASON),
])
def test_config_bad_set(settings_, why):
    assert reason({"action": 5, "queue": "q", "set": settings_}) == why


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
FIELDS = ["action", "queue", "data", "delay", "ttl", "retry", "msg_id", "pattern", "seq",
          "count", "queues", "wait", "lease", "receipt", "set"]


@settings(max_examples=1000, deadline=None)
@given(obj=json_values | st.dictionaries(
    st.sampled_from(FIELDS),
    st.one_of(json_values, st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 104, 107]),
              st.sampled_from(["q", "", "7", "\u00b2", "1.2.3", ["q", "r"], ["q", "q"], [],
                               {"max_deliveries": 3}, {"dead_letter": None}, {"x": 1}])),
))
def test_fuzz_parse_request_returns_a_request_or_raises_bad_request(obj):
    try:
        req = parse_request(obj)
    except BadRequest as exc:
        assert type(exc) is BadRequest and isinstance(exc.reason, str) and exc.reason
        return
    assert type(req) in (ProduceRequest, ConsumeRequest, ConfirmRequest, MonitorRequest,
                         ListRequest, LeaderRequest, ClearRequest, NackRequest,
                         TouchRequest, ShowRequest, PeekRequest, ConfigRequest,
                         ProduceBatchRequest, AuthRequest, TransferLeaderRequest,
                         DrainRequest, HealthRequest)
    if type(req) in (ConfirmRequest, NackRequest, TouchRequest, ShowRequest):
        assert type(req.msg_id) is int and req.msg_id >= 1
    if type(req) is ConsumeRequest:
        assert 1 <= len(req.queues) <= MAX_QUEUES and len(set(req.queues)) == len(req.queues)
        assert req.batch is None or 1 <= req.batch <= MAX_COUNT
        assert type(req.wait_ms) is int and req.wait_ms >= 0
        assert type(req.lease_ms) is int and req.lease_ms >= 0
    if type(req) in (ConfirmRequest, NackRequest, TouchRequest) and req.receipt is not None:
        assert len(req.receipt) == 3 and all(type(p) is int and p >= 0 for p in req.receipt)
    if type(req) is PeekRequest:
        assert 1 <= req.limit <= MAX_COUNT
    if type(req) is ConfigRequest:
        assert set(req.settings) <= {"max_deliveries", "dead_letter"}
