"""The sans-I/O part of the client (see the `qserver.client` docstring for
the theory of operation): constants, `Message`, `parse_hosts`, the request
builders and time conversion, the reading of answers, the long-poll policy
of the consumer helpers (`_Polling`), and the exchange (`_Exchange`), the
retry policy (`_Router`) and the answer framing (`_Lines`) that both
drivers, `sync.Client` and `aio.AsyncClient`, run over their connections;
where a client connects and with what settings (`parse_target`, the
`qserver://` URL, `client_settings` with the environment passed in).
Nothing here opens a socket or sleeps; the one clock read is
`produce_request`'s default `now_s` (`time.time()`), the only files read
are the TLS files `security` loads into an `ssl.SSLContext`, and
randomness (the start node, the backoff's jitter) comes from the
`random.Random` the driver passes in."""

from __future__ import annotations

import math
import re
import ssl
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeGuard
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    import random

import orjson

from ..errors import (
    InvalidArgument,
    NoLeader,
    NotInFlight,
    QueueFull,
    QueuePaused,
    ServerError,
    StaleReceipt,
    Unauthorized,
)

# How long one node may stay silent (connecting, or with requests in
# flight) before the client gives up on it. A forwarded request can take a
# few round trips; 5 s is far above that and short enough for a person
# watching the command line.
DEFAULT_TIMEOUT_S = 5.0

# How long to keep retrying without progress. An election takes 0.6-1.2 s
# per round (README: Cluster behaviour); 10 s covers several rounds on a
# loaded machine.
DEFAULT_RETRY_FOR_S = 10.0

# Requests in flight on one connection in produce_many: enough to keep a node
# busy (a round trip costs ~0.2 ms, a request ~15 us of server CPU), and well
# under the node's MAX_PIPELINE (4096), past which it stops reading. Measured
# against a three-node cluster (bench/spark_bench.py's client side), 200 gave
# about 2.5 times the rows/s of 1,000: larger windows make larger per-turn
# batches on the master, whose pushes and commits then come in bursts.
DEFAULT_WINDOW = 200

# Backoff after a full round of failed nodes: a pause drawn at random from
# 0 to a ceiling ("full jitter"), so that the clients an election or a lost
# node sent away at the same moment do not come back at the same moment.
# The ceiling starts small (a redirect target or a fresh master is usually
# there at once) and doubles to a cap that still notices a new master
# within a second.
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 1.0

# Redirects followed at once, per exchange; past this (leaders pointing at
# each other during an election) redirects count as failures, with backoff.
MAX_REDIRECTS = 5

# The wait of each long poll of the consumer helpers (`messages`, `process`):
# an idle consumer sends one request per LONG_POLL_S. Below the server's
# default max_wait (30 s) and equal to SQS's largest WaitTimeSeconds; a node
# whose max_wait is lower answers "wait out of range", and the client halves
# its long poll (`shorter_long_poll`) down to MIN_LONG_POLL_S, then polls.
LONG_POLL_S = 20.0
MIN_LONG_POLL_S = 1.0

# Pauses between polls when the server does not hold a long poll (a node
# that predates long polls and ignores `wait`, or a node that answers its
# parked consumes at once, again and again): quick at first, backing off to
# a few requests per second (see `_Polling`).
POLL_MIN_S = 0.01
POLL_MAX_S = 0.5

# Idle long-poll connections a client keeps for the next long poll (each
# long poll runs on a connection of its own, see the package docstring):
# one per thread or task that consumes at the same time, up to this.
MAX_IDLE_POLL_CONNECTIONS = 8

# Bytes asked of the socket per read.
RECV_SIZE = 256 * 1024

# The environment variables a client reads when it is not given the hosts
# (`QSERVER_SERVERS`: "host:port,host:port" or a qserver:// URL) or the
# timeout (`QSERVER_TIMEOUT`: seconds), as the `qserver` command does.
SERVERS_ENV = "QSERVER_SERVERS"
TIMEOUT_ENV = "QSERVER_TIMEOUT"

# The URL form of the hosts: qserver://host:port,host:port/?timeout=5&token=...
# (qservers:// speaks TLS). Scheme -> TLS.
URL_SCHEMES = {"qserver": False, "qservers": True}
# The settings its query may carry: seconds, and strings (percent-decoded).
URL_SECONDS = ("timeout", "retry_for", "long_poll")
URL_STRINGS = ("token", "tls_ca", "tls_cert", "tls_key", "tls_server_hostname")

# README, Time and delivery: a wire time below this is seconds relative to now.
ABSOLUTE_TIME_FROM = 1_000_000_000

# Reasons for which asking again (elsewhere, a little later) can succeed:
# the server's words (service.py, engines/forwarding.py, and OUTCOME_UNKNOWN
# in engines/native/core.py and engines/raft/machine.py).
NO_LEADER = "no leader"
OUTCOME_UNKNOWN_SUFFIX = "outcome unknown"

# The server's reason for a full queue is "queue full: NAME" (state/store.py).
QUEUE_FULL_PREFIX = "queue full:"

# The server's reasons for the typed errors of receipts, for a show of a
# message that is not there, and for a long poll over its max_wait
# (README: Receipts, Long poll).
STALE_RECEIPT = "stale receipt"
NOT_IN_FLIGHT = "not in flight"
NO_SUCH_MESSAGE = "no such message"
WAIT_OUT_OF_RANGE = "wait out of range"

# The fields of one message of a batch produce (README: Batch produce),
# and of a `produce_many` item (which also names its queue).
MESSAGE_KEYS = frozenset({"data", "delay", "ttl", "retry", "priority", "dedup_id"})
PRODUCE_KEYS = MESSAGE_KEYS | {"queue"}

# The most messages one batch produce may carry (README, Batch produce:
# `messages` is a list of 1 to 1000).
MAX_BATCH = 1000

# The most bytes one batch request may take, encoded: under the node's
# default max_request_size (1 MiB, README: Configuration), with room for the `seq` the
# exchange adds and for what a relaying slave wraps around it. A node with
# a lower max_request_size needs a lower `max_request_bytes`.
BATCH_MAX_BYTES = 900_000

# Room for `,"seq":N` in every request the exchange sends.
SEQ_ALLOWANCE = 32

# Batch requests in flight on one connection at once. Each carries up to
# 1,000 messages and is one log entry, several milliseconds of the master's
# work: a second one on the wire hides the round trip, more buy nothing.
# Measured on loopback (2 cores, 100-byte messages, produce_batch of 20,000
# to 50,000, medians): one node in memory, windows 1/2/4/8 gave about
# 340k/300-350k/180k/185k messages/s; three nodes with fsync=batch,
# 134k/118k/115k. Past 2 the node's input buffer holds several large
# requests, which its decoder frames more slowly than one at a time.
BATCH_WINDOW = 2

# The server's reasons for a refused token or action start with this
# (README: Authentication and TLS; qserver.auth).
UNAUTHORIZED = "unauthorized"

# What a node that predates action 0 answers to it: it has no <security>,
# so there is nothing to authenticate.
INVALID_ACTION = "invalid action"

# The server's reason for a produce into a paused queue: "queue paused", or
# "queue paused: NAME" for a virtual queue (README: Queue settings).
QUEUE_PAUSED = "queue paused"

# What a node that predates batch produce answers to one (it wants `data`,
# wire/requests.py): `produce_many` then sends single produces.
MISSING_DATA = "missing field: data"

# The values of `pause(queue, what)` (the config setting `paused`, which also
# takes "none": `resume`).
PAUSE_WHAT = ("in", "out", "all")

# Fields of an answer that echo the request or frame it, not its result.
_ECHO_FIELDS = ("action", "code", "seq", "queue", "pattern")

Address = tuple[str, int]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Message:
    """One consumed message: the delivery of `data`, message `msg_id` of
    `queue`. `deliveries` counts this delivery (1 the first time; None from
    a server that does not count them); `receipt` names this delivery for
    confirm, nack and touch (None for an at-most-once message or a last
    delivery, which the server deleted as it delivered them, and from a
    server without receipts).

    Equal (and hashed) as the message, not the delivery: by queue, msg_id and
    data. Two deliveries of one message are equal, whatever their receipts.
    `sync.Delivery` and `aio.AsyncDelivery` are Messages that can confirm,
    nack and touch themselves.
    """

    queue: str
    msg_id: int
    data: str
    deliveries: int | None = None
    receipt: str | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return (self.queue, self.msg_id, self.data) == (other.queue, other.msg_id, other.data)

    def __hash__(self) -> int:
        return hash((self.queue, self.msg_id, self.data))


# -- arguments to requests (no I/O) -----------------------------------------


def parse_hosts(hosts: str | Iterable[str | Address]) -> list[Address]:
    """Addresses from "host:port" strings, (host, port) tuples, one
    comma-separated string, or a qserver:// URL without settings (see
    `parse_target`). IPv6 literals may be written "[::1]:1111". Raises
    InvalidArgument, also for a URL that carries settings (TLS, a token, a
    timeout), which only `parse_target` and the clients keep."""
    target = parse_target(hosts)
    if target.options:
        raise InvalidArgument(f"the URL carries settings ({', '.join(sorted(target.options))})"
                              f" that a list of addresses would lose: give the URL to "
                              f"Client/AsyncClient, or read it with parse_target")
    return target.addresses


@dataclass(frozen=True, slots=True)
class Target:
    """Where a client connects: `addresses` in the order given, and
    `options`, the settings a qserver:// URL carried, under the clients'
    argument names: `timeout`, `retry_for`, `long_poll` (float seconds),
    `token`, `tls_ca`, `tls_cert`, `tls_key`, `tls_server_hostname` (str),
    `tls` (True, for qservers://). Empty for plain addresses."""

    addresses: list[Address]
    options: dict[str, Any]

    def __repr__(self) -> str:  # a URL's token is never printed
        shown = {k: ("..." if k == "token" else v) for k, v in self.options.items()}
        return f"Target(addresses={self.addresses!r}, options={shown!r})"


def parse_target(hosts: object, source: str = "hosts") -> Target:
    """`hosts` as `Client` takes it: "host:port" strings, (host, port)
    tuples, one comma-separated string, or a URL
    `qserver://host:port,host:port/?timeout=5&token=...` (`qservers://`:
    TLS; the query may set timeout, retry_for, long_poll, token, tls_ca,
    tls_cert, tls_key, tls_server_hostname, each once, percent-encoded). A
    list of one URL is the URL. `source` names where `hosts` came from in
    the errors (an environment variable, say). Raises InvalidArgument,
    naming the address or the URL part that is wrong (never the token)."""
    if isinstance(hosts, str):
        if "://" in hosts:
            return _parse_url(hosts.strip(), source)
        items: list = [h.strip() for h in hosts.split(",") if h.strip()]
    elif (isinstance(hosts, tuple) and len(hosts) == 2 and isinstance(hosts[0], str)
          and isinstance(hosts[1], int)):
        items = [hosts]
    elif isinstance(hosts, Iterable) and not isinstance(hosts, (bytes, dict)):
        items = list(hosts)
        if len(items) == 1 and isinstance(items[0], str) and "://" in items[0]:
            return _parse_url(items[0].strip(), source)
    else:
        raise InvalidArgument(f"{source} must be 'host:port' strings, (host, port) tuples "
                              f"or a qserver:// URL, not {type(hosts).__name__}")
    try:
        return Target(_addresses(items), {})
    except InvalidArgument as exc:
        if source == "hosts":
            raise
        raise InvalidArgument(f"{source}={hosts!r}: {exc}") from None


def _parse_url(url: str, source: str) -> Target:
    """A qserver:// or qservers:// URL (see `parse_target`). Errors name the
    part, not the whole URL (its query may hold a token)."""
    where = "URL" if source == "hosts" else f"{source} (a URL)"
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    if parts.scheme not in URL_SCHEMES:
        raise InvalidArgument(f"{where}: scheme {parts.scheme!r} is not one of "
                              f"{', '.join(s + '://' for s in URL_SCHEMES)}")
    if "@" in parts.netloc:
        raise InvalidArgument(f"{where}: user information before '@' is not taken "
                              f"(give a token as ?token=...)")
    if parts.path not in ("", "/"):
        raise InvalidArgument(f"{where}: path {parts.path!r}: a qserver URL has none "
                              f"(settings go in the query: /?timeout=5)")
    if parts.fragment:
        raise InvalidArgument(f"{where}: a qserver URL has no #fragment")
    items = [h.strip() for h in parts.netloc.split(",") if h.strip()]
    if not items:
        raise InvalidArgument(f"{where}: no host:port after {parts.scheme}://")
    try:
        addresses = _addresses(items)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    options: dict[str, Any] = {}
    if URL_SCHEMES[parts.scheme]:
        options["tls"] = True
    query = []
    for pair in parts.query.split("&") if parts.query else ():
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise InvalidArgument(f"{where}: the query is not name=value&name=value")
        # unquote, not parse_qsl's unquote_plus: a '+' (base64 tokens have
        # them) stays a '+'; a space is %20
        query.append((unquote(name), unquote(value)))
    for name, value in query:
        if name in options and name != "tls":
            raise InvalidArgument(f"{where}: query {name!r} given twice")
        if name in URL_SECONDS:
            options[name] = _url_seconds(value, name, where)
        elif name in URL_STRINGS:
            if not value:
                raise InvalidArgument(f"{where}: query {name!r} is empty")
            options[name] = value
        else:
            raise InvalidArgument(f"{where}: unknown query {name!r} (known: "
                                  f"{', '.join(URL_SECONDS + URL_STRINGS)})")
    return Target(addresses, options)


def _url_seconds(value: str, name: str, where: str) -> float:
    seconds = _float_or_none(value)
    if seconds is None or seconds < 0 or (seconds == 0 and name == "timeout"):
        raise InvalidArgument(f"{where}: query {name}={value!r} is not "
                              f"{'seconds > 0' if name == 'timeout' else 'seconds >= 0'}")
    return seconds


def _float_or_none(text: str) -> float | None:
    """`text` as a finite float, or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _addresses(items: list) -> list[Address]:
    out: list[Address] = []
    for item in items:
        if isinstance(item, str) and "://" in item:
            raise InvalidArgument(f"a URL ({item.split('://')[0]}://...) must be the "
                                  f"whole of the hosts, not one of several")
        if isinstance(item, str):
            host, sep, port_text = item.strip().rpartition(":")
            if not sep or not host or not port_text.isdigit():
                raise InvalidArgument(f"address {item!r} is not host:port")
            port = int(port_text)
            host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        elif (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], int) and not isinstance(item[1], bool)):
            host, port = item
        else:
            raise InvalidArgument(f"address {item!r} is neither 'host:port' nor (host, port)")
        if not 0 < port < 65536:
            raise InvalidArgument(f"address {item!r}: port out of range")
        out.append((host, port))
    if not out:
        raise InvalidArgument("no server address given")
    return out


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def absolute_time(value: object, name: str, now_s: float) -> float | None:
    """`delay`/`ttl` as absolute unix seconds; None for None (see "Time" in
    the package docstring)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.timestamp()  # naive: local time, as datetime.now() gives
    if isinstance(value, timedelta):
        return now_s + value.total_seconds()
    if _is_number(value):
        if not math.isfinite(value):
            raise InvalidArgument(f"{name} must be finite")
        return value if value >= ABSOLUTE_TIME_FROM else now_s + value
    raise InvalidArgument(f"{name} must be seconds, a datetime or a timedelta, "
                          f"not {type(value).__name__}")


def wire_retry(value: object) -> int:
    """`retry` as whole seconds, rounded up (None: 0)."""
    if value is None:
        return 0
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if not _is_number(value) or not math.isfinite(value):
        raise InvalidArgument(f"retry must be seconds or a timedelta, not {value!r}")
    if value < 0:
        raise InvalidArgument("retry must not be negative")
    return math.ceil(value)


def produce_request(queue: object, data: object, delay: object = None, ttl: object = None,
                    retry: object = 0, now_s: float | None = None, *, priority: object = None,
                    dedup_id: object = None) -> dict:
    """The wire request of one produce, validated. Fields go only when they
    say something (a request without priority and dedup_id is today's, byte
    for byte). `priority` must be an int and `dedup_id` a str; their ranges
    (0 to 2^31-1; 1 to 128 characters) are the server's to judge, as are
    names."""
    obj: dict = {"action": 1, "queue": _queue_name(queue)}
    now = time.time() if now_s is None else now_s
    obj.update(_message_fields(data, delay, ttl, retry, priority, dedup_id, now))
    return obj


def _produce_options(delay: object, ttl: object, retry: object, priority: object,
                     now: float) -> dict:
    """The wire fields of a produce's options that say something."""
    obj: dict = {}
    # Whole seconds, rounded up: never ready (or expired) before the time asked.
    delay_s = absolute_time(delay, "delay", now)
    if delay_s is not None and delay_s > now:  # a past delay: ready now
        obj["delay"] = math.ceil(delay_s)
    ttl_s = absolute_time(ttl, "ttl", now)
    if ttl_s is not None:
        obj["ttl"] = math.ceil(ttl_s)
    retry_s = wire_retry(retry)
    if retry_s:
        obj["retry"] = retry_s
    if priority is not None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidArgument(f"priority must be an integer, not {priority!r}")
        obj["priority"] = priority
    return obj


def _message_fields(data: object, delay: object, ttl: object, retry: object, priority: object,
                    dedup_id: object, now: float) -> dict:
    """One message's wire fields: `data`, then the options that say something."""
    if not isinstance(data, str):
        raise InvalidArgument(f"data must be a string, not {type(data).__name__}")
    obj: dict = {"data": data}
    obj.update(_produce_options(delay, ttl, retry, priority, now))
    if dedup_id is not None:
        if not isinstance(dedup_id, str):
            raise InvalidArgument(f"dedup_id must be a string, not {type(dedup_id).__name__}")
        obj["dedup_id"] = dedup_id
    return obj


def _item_message(item: object, index: int, now_s: float) -> tuple[str, dict]:
    """A `produce_many` item as its queue and its message's wire fields
    (those of a batch's message; with `action` and `queue` before them, its
    single produce)."""
    if not isinstance(item, dict):
        raise InvalidArgument(f"item {index}: must be a dict, not {type(item).__name__}")
    if not item.keys() <= PRODUCE_KEYS:
        unknown = item.keys() - PRODUCE_KEYS
        raise InvalidArgument(f"item {index}: unknown key(s) {sorted(map(str, unknown))}")
    if "queue" not in item or "data" not in item:
        raise InvalidArgument(f"item {index}: needs 'queue' and 'data'")
    try:
        queue = _queue_name(item["queue"])
        get = item.get
        return queue, _message_fields(item["data"], get("delay"), get("ttl"), get("retry"),
                                      get("priority"), get("dedup_id"), now_s)
    except InvalidArgument as exc:
        raise InvalidArgument(f"item {index}: {exc}") from None


def _single(queue: str, message: dict) -> dict:
    """The single produce of one message (as `produce_request` builds it)."""
    obj = {"action": 1, "queue": queue}
    obj.update(message)
    return obj


def batch_message(item: object, index: int, now_s: float, defaults: dict) -> dict:
    """A `produce_batch` item (a str, the data; or a dict of MESSAGE_KEYS)
    as one message of a batch request whose batch-wide fields are
    `defaults` (the wire fields of the call's delay, ttl, retry, priority:
    the server applies them to every message that lacks its own)."""
    if isinstance(item, str):
        return {"data": item}
    if not isinstance(item, dict):
        raise InvalidArgument(f"item {index}: must be a string or a dict, "
                              f"not {type(item).__name__}")
    unknown = item.keys() - MESSAGE_KEYS
    if unknown:
        raise InvalidArgument(f"item {index}: unknown key(s) {sorted(map(str, unknown))}")
    if "data" not in item:
        raise InvalidArgument(f"item {index}: needs 'data'")
    try:
        obj = _message_fields(item["data"], item.get("delay"), item.get("ttl"),
                              item.get("retry"), item.get("priority"), item.get("dedup_id"),
                              now_s)
    except InvalidArgument as exc:
        raise InvalidArgument(f"item {index}: {exc}") from None
    # An item's own delay already past, or retry 0, is left out of a single
    # produce (it says nothing); beside a batch-wide default it must be said,
    # or the default would apply.
    for key in ("delay", "retry"):
        if key in defaults and key not in obj and item.get(key) is not None:
            obj[key] = 0
    return obj


def _batch_spans(base: dict, messages: Sequence[dict],
                 max_bytes: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each batch request of `messages`, in order: at most
    MAX_BATCH messages each and, unless a message alone is larger, at most
    `max_bytes` encoded (seq included)."""
    fixed = len(orjson.dumps(dict(base, messages=[]))) + SEQ_ALLOWANCE
    start, size = 0, fixed
    for i, message in enumerate(messages):
        n = len(orjson.dumps(message)) + 1  # and a comma
        if i > start and (i - start == MAX_BATCH or size + n > max_bytes):
            yield start, i
            start, size = i, fixed
        size += n
    if start < len(messages):
        yield start, len(messages)


def _batch_items(items: object) -> list:
    if isinstance(items, (str, bytes, dict)) or not isinstance(items, Iterable):
        raise InvalidArgument("items must be a list (or another iterable) of messages")
    return list(items)


def _batch_limits(window: object, max_request_bytes: object) -> None:
    for name, value in (("window", window), ("max_request_bytes", max_request_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgument(f"{name} must be a positive integer, not {value!r}")


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What `produce_batch_result` produced: `msg_ids` in input order (an
    int for a real queue; for a virtual queue {real_queue: msg_id}, every
    message created), and `duplicates`, the input indexes whose `dedup_id`
    the queue had accepted within its dedup_window: nothing was stored for
    them, and their msg_id is the first produce's."""

    msg_ids: list
    duplicates: list[int]


# "messages[3]: data must be a string": a batch refused for one message.
_MESSAGE_INDEX = re.compile(r"messages\[(\d+)\]:")


class _ProducePlan:
    """The requests of a `produce_batch` or `produce_many` call, and how
    their answers become msg_ids in input order.

    Every request covers a span of the input: a batch (action 1 with
    `messages`: one log entry, all or nothing) or one single produce.
    `produce_batch` sends batches only (`batch`); `produce_many` sends a run
    of items that share a queue as batches and a lone item as a single
    produce (`many`), and when a batch is refused (a full or paused queue, a
    bad message, a node that predates batches, one whose max_request_size is
    lower) it sends the items of every request not yet done as single
    produces (`settle_many`): the refused batch stored nothing, and the
    first single refusal then raises with the index of its item, as before
    batches (the items before it that fit are stored).
    """

    def __init__(self, count: int, entries: list[tuple[str, dict]] | None = None) -> None:
        self.requests: list[dict] = []
        self.spans: list[tuple[int, int]] = []  # the items of requests[r]: [start, end)
        self.ids: list = [None] * count  # an item's answered id (None until then)
        self.duplicates: list[int] = []
        self.old_server = False  # a batch was refused as a node without batches does
        self._entries = entries  # produce_many: each item's queue and message

    @classmethod
    def batch(cls, queue: object, items: object, delay: object, ttl: object, retry: object,
              priority: object, now_s: float, max_bytes: int) -> _ProducePlan:
        name = _queue_name(queue)
        defaults = _produce_options(delay, ttl, retry, priority, now_s)
        messages = [batch_message(item, i, now_s, defaults)
                    for i, item in enumerate(_batch_items(items))]
        plan = cls(len(messages))
        plan._add_batches({"action": 1, "queue": name, **defaults}, messages, 0, max_bytes)
        return plan

    @classmethod
    def many(cls, items: Iterable[dict], now_s: float, max_bytes: int,
             batches: bool) -> _ProducePlan:
        entries = [_item_message(item, i, now_s) for i, item in enumerate(items)]
        plan = cls(len(entries), entries)
        i, n = 0, len(entries)
        while i < n:
            queue = entries[i][0]
            j = i + 1
            while batches and j < n and entries[j][0] == queue:
                j += 1
            if j - i == 1:
                plan.requests.append(_single(queue, entries[i][1]))
                plan.spans.append((i, j))
            else:
                messages = [message for _, message in entries[i:j]]
                plan._add_batches({"action": 1, "queue": queue}, messages, i, max_bytes)
            i = j
        return plan

    def _add_batches(self, base: dict, messages: list[dict], offset: int,
                     max_bytes: int) -> None:
        for start, end in _batch_spans(base, messages, max_bytes):
            self.requests.append(dict(base, messages=messages[start:end]))
            self.spans.append((offset + start, offset + end))

    def _take(self, r: int, response: dict) -> None:
        start, end = self.spans[r]
        if "messages" not in self.requests[r]:
            self.ids[start] = response["msg_id"]
            if response.get("duplicate") is True:
                self.duplicates.append(start)
            return
        ids = response.get("msg_ids")
        if not isinstance(ids, list) or len(ids) != end - start:
            raise ServerError(-1, f"a batch of {end - start} answered without as many msg_ids",
                              response, start)
        self.ids[start:end] = ids
        for i in response.get("duplicates") or ():
            if type(i) is int and 0 <= i < end - start:
                self.duplicates.append(start + i)

    def _refusal(self, r: int, response: dict) -> ServerError:
        """The error of request r's refusal, `index` its item: the message
        a batch's reason names, else the request's first item."""
        start, end = self.spans[r]
        reason = response.get("reason")
        index = start
        if "messages" in self.requests[r] and isinstance(reason, str):
            match = _MESSAGE_INDEX.match(reason)
            if match and int(match.group(1)) < end - start:
                index = start + int(match.group(1))
        return server_error(response, index)

    def settle_batch(self, results: Sequence[dict | None]) -> None:
        """Reads `produce_batch`'s answers; raises the first refusal (the
        requests before it were stored, and maybe some sent with it)."""
        for r, response in enumerate(results):
            if response is None:
                continue  # not sent, or not answered, after a refusal
            if response.get("code") != 0:
                raise self._refusal(r, response)
            self._take(r, response)

    def settle_many(self, results: Sequence[dict | None]) -> bool:
        """Reads `produce_many`'s answers: True once every item has its id;
        False when a batch was refused and `requests` now holds the single
        produces to send next; raises the first single produce refused."""
        entries = self._entries
        assert entries is not None  # a plan of `many`
        fall_back = False
        for r, response in enumerate(results):
            if response is None:
                continue  # not sent, or not answered, after a refusal
            if response.get("code") == 0:
                self._take(r, response)
            elif "messages" not in self.requests[r]:
                if not fall_back:
                    raise self._refusal(r, response)
            else:
                fall_back = True
                self.old_server = self.old_server or response.get("reason") == MISSING_DATA
        if not fall_back:
            return True
        requests, spans = [], []
        for r, response in enumerate(results):
            if response is None or response.get("code") != 0:
                for i in range(*self.spans[r]):
                    requests.append(_single(*entries[i]))
                    spans.append((i, i + 1))
        self.requests, self.spans = requests, spans
        return False

    def result(self) -> BatchResult:
        return BatchResult(msg_ids=self.ids, duplicates=sorted(self.duplicates))

    def first_ids(self) -> list[int]:
        """`produce_many`'s ids: for a virtual queue, the msg_id in its
        first real queue (a batch answers {real_queue: msg_id})."""
        return [next(iter(i.values())) if isinstance(i, dict) else i for i in self.ids]


def _seconds(value: object, name: str, *, positive: bool) -> int | float | None:
    """A duration argument (seconds or a timedelta) as wire seconds; None
    for None. Sent as given (an int stays an int): the server takes
    fractions of a second for these fields."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if not _is_number(value) or not math.isfinite(value):
        raise InvalidArgument(f"{name} must be seconds or a timedelta, not {value!r}")
    if value < 0 or (positive and value == 0):
        raise InvalidArgument(f"{name} must be {'positive' if positive else 'at least 0'}")
    return value


def _receipt(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"receipt must be a string, not {type(value).__name__}")
    return value


def _queue_name(queue: object) -> str:
    if not isinstance(queue, str):
        raise InvalidArgument(f"queue must be a string, not {type(queue).__name__}")
    return queue


def consume_request(queue: object = None, *, queues: object = None, count: object = None,
                    wait: object = None, lease: object = None) -> dict:
    """The wire request of one consume, validated: from `queue`, or from the
    first of `queues` (a list of names, in order) that has a deliverable
    message. `count`: up to that many messages, and the answer's list form.
    `wait`: seconds the server may hold the request while nothing is
    deliverable (a long poll; 0 or None: answer at once). `lease`: seconds
    until an unconfirmed at-least-once delivery comes back, instead of the
    message's retry. Types and signs are checked here (`InvalidArgument`);
    the server checks names and upper bounds (count 1000, 16 queues, its
    max_wait)."""
    obj: dict = {"action": 2}
    if queues is None:
        if queue is None:
            raise InvalidArgument("give a queue, or several as queues=[...]")
        if not isinstance(queue, str):
            raise InvalidArgument(f"queue must be a string, not {type(queue).__name__} "
                                  f"(several queues go in queues=[...])")
        obj["queue"] = queue
    else:
        if queue is not None:
            raise InvalidArgument("give queue or queues, not both")
        if isinstance(queues, (str, bytes)) or not isinstance(queues, Iterable):
            raise InvalidArgument("queues must be a list of queue names")
        names = list(queues)
        if not names:
            raise InvalidArgument("queues must name at least one queue")
        for name in names:
            _queue_name(name)
        obj["queues"] = names
    if count is not None:
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise InvalidArgument(f"count must be a positive integer, not {count!r}")
        obj["count"] = count
    wait_s = _seconds(wait, "wait", positive=False)
    if wait_s:  # 0: answer at once, as a request without wait (and as old servers do)
        obj["wait"] = wait_s
    lease_s = _seconds(lease, "lease", positive=True)
    if lease_s is not None:
        obj["lease"] = lease_s
    return obj


def confirm_request(queue: object, msg_id: object, receipt: object = None) -> dict:
    """The wire request of a confirm: by id (wherever the message is), or of
    the delivery `receipt` names."""
    obj = {"action": 3, "queue": _queue_name(queue), "msg_id": msg_id}
    if _receipt(receipt) is not None:
        obj["receipt"] = receipt
    return obj


def nack_request(queue: object, msg_id: object, receipt: object = None,
                 delay: object = None) -> dict:
    """The wire request of a nack (action 9). `delay`: seconds from now
    (int, float or timedelta; default 0), an absolute unix time (a number >=
    1,000,000,000, as on the wire) or a `datetime`; the server times it (a
    relative delay is sent as given, not converted with this machine's
    clock)."""
    obj = {"action": 9, "queue": _queue_name(queue), "msg_id": msg_id}
    if _receipt(receipt) is not None:
        obj["receipt"] = receipt
    if isinstance(delay, datetime):
        obj["delay"] = delay.timestamp()  # naive: local time, as produce's
    else:
        delay_s = _seconds(delay, "delay", positive=False)
        if delay_s:
            obj["delay"] = delay_s
    return obj


def touch_request(queue: object, msg_id: object, receipt: object = None,
                  lease: object = None) -> dict:
    """The wire request of a touch (action 10): the delivery comes back
    `lease` seconds from now (default: the message's retry)."""
    obj = {"action": 10, "queue": _queue_name(queue), "msg_id": msg_id}
    if _receipt(receipt) is not None:
        obj["receipt"] = receipt
    lease_s = _seconds(lease, "lease", positive=True)
    if lease_s is not None:
        obj["lease"] = lease_s
    return obj


def show_request(queue: object, msg_id: object) -> dict:
    return {"action": 11, "queue": _queue_name(queue), "msg_id": msg_id}


def peek_request(queue: object, count: object = 1) -> dict:
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise InvalidArgument(f"count must be a positive integer, not {count!r}")
    return {"action": 12, "queue": _queue_name(queue), "count": count}


def config_request(queue: object, settings: dict | None = None) -> dict:
    """The wire request of action 5: a read, or a change of `settings` (the
    server names an unknown setting or a bad value)."""
    obj: dict = {"action": 5, "queue": _queue_name(queue)}
    if settings:
        try:
            orjson.dumps(settings)
        except TypeError as exc:
            raise InvalidArgument(f"settings cannot be encoded as JSON: {exc}") from None
        obj["set"] = dict(settings)
    return obj


def clear_request(queue: object) -> dict:
    """The wire request of a clear (action 6): every message of `queue` goes."""
    return {"action": 6, "queue": _queue_name(queue)}


def pause_request(queue: object, what: object = "all") -> dict:
    """The config change that pauses `queue`: "in" (produce refused), "out"
    (nothing delivered) or "all"."""
    if what not in PAUSE_WHAT:
        raise InvalidArgument(f"pause what must be one of {', '.join(PAUSE_WHAT)}, not {what!r}")
    return config_request(queue, {"paused": what})


def transfer_leader_request(node_id: object) -> dict:
    """The wire request of a leader transfer (action 20) to node `node_id`."""
    if not isinstance(node_id, int) or isinstance(node_id, bool) or node_id < 1:
        raise InvalidArgument(f"node_id must be a positive integer, not {node_id!r}")
    return {"action": 20, "node_id": node_id}


def drain_request(undo: object = False) -> dict:
    """The wire request of a drain (action 108), or of its undo."""
    if not isinstance(undo, bool):
        raise InvalidArgument(f"undo must be True or False, not {undo!r}")
    return {"action": 108, "drain": not undo}


# What a node may hold a leader transfer (20) or a master's drain (108)
# before it answers: the transfer's bounds (an election timeout to catch up,
# one to win) for each of a drain's hand-over tries, with room to spare.
HELD_ACTION_S = {20: 5.0, 108: 10.0}


def request_wait_s(obj: dict) -> float:
    """The seconds a server may hold `obj` before answering: a consume's
    `wait`, or HELD_ACTION_S for a transfer or a drain. The driver waits
    that long more than its timeout, and a request held at all goes on a
    connection of its own (a long poll's), where it holds up no other
    call's answers."""
    action = obj.get("action")
    if action in HELD_ACTION_S:
        return HELD_ACTION_S[action]
    wait = obj.get("wait") if action == 2 else None
    return float(wait) if _is_number(wait) and math.isfinite(wait) and wait > 0 else 0.0


def server_error(response: dict, index: int | None = None) -> ServerError:
    """The typed exception for a refusing answer."""
    reason = str(response.get("reason", "unknown error"))
    code = response.get("code", -1)
    cls: type[ServerError]
    if reason == NO_LEADER:
        cls = NoLeader
    elif reason.startswith(QUEUE_FULL_PREFIX):
        cls = QueueFull
    elif reason == STALE_RECEIPT:
        cls = StaleReceipt
    elif reason == NOT_IN_FLIGHT:
        cls = NotInFlight
    elif reason == QUEUE_PAUSED or reason.startswith(QUEUE_PAUSED + ":"):
        cls = QueuePaused
    elif reason.startswith(UNAUTHORIZED):
        cls = Unauthorized
    else:
        cls = ServerError
    return cls(code if isinstance(code, int) else -1, reason, response, index)


def _checked(response: dict) -> dict:
    if response.get("code") != 0:
        raise server_error(response)
    return response


def _delivery_fields(item: dict, queue: object) -> dict[str, Any]:
    deliveries = item.get("deliveries")
    receipt = item.get("receipt")
    return {"queue": item.get("queue", queue), "msg_id": item["msg_id"], "data": item["data"],
            "deliveries": deliveries if type(deliveries) is int else None,
            "receipt": receipt if isinstance(receipt, str) else None}


def _consumed(request: dict, response: dict) -> list[dict[str, Any]]:
    """The deliveries of a consume's answer, in delivery order, each as the
    keyword arguments of a `Message`: queue, msg_id, data, deliveries,
    receipt. Reads both forms: the list (`messages`, asked with `count`)
    and the single message (`msg_id`, `data`), which is also what a server
    that predates `count` answers to it."""
    _checked(response)
    queue = request.get("queue")
    items = response.get("messages")
    if isinstance(items, list):
        return [_delivery_fields(item, queue) for item in items]
    if "msg_id" not in response:
        return []
    return [_delivery_fields(response, queue)]


def _found(response: dict) -> bool:
    """A confirm's `found`; True from a server that does not say."""
    return _checked(response).get("found") is not False


def _new_fields(request: dict, response: dict) -> dict:
    """What an answer adds to its request (answers echo the request)."""
    _checked(response)
    return {k: v for k, v in response.items() if k not in request and k not in ("code", "seq")}


def _shown(response: dict) -> dict | None:
    if response.get("code") == -1 and response.get("reason") == NO_SUCH_MESSAGE:
        return None
    return _checked(response)["message"]


def _cleared(response: dict) -> int:
    return _checked(response)["cleared"]


def _produced_ids(queue: str, response: dict) -> dict[str, int]:
    _checked(response)
    ids = response.get("msg_ids")
    return dict(ids) if isinstance(ids, dict) else {queue: response["msg_id"]}


def _result_fields(response: dict) -> dict:
    _checked(response)
    return {k: v for k, v in response.items() if k not in _ECHO_FIELDS}


def _leader_fields(response: dict) -> dict:
    _checked(response)
    return {k: response[k] for k in ("leader_node_id", "leader_host", "leader_port")}


def _monitor_request(queue: str | None, local: bool) -> dict:
    obj: dict = {"action": 104 if local else 4}
    if queue is not None:
        obj["queue"] = queue
    return obj


def _raw_request(obj: object) -> tuple[dict, object]:
    if not isinstance(obj, dict):
        raise InvalidArgument(f"a request must be a dict, not {type(obj).__name__}")
    obj = dict(obj)
    user_seq = obj.pop("seq", _NO_SEQ)
    try:
        orjson.dumps(obj)
    except TypeError as exc:
        raise InvalidArgument(f"request cannot be encoded as JSON: {exc}") from None
    return obj, user_seq


def _raw_answer(response: dict, user_seq: object) -> dict:
    response.pop("seq", None)
    if user_seq is not _NO_SEQ:
        response["seq"] = user_seq
    return response


_NO_SEQ = object()


# -- the consumer helpers' long polls (no I/O) -----------------------------------


def shorter_long_poll(wait_s: float, error: ServerError) -> float | None:
    """The long poll to try after `error` refused one of `wait_s` seconds:
    half as long when the node's max_wait is lower ("wait out of range"),
    0 (plain polls) below MIN_LONG_POLL_S; None when `error` is another
    refusal (to be raised)."""
    if error.reason != WAIT_OUT_OF_RANGE or wait_s <= 0:
        return None
    half = wait_s / 2
    return half if half >= MIN_LONG_POLL_S else 0.0


class _Polling:
    """The pause before the consumer helpers' next long poll.

    A long poll comes back empty when its wait is over, and then the next
    one goes at once. An empty answer much sooner (in less than half the
    wait, or to a request without wait) means the node could not hold it: a
    master that lost its role answers its parked consumes at once (the next
    poll finds the new master), a node that predates long polls ignores
    `wait`, a node with max_wait 0 takes none. The first such answer is
    followed by a new poll at once, each further one in a row by a pause
    that doubles from POLL_MIN_S to POLL_MAX_S: against such a node the
    helpers poll as they did before long polls, instead of spinning.
    """

    def __init__(self) -> None:
        self._pause_s = 0.0  # the pause after the next early empty answer

    def pause_after(self, delivered: bool, wait_s: float, took_s: float) -> float:
        """Seconds to pause before the next poll, after one that asked to
        wait `wait_s`, took `took_s` and `delivered` something or nothing."""
        if delivered or (wait_s > 0 and took_s >= wait_s / 2):
            self._pause_s = 0.0
            return 0.0
        pause = self._pause_s
        self._pause_s = min(max(pause * 2, POLL_MIN_S), POLL_MAX_S)
        return pause


# -- the exchange and the retry policy (no I/O) --------------------------------


class _BrokenStream(Exception):
    """The node sent something that is not the answer expected next."""


class _Exchange:
    """A batch of requests and their answers, whatever the connection.

    `take()` gives the bytes of the requests that fit in the window;
    `feed(answer)` matches an answer to the oldest request in flight;
    `connection_lost()` puts every request in flight back to be sent again.
    After a redirect or a retriable refusal the exchange is `halted`: it
    sends nothing new, and once the answers in flight are in (`idle`) the
    driver moves to another node and calls `resume()`.
    """

    def __init__(self, requests: Sequence[dict], window: int, seqs: Iterator[int], *,
                 stop_on_error: bool, batch_window: int | None = None) -> None:
        self.requests = requests
        self.results: list[dict | None] = [None] * len(requests)
        self.answered = 0  # final answers so far
        self.window = window
        # At most this many batch produces (requests with `messages`) in
        # flight, within `window` (None: no such limit).
        self.batch_window = batch_window
        self._batches = 0  # batch produces in flight
        self.stop_on_error = stop_on_error
        self.redirect: Address | None = None
        self.retry_error: ServerError | None = None
        self.failed: int | None = None  # index of the first refusal, with stop_on_error
        self._seqs = seqs
        self._next = 0  # next request never sent
        self._resend: deque[int] = deque()
        self._in_flight: deque[tuple[int, int]] = deque()  # (seq, index)

    @property
    def halted(self) -> bool:
        return self.redirect is not None or self.retry_error is not None or self.failed is not None

    @property
    def idle(self) -> bool:
        return not self._in_flight

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._in_flight)

    @property
    def finished(self) -> bool:
        if self.failed is not None:
            return not self._in_flight
        return self.answered == len(self.requests)

    def take(self) -> bytes:
        if self.halted:
            return b""
        parts = []
        in_flight = self._in_flight
        batch_window = self.batch_window
        while len(in_flight) < self.window:
            if self._resend:
                index = self._resend[0]
            elif self._next < len(self.requests):
                index = self._next
            else:
                break
            if batch_window is not None and "messages" in self.requests[index]:
                if self._batches >= batch_window:
                    break  # in order: the next request waits for room
                self._batches += 1
            if self._resend:
                self._resend.popleft()
            else:
                self._next += 1
            seq = next(self._seqs)
            obj = self.requests[index].copy()
            obj["seq"] = seq
            parts.append(orjson.dumps(obj))
            in_flight.append((seq, index))
        return b"".join(parts)

    def feed(self, response: object) -> None:
        if not self._in_flight:
            raise _BrokenStream("an answer to no request")
        if type(response) is not dict:
            raise _BrokenStream("an answer that is not a JSON object")
        seq, index = self._in_flight.popleft()
        if self.batch_window is not None and "messages" in self.requests[index]:
            self._batches -= 1
        echoed = response.get("seq")
        # Relayed "no leader"/"outcome unknown" answers carry no seq.
        if echoed is not None and echoed != seq:
            raise _BrokenStream(f"answer for seq {echoed} where {seq} was due")
        code = response.get("code")
        if code == -2:
            host, port = response.get("leader_host"), response.get("leader_port")
            if isinstance(host, str) and host and isinstance(port, int) and 0 < port < 65536:
                self.redirect = (host, port)
            else:
                self.retry_error = NoLeader(-2, "redirect without a leader address", response)
            self._resend.append(index)
            return
        reason = response.get("reason")
        if code == -1 and isinstance(reason, str) and (
                reason == NO_LEADER or reason.endswith(OUTCOME_UNKNOWN_SUFFIX)):
            self.retry_error = server_error(response, None)
            self._resend.append(index)
            return
        self.results[index] = response
        self.answered += 1
        if code != 0 and self.stop_on_error and self.failed is None:
            self.failed = index

    def connection_lost(self) -> None:
        self._resend.extend(index for _, index in self._in_flight)
        self._in_flight.clear()
        self._batches = 0

    def resume(self) -> None:
        self.redirect = None
        self.retry_error = None


class _Router:
    """Which node to ask next and how long to keep trying (see the package
    docstring). Sticks to a node while it serves. `addresses` is the
    client's list in its order (shuffled once per client, or as given);
    `rng` draws the backoff's jitter."""

    def __init__(self, addresses: list[Address], retry_for_s: float,
                 start: Address | None = None, *, rng: random.Random) -> None:
        self.addresses = addresses
        self.retry_for_s = retry_for_s
        self._rng = rng
        self._i = 0
        self.redirect_to: Address | None = None
        if start is not None:  # where another router is (a redirect's target, say)
            if start in addresses:
                self._i = addresses.index(start)
            else:
                self.redirect_to = start
        self.begin()

    @property
    def address(self) -> Address:
        return self.redirect_to or self.addresses[self._i]

    def begin(self) -> None:
        """A new exchange, or progress in the current one: a fresh budget."""
        self._deadline: float | None = None
        self._failures = 0
        self._redirects = 0
        self._backoff_s = BACKOFF_MIN_S  # the ceiling of the next pause

    def redirected(self, address: Address, error: Exception, now_s: float) -> float:
        """Follow a redirect; returns the seconds to wait first."""
        self._redirects += 1
        if self._redirects <= MAX_REDIRECTS:
            self.redirect_to = address
            return 0.0
        delay = self.failed(error, now_s)
        self.redirect_to = address
        return delay

    def failed(self, error: Exception, now_s: float) -> float:
        """The current node failed: move on; returns the seconds to wait
        before the next attempt, or raises `error` when the time is up."""
        if self.redirect_to is None:
            self._i = (self._i + 1) % len(self.addresses)
        self.redirect_to = None
        self._failures += 1
        if self._deadline is None:
            self._deadline = now_s + self.retry_for_s
        n = len(self.addresses)
        if self._failures >= n and now_s >= self._deadline:
            raise error
        if self._failures % n:
            return 0.0  # another node may serve at once
        # Full jitter: anywhere from 0 to the ceiling, never past the deadline.
        delay = min(self._rng.random() * self._backoff_s, max(0.0, self._deadline - now_s))
        self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
        return delay


class _Lines:
    """Newline-framed JSON answers out of a byte stream."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        self._buf += data
        if b"\n" not in data:
            return []
        *lines, rest = self._buf.split(b"\n")
        self._buf = bytearray(rest)
        try:
            return [orjson.loads(line) for line in lines if line.strip()]
        except orjson.JSONDecodeError as exc:
            raise _BrokenStream(f"an answer that is not JSON: {exc}") from None


def _describe(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


# -- authentication and TLS (action 0, <tls>: README, Authentication and TLS) ----


@dataclass(frozen=True, slots=True)
class Security:
    """How a client's connections present themselves: `token` is sent as
    action 0 first thing on every new connection (`auth_bytes`; its answer
    is the first one the connection reads, `check_auth`), and
    `ssl_context` (None: plain TCP) wraps each connection in TLS, checking
    the node's certificate for `server_hostname` (None: the host dialed)."""

    token: str | None = field(default=None, repr=False)  # never printed
    ssl_context: ssl.SSLContext | None = None
    server_hostname: str | None = None
    # action 0 with the token, as sent on every new connection
    auth_bytes: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "auth_bytes", orjson.dumps({"action": 0, "token": self.token}))

    def hostname(self, address: Address) -> str:
        return self.server_hostname or address[0]


def security(token: object = None, tls: object = False, tls_ca: object = None,
             tls_cert: object = None, tls_key: object = None,
             tls_server_hostname: object = None,
             ssl_context: object = None) -> Security | None:
    """The clients' `token` and TLS arguments, checked; None when there are
    none (plain TCP, no action 0). TLS is on with `tls=True`, or when a CA,
    a client certificate or an `ssl_context` is given: `tls_ca` (a PEM
    bundle; default: the system's CAs) checks the node's certificate,
    `tls_cert`/`tls_key` are the client's own (for nodes that ask for
    one), `tls_server_hostname` the name the node's certificate must carry
    (default: the host dialed). `ssl_context` replaces all of these.
    Raises InvalidArgument (a file that cannot be used is named)."""
    if token is not None and (not isinstance(token, str) or not token
                              or any(c.isspace() for c in token)):
        raise InvalidArgument("token must be a non-empty string without white space")
    for name, value in (("tls_ca", tls_ca), ("tls_cert", tls_cert), ("tls_key", tls_key),
                        ("tls_server_hostname", tls_server_hostname)):
        if value is not None and (not isinstance(value, str) or not value):
            raise InvalidArgument(f"{name} must be a non-empty string, not {value!r}")
    files = tls_ca is not None or tls_cert is not None or tls_key is not None
    if ssl_context is not None:
        if not isinstance(ssl_context, ssl.SSLContext):
            raise InvalidArgument(f"ssl_context must be an ssl.SSLContext, not "
                                  f"{type(ssl_context).__name__}")
        if files:
            raise InvalidArgument("give ssl_context or tls_ca/tls_cert/tls_key, not both")
        context: ssl.SSLContext | None = ssl_context
    elif tls or files:
        context = _ssl_context(tls_ca, tls_cert, tls_key)  # type: ignore[arg-type]
    else:
        if tls_server_hostname is not None:
            raise InvalidArgument("tls_server_hostname without TLS (tls=True)")
        context = None
    if token is None and context is None:
        return None
    return Security(token, context, tls_server_hostname)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """What a client runs with, once its arguments, its URL's settings and
    the environment are merged and checked (`client_settings`)."""

    addresses: list[Address]  # in the order given (the client may shuffle them)
    timeout_s: float
    retry_for_s: float
    long_poll_s: float
    security: Security | None


def client_settings(hosts: object, environ: Mapping[str, str], *, timeout: object = None,
                    retry_for: object = None, long_poll: object = None, token: object = None,
                    tls: object = False, tls_ca: object = None, tls_cert: object = None,
                    tls_key: object = None, tls_server_hostname: object = None,
                    ssl_context: object = None) -> ClientSettings:
    """The settings of a client built with these arguments (None: not
    given), `environ` being the process's environment.

    Each setting comes from the first of: the argument; the setting of that
    name in the URL `hosts` is (see `parse_target`); for the hosts,
    `QSERVER_SERVERS` (addresses or a URL, whose settings then count as the
    URL's) and for the timeout, `QSERVER_TIMEOUT`; the default. `tls` is on
    if the argument or the URL (qservers://) says so; with `ssl_context`,
    the URL's tls_ca, tls_cert and tls_key are not used. Raises
    InvalidArgument naming the argument, the variable or the URL part."""
    if hosts is None:
        text = environ.get(SERVERS_ENV, "").strip()
        if not text:
            raise InvalidArgument(f"no server address given: pass the hosts, or set "
                                  f"{SERVERS_ENV} (host:port,host:port or a qserver:// URL)")
        target = parse_target(text, SERVERS_ENV)
    else:
        target = parse_target(hosts)
    url = target.options
    if timeout is None and "timeout" not in url:
        text = environ.get(TIMEOUT_ENV, "").strip()
        if text:
            timeout_s = _float_or_none(text)
            if timeout_s is None or timeout_s <= 0:
                raise InvalidArgument(f"{TIMEOUT_ENV}={text!r}: not a number of seconds > 0")
            timeout = timeout_s
    timeout_s = _setting_s("timeout", timeout, url, DEFAULT_TIMEOUT_S)
    if timeout_s <= 0:
        raise InvalidArgument(f"timeout must be seconds > 0, not {timeout!r}")
    retry_for_s = _setting_s("retry_for", retry_for, url, DEFAULT_RETRY_FOR_S)
    long_poll_s = _setting_s("long_poll", long_poll, url, LONG_POLL_S)

    def pick(name: str, given: object) -> object:
        return given if given is not None else url.get(name)

    if ssl_context is None:
        tls_ca, tls_cert, tls_key = (pick("tls_ca", tls_ca), pick("tls_cert", tls_cert),
                                     pick("tls_key", tls_key))
    secure = security(pick("token", token), bool(tls) or url.get("tls", False), tls_ca,
                      tls_cert, tls_key, pick("tls_server_hostname", tls_server_hostname),
                      ssl_context)
    return ClientSettings(target.addresses, timeout_s, retry_for_s, long_poll_s, secure)


def _setting_s(name: str, given: object, url: dict[str, Any], default: float) -> float:
    """A seconds setting: the argument if given (checked), else the URL's
    (checked as it was read), else `default`."""
    if given is None:
        return float(url.get(name, default))
    if not _is_number(given) or not math.isfinite(given) or given < 0:
        raise InvalidArgument(f"{name} must be seconds >= 0, not {given!r}")
    return float(given)


def _ssl_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    if key is not None and cert is None:
        raise InvalidArgument("tls_key without tls_cert")
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument(f"tls_ca={ca!r}: {_ssl_problem(exc)}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(f"tls_cert={cert!r}, tls_key={key!r}: "
                                  f"{_ssl_problem(exc)}") from None
    return context


def _ssl_problem(exc: Exception) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return exc.reason.lower().replace("_", " ")
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def check_auth(response: object) -> None:
    """The answer to a connection's action 0: returns if the node took the
    token (or has no <security>: code 0; a node that predates action 0
    answers "invalid action", and has none either); else raises
    Unauthorized (or _BrokenStream for something that is no answer)."""
    if type(response) is not dict:
        raise _BrokenStream("an answer that is not a JSON object")
    if response.get("code") == 0:
        return
    reason = response.get("reason")
    if reason == INVALID_ACTION:
        return
    raise Unauthorized(-1, str(reason) if reason else UNAUTHORIZED, response)

