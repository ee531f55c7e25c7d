"""Client requests: validated once, where they enter.

Theory of operation
-------------------
`parse_request(obj)` turns a decoded JSON object into one of the request
types below or raises `BadRequest` with the reason the client will read.
Everything after this point trusts the types: the store, the service and the
replication code never re-check a field.

The raw JSON object is kept by the caller, because queue_server's clients
expect the response to echo the request's fields (they match `seq`).

Request types are NamedTuples (immutable, like the house style's frozen
dataclasses, but built in half the time on the per-request hot path), built
with positional arguments (keywords cost more). A single node's usual
produce, consume and confirm skip them: `Service.answer_now` validates the
same fields in place and hands the values to `Store.decide_*_values`.

Times stay as the client sent them (seconds, absolute or relative below
1e9); the master converts them to absolute milliseconds in `Store.decide()`,
with its own clock, so that a request forwarded from a slave is timed once.
"""

from __future__ import annotations

import enum
from typing import Any, Literal, NamedTuple, overload

from ..errors import BadRequest

__all__ = [
    "Action",
    "ProduceRequest",
    "ProduceItem",
    "ProduceBatchRequest",
    "ClearRequest",
    "ConsumeRequest",
    "ConfirmRequest",
    "NackRequest",
    "TouchRequest",
    "ShowRequest",
    "PeekRequest",
    "ConfigRequest",
    "MonitorRequest",
    "ListRequest",
    "LeaderRequest",
    "AuthRequest",
    "TransferLeaderRequest",
    "DrainRequest",
    "HealthRequest",
    "Request",
    "parse_request",
    "MAX_QUEUE_NAME",
    "MAX_TIME_S",
    "RELATIVE_TIME_LIMIT_S",
    "MAX_COUNT",
    "MAX_DELIVERIES",
    "MAX_QUEUES",
    "MAX_PRIORITY",
    "DEFAULT_PRIORITY",
    "MAX_DEDUP_ID",
    "MAX_BATCH",
    "MAX_QUEUE_SIZE",
    "MAX_DEDUP_WINDOW_MS",
    "PAUSED_STATES",
    "Receipt",
    "parse_receipt",
]


class Action(enum.IntEnum):
    PRODUCE = 1
    CONSUME = 2
    CONFIRM = 3
    MONITOR = 4
    CONFIG = 5
    CLEAR = 6
    LIST = 7
    LEADER = 8
    NACK = 9
    TOUCH = 10
    SHOW = 11
    PEEK = 12
    TRANSFER_LEADER = 20
    # queue_server's local actions (100 + n): answered by the receiving node
    # from its own state, never forwarded to the master.
    LOCAL_MONITOR = 104
    LOCAL_LIST = 107
    DRAIN = 108
    HEALTH = 109


# Long enough for any real naming scheme ("task#station:order:event"), short
# enough that a list response of many queues stays small.
MAX_QUEUE_NAME = 255

# Times beyond the year 9999 are nonsense and would overflow the ms keys'
# sane range; refuse them instead of storing them.
MAX_TIME_S = 253_402_300_799

# The memcached convention: a time below this is seconds relative to now.
RELATIVE_TIME_LIMIT_S = 1_000_000_000

# Messages one consume or peek returns at most (README, Protocol: Disque's and
# SQS's batches are smaller; 1,000 keeps an answer of 1 KB messages ~1 MB).
MAX_COUNT = 1000
# The largest max_deliveries setting: a message delivered this often is
# surely poison, and a bound keeps the value sane.
MAX_DELIVERIES = 1_000_000
# Queues one consume may name (README, Protocol).
MAX_QUEUES = 16
# A receipt we hand out is three integers and two dots: far below this.
MAX_RECEIPT = 64
# Priorities (beanstalkd's convention): 0 to 2^31-1, lower first; a
# message produced without one has the default.
MAX_PRIORITY = 2**31 - 1
DEFAULT_PRIORITY = 1024
# A dedup id: long enough for a UUID, a hash or "order-id:version" keys
# (SQS takes 128 characters too).
MAX_DEDUP_ID = 128
# Messages in one batch produce (README, Batch produce: one log entry).
MAX_BATCH = 1000
# The largest per-queue max_size (as <queue_config queue_size>).
MAX_QUEUE_SIZE = 2**40
# The longest dedup window: 7 days (SQS keeps 5 minutes, NATS 2; a week
# covers any replay a producer could sensibly attempt).
MAX_DEDUP_WINDOW_MS = 7 * 24 * 3600 * 1000
# A queue's `paused` values: in stops produce, out stops consume.
PAUSED_STATES = ("none", "in", "out", "all")

# A receipt as parsed: (epoch, msg_id, deliveries); (0, 0, 0) for a string
# that is no receipt of ours (it matches no delivery: "stale receipt").
Receipt = tuple[int, int, int]
_NO_RECEIPT: Receipt = (0, 0, 0)


class ProduceRequest(NamedTuple):
    queue: str
    data: str
    delay_s: float | None  # None = now
    ttl_s: float | None  # None = delay + 3600 s
    retry_s: float  # 0 = at-most-once


class ProduceItem(NamedTuple):
    """One message of a `ProduceBatchRequest`, its times as the client sent them."""

    data: str
    delay_s: float | None
    ttl_s: float | None
    retry_s: float
    priority: int  # DEFAULT_PRIORITY when not given
    dedup_id: str  # "" = none


class ProduceBatchRequest(NamedTuple):
    """A produce with what a plain ProduceRequest lacks: `messages` (a
    batch), a `priority` or a `dedup_id`."""

    queue: str
    items: tuple[ProduceItem, ...]
    batch: bool  # `messages` was given: the answer lists msg_ids


class ClearRequest(NamedTuple):
    queue: str


class ConsumeRequest(NamedTuple):
    queues: tuple[str, ...]  # `queue`, or the `queues` listed
    batch: int | None  # `count`; None: today's single-message answer
    wait_ms: int  # long poll: 0 = answer at once
    lease_ms: int  # 0 = the message's retry
    many: bool  # `queues` was given: answers name each message's queue


class ConfirmRequest(NamedTuple):
    queue: str
    msg_id: int
    receipt: Receipt | None = None


class NackRequest(NamedTuple):
    queue: str
    msg_id: int
    receipt: Receipt | None
    delay_s: float  # as produce's delay: below 1e9 relative to now


class TouchRequest(NamedTuple):
    queue: str
    msg_id: int
    receipt: Receipt | None
    lease_ms: int  # 0 = the message's retry


class ShowRequest(NamedTuple):
    queue: str
    msg_id: int


class PeekRequest(NamedTuple):
    queue: str
    limit: int  # `count`


class ConfigRequest(NamedTuple):
    queue: str
    settings: dict[str, Any]  # checked values by setting name; {} = a read


class MonitorRequest(NamedTuple):
    queue: str | None  # None = node information only
    local: bool  # action 104: answered from this node's own state


class ListRequest(NamedTuple):
    pattern: str  # substring; "" matches every queue
    local: bool  # action 107


class LeaderRequest(NamedTuple):
    """Action 8: where the master is."""


class AuthRequest(NamedTuple):
    """Action 0 on a node without <security>: nothing to authenticate (a
    node with <security> answers it before parsing, qserver.auth)."""


class TransferLeaderRequest(NamedTuple):
    """Action 20: the master hands its role to `node_id` (forwarded to the
    master like any master request)."""

    node_id: int  # a cluster member; the engine refuses one that is not


class DrainRequest(NamedTuple):
    """Action 108 (node-local): stop taking new client work, or (`drain`
    false) take it again."""

    drain: bool


class HealthRequest(NamedTuple):
    """Action 109 (node-local): is this node ready for clients, and why not."""


Request = (ProduceRequest | ProduceBatchRequest | ConsumeRequest | ConfirmRequest | NackRequest
           | TouchRequest | ShowRequest | PeekRequest | ConfigRequest | ClearRequest
           | MonitorRequest | ListRequest | LeaderRequest | AuthRequest | TransferLeaderRequest
           | DrainRequest | HealthRequest)


@overload
def _queue(obj: dict[str, Any], required: Literal[True] = ...) -> str: ...
@overload
def _queue(obj: dict[str, Any], required: bool) -> str | None: ...


def _queue(obj: dict[str, Any], required: bool = True) -> str | None:
    name = obj.get("queue")
    if name is None:
        if required:
            raise BadRequest("missing field: queue")
        return None
    if type(name) is not str:
        raise BadRequest("queue must be a string")
    if not name:
        raise BadRequest("queue must not be empty")
    if len(name) > MAX_QUEUE_NAME:
        raise BadRequest(f"queue name longer than {MAX_QUEUE_NAME} characters")
    return name


def _time(obj: dict[str, Any], field: str) -> float | None:
    value = obj.get(field)
    if value is None:
        return None
    if type(value) is not int and type(value) is not float:
        raise BadRequest(f"{field} must be a number")
    if value < 0:
        raise BadRequest(f"{field} must not be negative")
    if value > MAX_TIME_S:
        raise BadRequest(f"{field} out of range")
    return value


def _plain_time(value: object) -> bool:
    """The common case, checked in one expression: absent, or an int in range."""
    return value is None or (type(value) is int and 0 <= value <= MAX_TIME_S)


def _produce(obj: dict[str, Any]) -> ProduceRequest | ProduceBatchRequest:
    # Fast path for the shape nearly every client sends (string queue and
    # data, integer times); anything else goes through the checks below,
    # which produce the reasons.
    get = obj.get
    queue, data, delay, ttl, retry = (get("queue"), get("data"), get("delay"), get("ttl"),
                                      get("retry"))
    if (type(queue) is str and 0 < len(queue) <= MAX_QUEUE_NAME and type(data) is str
            and _plain_time(delay) and _plain_time(ttl) and _plain_time(retry)
            and "priority" not in obj and "dedup_id" not in obj and "messages" not in obj):
        return ProduceRequest(queue, data, delay, ttl, retry or 0)
    return _produce_checked(obj)


def _retry(obj: dict[str, Any]) -> float:
    retry = obj.get("retry", 0)
    if retry is None:
        return 0
    if type(retry) is not int and type(retry) is not float:
        raise BadRequest("retry must be a number")
    if retry < 0:
        raise BadRequest("retry must not be negative")
    if retry > MAX_TIME_S:
        raise BadRequest("retry out of range")
    return retry


def _priority(obj: dict[str, Any], default: int) -> int:
    value = obj.get("priority")
    if value is None:
        return default
    if type(value) is not int or not 0 <= value <= MAX_PRIORITY:
        raise BadRequest(f"priority must be an integer from 0 to {MAX_PRIORITY}")
    return value


def _dedup_id(obj: dict[str, Any]) -> str:
    value = obj.get("dedup_id")
    if value is None:
        return ""
    if type(value) is not str or not 0 < len(value) <= MAX_DEDUP_ID:
        raise BadRequest(f"dedup_id must be a string of 1 to {MAX_DEDUP_ID} characters")
    return value


def _data(obj: dict[str, Any]) -> str:
    data = obj.get("data")
    if data is None:
        raise BadRequest("missing field: data")
    if type(data) is not str:
        raise BadRequest("data must be a string")
    return data


def _produce_checked(obj: dict[str, Any]) -> ProduceRequest | ProduceBatchRequest:
    queue = _queue(obj)
    if obj.get("messages") is not None:
        return _produce_batch(obj, queue)
    data = _data(obj)
    delay = _time(obj, "delay")
    ttl = _time(obj, "ttl")
    retry = _retry(obj)
    priority = _priority(obj, DEFAULT_PRIORITY)
    dedup_id = _dedup_id(obj)
    if obj.get("priority") is None and not dedup_id:
        return ProduceRequest(queue, data, delay, ttl, retry)
    return ProduceBatchRequest(
        queue, (ProduceItem(data, delay, ttl, retry, priority, dedup_id),), False)


def _produce_batch(obj: dict[str, Any], queue: str) -> ProduceBatchRequest:
    """`messages`: each item's fields checked as a single produce's, its
    reason prefixed with its index; the top-level delay, ttl, retry and
    priority are the defaults of every item."""
    if obj.get("data") is not None:
        raise BadRequest("give data or messages, not both")
    if obj.get("dedup_id") is not None:
        raise BadRequest("dedup_id goes on each message of a batch")
    raw = obj["messages"]
    if type(raw) is not list or not 1 <= len(raw) <= MAX_BATCH:
        raise BadRequest(f"messages must be a list of 1 to {MAX_BATCH} messages")
    delay = _time(obj, "delay")
    ttl = _time(obj, "ttl")
    retry = _retry(obj)
    priority = _priority(obj, DEFAULT_PRIORITY)
    items = []
    for index, item in enumerate(raw):
        try:
            if type(item) is not dict:
                raise BadRequest("must be an object")
            get = item.get
            items.append(ProduceItem(
                _data(item),
                delay if get("delay") is None else _time(item, "delay"),
                ttl if get("ttl") is None else _time(item, "ttl"),
                retry if get("retry") is None else _retry(item),
                _priority(item, priority), _dedup_id(item)))
        except BadRequest as exc:
            raise BadRequest(f"messages[{index}]: {exc.reason}") from None
    return ProduceBatchRequest(queue, tuple(items), True)


def _msg_id(obj: dict[str, Any]) -> int:
    value = obj.get("msg_id")
    if value is None:
        raise BadRequest("missing field: msg_id")
    # Some clients send ids as strings. isascii(): str.isdigit() also
    # accepts digits int() refuses ("\u00b2") or reads oddly ("\u0663").
    if type(value) is str and value.isascii() and value.isdigit() and len(value) < 20:
        value = int(value)
    if type(value) is not int:
        raise BadRequest("msg_id must be an integer")
    if value < 1:
        raise BadRequest("msg_id must be positive")
    return value


def _seconds_ms(obj: dict[str, Any], field: str, *, positive: bool) -> int:
    """An optional duration in seconds, as ms (0 when absent)."""
    value = obj.get(field)
    if value is None:
        return 0
    if type(value) is not int and type(value) is not float:
        raise BadRequest(f"{field} must be a number of seconds")
    if value < 0 or (positive and value <= 0):
        raise BadRequest(f"{field} must be {'positive' if positive else 'at least 0'}")
    if value > MAX_TIME_S:
        raise BadRequest(f"{field} out of range")
    ms = round(value * 1000)
    if positive and ms < 1:
        raise BadRequest(f"{field} must be at least 0.001 s")
    return ms


def _count(obj: dict[str, Any], default: int | None) -> int | None:
    value = obj.get("count")
    if value is None:
        return default
    if type(value) is not int or not 1 <= value <= MAX_COUNT:
        raise BadRequest(f"count must be an integer from 1 to {MAX_COUNT}")
    return value


def _consume(obj: dict[str, Any]) -> ConsumeRequest:
    names = obj.get("queues")
    if names is None:
        queues: tuple[str, ...] = (_queue(obj),)
    else:
        if obj.get("queue") is not None:
            raise BadRequest("give queue or queues, not both")
        if type(names) is not list or not 1 <= len(names) <= MAX_QUEUES:
            raise BadRequest(f"queues must be a list of 1 to {MAX_QUEUES} queue names")
        for name in names:
            if type(name) is not str or not 0 < len(name) <= MAX_QUEUE_NAME:
                raise BadRequest(f"queues must hold queue names (strings of 1 to "
                                 f"{MAX_QUEUE_NAME} characters)")
        if len(set(names)) != len(names):
            raise BadRequest("queues names a queue twice")
        queues = tuple(names)
    return ConsumeRequest(queues, _count(obj, None), _seconds_ms(obj, "wait", positive=False),
                          _seconds_ms(obj, "lease", positive=True), names is not None)


def _receipt(obj: dict[str, Any]) -> Receipt | None:
    value = obj.get("receipt")
    if value is None:
        return None
    if type(value) is not str:
        raise BadRequest("receipt must be a string")
    if not 0 < len(value) <= MAX_RECEIPT:
        raise BadRequest(f"receipt must be 1 to {MAX_RECEIPT} characters")
    return parse_receipt(value) or _NO_RECEIPT


def parse_receipt(text: str) -> Receipt | None:
    """A receipt string as (epoch, msg_id, deliveries); None when it is not
    one of ours (over MAX_RECEIPT characters, or not three integers)."""
    if len(text) > MAX_RECEIPT:
        return None
    parts = text.split(".")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() and len(p) < 20 for p in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def _nack_delay(obj: dict[str, Any]) -> float:
    value = _time(obj, "delay")
    return 0 if value is None else value


def _settings(obj: dict[str, Any]) -> dict[str, Any]:
    raw = obj.get("set")
    if raw is None:
        return {}
    if type(raw) is not dict:
        raise BadRequest("set must be an object of settings")
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name == "max_deliveries":
            if type(value) is not int or not 0 <= value <= MAX_DELIVERIES:
                raise BadRequest(f"bad value for max_deliveries: must be an integer from 0 "
                                 f"(unlimited) to {MAX_DELIVERIES}")
        elif name == "dead_letter":
            if value is None:
                value = ""
            if type(value) is not str or len(value) > MAX_QUEUE_NAME:
                raise BadRequest(f"bad value for dead_letter: must be a queue name (1 to "
                                 f"{MAX_QUEUE_NAME} characters), or null for none")
        elif name == "max_size":
            if type(value) is not int or not 0 <= value <= MAX_QUEUE_SIZE:
                raise BadRequest(f"bad value for max_size: must be an integer from 1 to "
                                 f"{MAX_QUEUE_SIZE}, or 0 for the node's queue_size")
        elif name == "dedup_window":
            if (type(value) is not int and type(value) is not float) \
                    or not 0 <= value * 1000 <= MAX_DEDUP_WINDOW_MS:
                raise BadRequest(f"bad value for dedup_window: must be a number of seconds "
                                 f"from 0 (off) to {MAX_DEDUP_WINDOW_MS // 1000}")
            name, value = "dedup_window_ms", round(value * 1000)
        elif name == "paused":
            if value not in PAUSED_STATES or type(value) is not str:
                raise BadRequest(f"bad value for paused: must be one of "
                                 f"{', '.join(PAUSED_STATES)}")
        else:
            raise BadRequest(f"unknown setting: {name}")
        out[name] = value
    return out


# Node ids are small positive integers in <cluster>; anything over this is
# not one, and is refused here rather than carried to the engine.
MAX_NODE_ID = 2**31 - 1


def _node_id(obj: dict[str, Any]) -> int:
    value = obj.get("node_id")
    if value is None:
        raise BadRequest("missing field: node_id")
    if type(value) is not int or not 0 < value <= MAX_NODE_ID:
        raise BadRequest("node_id must be a positive integer (a node id of the cluster)")
    return value


def _drain(obj: dict[str, Any]) -> bool:
    value = obj.get("drain")
    if value is None:
        return True
    if type(value) is not bool:
        raise BadRequest("drain must be true (drain) or false (undo a drain)")
    return value


def _pattern(obj: dict[str, Any]) -> str:
    pattern = obj.get("pattern")
    if pattern is None:
        return ""
    if type(pattern) is not str:
        raise BadRequest("pattern must be a string")
    return pattern


def parse_request(obj: object) -> Request:
    """Validate a decoded JSON value as a request.

    Returns the typed request; raises BadRequest with the client's reason.
    Cost: O(number of fields).
    """
    if type(obj) is not dict:
        raise BadRequest("request must be a JSON object")
    action = obj.get("action")
    if action is None:
        raise BadRequest("missing field: action")
    if type(action) is not int:
        raise BadRequest("action must be an integer")
    if action == 1:
        return _produce(obj)
    if action == 2:
        return _consume(obj)
    if action == 3:
        return ConfirmRequest(_queue(obj), _msg_id(obj), _receipt(obj))
    if action == 9:
        return NackRequest(_queue(obj), _msg_id(obj), _receipt(obj), _nack_delay(obj))
    if action == 10:
        return TouchRequest(_queue(obj), _msg_id(obj), _receipt(obj),
                            _seconds_ms(obj, "lease", positive=True))
    if action == 11:
        return ShowRequest(_queue(obj), _msg_id(obj))
    if action == 12:
        return PeekRequest(_queue(obj), _count(obj, 1) or 1)
    if action == 5:
        return ConfigRequest(_queue(obj), _settings(obj))
    if action == 4 or action == 104:
        return MonitorRequest(_queue(obj, required=False), action == 104)
    if action == 7 or action == 107:
        return ListRequest(_pattern(obj), action == 107)
    if action == 8:
        return LeaderRequest()
    if action == 6:
        return ClearRequest(_queue(obj))
    if action == 0:
        return AuthRequest()
    if action == 109:
        return HealthRequest()
    if action == 108:
        return DrainRequest(_drain(obj))
    if action == 20:
        return TransferLeaderRequest(_node_id(obj))
    raise BadRequest("invalid action")
