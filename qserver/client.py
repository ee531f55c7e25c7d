"""The Python client of qserver: `Client` (blocking) and `AsyncClient`
(asyncio), with the same methods.

    with Client(["127.0.0.1:1111", "127.0.0.1:1112"]) as c:
        msg_id = c.produce("orders", "close order 42", delay=30, retry=60)
        ids = c.produce_many({"queue": "orders", "data": f"o{i}"} for i in range(5000))
        with c.process("orders") as msg:       # confirmed if the block succeeds
            if msg is not None:
                handle(msg.data)

Methods: `produce` (returns the msg_id), `produce_ids` (returns {real queue:
msg_id}, the way to see every message a virtual queue created),
`produce_many`, `consume` (a `Message` or None), `confirm`, `monitor`,
`list`, `leader`, and `request` for a raw request. Consumer helpers:
`process(queue)` (one message, confirmed when the `with` block succeeds,
left to the server's retry when it raises) and `messages(queue)` (an
iterator of `Delivery` objects that work the same way).

Theory of operation
-------------------
A client holds one TCP connection at a time, to one node of the list it was
given, and keeps it between calls (opened on first use). Every call goes
through one pipelined exchange: requests are written while earlier answers
are still coming, at most `window` in flight, each tagged with a `seq` the
node echoes; answers come back in order and are matched by position (and
checked by `seq`). A single request is an exchange of one.

What happens to an answer:
- code 0, or code -1 for a reason that will not change by asking again
  (bad input, "queue full", "time error"): the final answer.
- code -2 (the node is a slave with `forward_request="0"`): the request is
  sent again to `leader_host:leader_port`, and the client stays with that
  node for later calls.
- code -1 "no leader" (an election in progress) or "...; outcome unknown"
  (the master went away while a slave forwarded the request): the request
  is sent again, to the next node, after a short backoff.
- no answer (connection refused, reset, closed, or silent for `timeout`
  seconds): the unanswered requests are sent again to the next node.

Retries go on for `retry_for` seconds after the first failure without
progress (every node is tried at least once, whatever `retry_for`), with a
backoff that doubles from 50 ms to 1 s after each round of the node list;
then the last error is raised: `NoLeader`, `ClientConnectionError`,
`ClientTimeout`, or `ServerError`. Errors are in `qserver.errors`, rooted at
`QServerClientError`.

Delivery guarantees of the resends: a request whose answer was lost may have
taken effect. A produce sent again may therefore be stored twice
(at-least-once: the caller sees one msg_id, the other message is delivered
too); a consume sent again may have delivered a message to the lost
connection, which then comes back after its `retry` seconds (retry > 0) or
is gone (retry = 0, at-most-once). Confirms are idempotent. A `produce_many`
whose connection dies mid-batch sends every unanswered item again on another
node: each item is stored at least once, and the returned msg_ids are those
of the answers received.

Time: `delay` and `ttl` take seconds relative to now (int or float), an
absolute unix time (a number >= 1,000,000,000, as on the wire), a
`datetime` (naive = local time) or a `timedelta`; the client sends whole
absolute unix seconds (design.md, section 1), rounded up so that a message is
never ready before the time asked for. A delay that is already past is left
out (ready now). `ttl` counts from now, not from the delay. `retry` takes
seconds or a `timedelta`.

A `Client` may be shared by threads (calls are serialized); an `AsyncClient`
by tasks of one event loop (likewise). For parallel throughput use
`produce_many` or one client per thread or task.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import select
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

import orjson

from .errors import (
    ClientConnectionError,
    ClientTimeout,
    InvalidArgument,
    NoLeader,
    QueueFull,
    ServerError,
)

__all__ = [
    "Client",
    "AsyncClient",
    "Message",
    "Delivery",
    "AsyncDelivery",
    "parse_hosts",
    "produce_request",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_RETRY_FOR_S",
    "DEFAULT_WINDOW",
]

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

# Backoff after a full round of failed nodes: starts small (a redirect target
# or a fresh master is usually there at once), doubles to a ceiling that
# still notices a new master within a second.
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 1.0

# Redirects followed at once, per exchange; past this (leaders pointing at
# each other during an election) redirects count as failures, with backoff.
MAX_REDIRECTS = 5

# Polling of the consumer helpers (the protocol has no blocking consume):
# quick while messages flow, backing off to a few requests per second on an
# idle queue.
POLL_MIN_S = 0.01
POLL_MAX_S = 0.5

# Bytes asked of the socket per read.
RECV_SIZE = 256 * 1024

# design.md, section 1: a wire time below this is seconds relative to now.
ABSOLUTE_TIME_FROM = 1_000_000_000

# Reasons for which asking again (elsewhere, a little later) can succeed:
# the server's words (service.py, cluster.py, replication/native.py).
NO_LEADER = "no leader"
OUTCOME_UNKNOWN_SUFFIX = "outcome unknown"

# The server's reason for a full queue is "queue full: NAME" (store.py).
QUEUE_FULL_PREFIX = "queue full:"

PRODUCE_KEYS = frozenset({"queue", "data", "delay", "ttl", "retry"})

# Fields of an answer that echo the request or frame it, not its result.
_ECHO_FIELDS = ("action", "code", "seq", "queue", "pattern")

Address = tuple[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One consumed message."""

    queue: str
    msg_id: int
    data: str


# -- arguments to requests (no I/O) -----------------------------------------


def parse_hosts(hosts: str | Iterable[str | Address]) -> list[Address]:
    """Addresses from "host:port" strings, (host, port) tuples, or one
    comma-separated string. IPv6 literals may be written "[::1]:1111"."""
    if isinstance(hosts, str):
        items: list = [h.strip() for h in hosts.split(",") if h.strip()]
    elif (isinstance(hosts, tuple) and len(hosts) == 2 and isinstance(hosts[0], str)
          and isinstance(hosts[1], int)):
        items = [hosts]
    else:
        items = list(hosts)
    out: list[Address] = []
    for item in items:
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


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def absolute_time(value: object, name: str, now_s: float) -> float | None:
    """`delay`/`ttl` as absolute unix seconds; None for None (see "Time" in
    the module docstring)."""
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
    """`retry` as whole seconds, rounded up."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if not _is_number(value) or not math.isfinite(value):
        raise InvalidArgument(f"retry must be seconds or a timedelta, not {value!r}")
    if value < 0:
        raise InvalidArgument("retry must not be negative")
    return math.ceil(value)


def produce_request(queue: object, data: object, delay: object = None, ttl: object = None,
                    retry: object = 0, now_s: float | None = None) -> dict:
    """The wire request of one produce, validated."""
    if not isinstance(queue, str):
        raise InvalidArgument(f"queue must be a string, not {type(queue).__name__}")
    if not isinstance(data, str):
        raise InvalidArgument(f"data must be a string, not {type(data).__name__}")
    now = time.time() if now_s is None else now_s
    obj: dict = {"action": 1, "queue": queue, "data": data}
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
    return obj


def _item_request(item: object, index: int, now_s: float) -> dict:
    if not isinstance(item, dict):
        raise InvalidArgument(f"item {index}: must be a dict, not {type(item).__name__}")
    unknown = item.keys() - PRODUCE_KEYS
    if unknown:
        raise InvalidArgument(f"item {index}: unknown key(s) {sorted(map(str, unknown))}")
    if "queue" not in item or "data" not in item:
        raise InvalidArgument(f"item {index}: needs 'queue' and 'data'")
    try:
        return produce_request(item["queue"], item["data"], item.get("delay"),
                               item.get("ttl"), item.get("retry", 0), now_s)
    except InvalidArgument as exc:
        raise InvalidArgument(f"item {index}: {exc}") from None


def server_error(response: dict, index: int | None = None) -> ServerError:
    """The typed exception for a refusing answer."""
    reason = str(response.get("reason", "unknown error"))
    code = response.get("code", -1)
    if reason == NO_LEADER:
        cls = NoLeader
    elif reason.startswith(QUEUE_FULL_PREFIX):
        cls = QueueFull
    else:
        cls = ServerError
    return cls(code if isinstance(code, int) else -1, reason, response, index)


def _checked(response: dict) -> dict:
    if response.get("code") != 0:
        raise server_error(response)
    return response


def _message(queue: str, response: dict) -> Message | None:
    if "msg_id" not in _checked(response):
        return None
    return Message(queue=queue, msg_id=response["msg_id"], data=response["data"])


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


def _produce_many_ids(results: list) -> list[int]:
    for index, response in enumerate(results):
        if response is not None and response.get("code") != 0:
            raise server_error(response, index)
    return [response["msg_id"] for response in results]


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
                 stop_on_error: bool) -> None:
        self.requests = requests
        self.results: list[dict | None] = [None] * len(requests)
        self.answered = 0  # final answers so far
        self.window = window
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
    def finished(self) -> bool:
        if self.failed is not None:
            return not self._in_flight
        return self.answered == len(self.requests)

    def take(self) -> bytes:
        if self.halted:
            return b""
        parts = []
        in_flight = self._in_flight
        while len(in_flight) < self.window:
            if self._resend:
                index = self._resend.popleft()
            elif self._next < len(self.requests):
                index = self._next
                self._next += 1
            else:
                break
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

    def resume(self) -> None:
        self.redirect = None
        self.retry_error = None


class _Router:
    """Which node to ask next and how long to keep trying (see the module
    docstring). Sticks to a node while it serves."""

    def __init__(self, addresses: list[Address], retry_for_s: float) -> None:
        self.addresses = addresses
        self.retry_for_s = retry_for_s
        self._i = 0
        self.redirect_to: Address | None = None
        self.begin()

    @property
    def address(self) -> Address:
        return self.redirect_to or self.addresses[self._i]

    def begin(self) -> None:
        """A new exchange, or progress in the current one: a fresh budget."""
        self._deadline: float | None = None
        self._failures = 0
        self._redirects = 0
        self._backoff_s = BACKOFF_MIN_S

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
        delay = min(self._backoff_s, max(0.0, self._deadline - now_s))
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


# -- the blocking client -----------------------------------------------------


class _Connection:
    def __init__(self, address: Address, timeout_s: float) -> None:
        self.address = address
        self.sock = socket.create_connection(address, timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lines = _Lines()

    def close(self) -> None:
        self.sock.close()


class Client:
    """A blocking qserver client over TCP (see the module docstring).

    `hosts`: "host:port" strings or (host, port) tuples, or one
    comma-separated string; any node of the cluster will do, several let the
    client survive the loss of one. `timeout`: seconds one node may stay
    silent. `retry_for`: seconds of retrying (other nodes, no leader) before
    raising. Connects on first use.
    """

    def __init__(self, hosts: str | Iterable[str | Address], *, timeout: float = DEFAULT_TIMEOUT_S,
                 retry_for: float = DEFAULT_RETRY_FOR_S) -> None:
        self.timeout = timeout
        self._router = _Router(parse_hosts(hosts), retry_for)
        self._conn: _Connection | None = None
        self._seqs = itertools.count(1)
        self._lock = threading.Lock()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (a later call opens a new one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @property
    def address(self) -> Address:
        """The node the client talks to (or will try next)."""
        return self._router.address

    # -- requests --------------------------------------------------------

    def request(self, obj: dict) -> dict:
        """Send one raw request (the wire's fields) and return the answer as
        is, code -1 included, except the answers that are retried as for
        every call (redirects, "no leader", "outcome unknown", lost
        connections): those raise `NoLeader`, `ServerError`,
        `ClientConnectionError` or `ClientTimeout` once the retry time is
        up. A `seq` in `obj` comes back in the answer (the client uses its
        own on the wire)."""
        obj, user_seq = _raw_request(obj)
        return _raw_answer(self._exchange([obj], 1, stop_on_error=True)[0], user_seq)

    def _call(self, obj: dict) -> dict:
        return _checked(self._exchange([obj], 1, stop_on_error=True)[0])

    def produce(self, queue: str, data: str, *, delay: object = None, ttl: object = None,
                retry: object = 0) -> int:
        """Produce one message; returns its msg_id. For a virtual queue, the
        msg_id in its first real queue (see `produce_ids`)."""
        return self._call(produce_request(queue, data, delay, ttl, retry))["msg_id"]

    def produce_ids(self, queue: str, data: str, *, delay: object = None, ttl: object = None,
                    retry: object = 0) -> dict[str, int]:
        """Produce one message; returns {real queue: msg_id} for every
        message created: one entry for a plain queue, one per real queue for
        a virtual queue."""
        return _produced_ids(queue, self._call(produce_request(queue, data, delay, ttl, retry)))

    def produce_many(self, items: Iterable[dict], *, window: int = DEFAULT_WINDOW) -> list[int]:
        """Produce many messages, pipelined on one connection; returns their
        msg_ids in the order of `items`.

        Each item is a dict with `queue`, `data` and optional `delay`, `ttl`,
        `retry` (as `produce`). Every item is checked before anything is sent
        (`InvalidArgument`). A refusal stops the batch: `ServerError` (or
        `QueueFull`) with `index` set; items before it, and some sent with
        it, may have been produced. A lost connection sends the unanswered
        items again on another node (at-least-once, see the module
        docstring).
        """
        if window < 1:
            raise InvalidArgument("window must be at least 1")
        now = time.time()
        requests = [_item_request(item, i, now) for i, item in enumerate(items)]
        if not requests:
            return []
        return _produce_many_ids(self._exchange(requests, window, stop_on_error=True))

    def consume(self, queue: str) -> Message | None:
        """The next ready message, or None when nothing is ready."""
        return _message(queue, self._call({"action": 2, "queue": queue}))

    def confirm(self, queue: str, msg_id: int) -> None:
        """Confirm a message (retry > 0) so it is not delivered again. An
        unknown id is not an error (queue_server's rule)."""
        self._call({"action": 3, "queue": queue, "msg_id": msg_id})

    def monitor(self, queue: str | None = None, *, local: bool = False) -> dict:
        """The master's view of the cluster (and of `queue`, if given): the
        fields of action 4 in the README. `local=True`: the view of the node
        the client talks to (action 104), never forwarded."""
        return _result_fields(self._call(_monitor_request(queue, local)))

    def list(self, pattern: str = "") -> list[dict]:
        """The queues whose names contain `pattern`: [{name, size,
        wait_status}], sorted by name."""
        return self._call({"action": 7, "pattern": pattern})["queue_list"]

    def leader(self) -> dict:
        """The master as the node sees it: {leader_node_id, leader_host,
        leader_port}. Raises `NoLeader` when none is elected in time."""
        return _leader_fields(self._call({"action": 8}))

    # -- consumer helpers -------------------------------------------------

    @contextmanager
    def process(self, queue: str, *, wait: float = 0.0) -> Iterator[Message | None]:
        """Consume one message for the `with` block: it is confirmed when the
        block ends normally and left to the server's retry (not confirmed)
        when the block raises. Gives None when nothing became ready within
        `wait` seconds. Only retry > 0 messages come back; retry = 0 ones are
        gone once consumed."""
        message = self._wait_consume(queue, wait)
        yield message
        if message is not None:
            self.confirm(message.queue, message.msg_id)

    def messages(self, queue: str, *, stop_when_empty: bool = False) -> Iterator[Delivery]:
        """Deliveries from `queue`, one per message, for use as

            for delivery in client.messages("orders"):
                with delivery as msg:
                    handle(msg)        # confirmed unless this raises

        Waits for new messages (polling) unless `stop_when_empty`, which ends
        at the first empty consume."""
        pause = POLL_MIN_S
        while True:
            message = self.consume(queue)
            if message is not None:
                pause = POLL_MIN_S
                yield Delivery(self, message)
            elif stop_when_empty:
                return
            else:
                time.sleep(pause)
                pause = min(pause * 2, POLL_MAX_S)

    def _wait_consume(self, queue: str, wait: float) -> Message | None:
        end = time.monotonic() + wait
        pause = POLL_MIN_S
        while True:
            message = self.consume(queue)
            left = end - time.monotonic()
            if message is not None or left <= 0:
                return message
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_S)

    # -- the driver ---------------------------------------------------------

    def _exchange(self, requests: Sequence[dict], window: int, *, stop_on_error: bool) -> list:
        with self._lock:
            ex = _Exchange(requests, window, self._seqs, stop_on_error=stop_on_error)
            router = self._router
            router.begin()
            while not ex.finished:
                if ex.halted:  # drained after a redirect or a retriable refusal
                    self.close()
                    if ex.redirect is not None:
                        error = ServerError(-2, f"too many redirects (last to "
                                                f"{_describe(ex.redirect)})")
                        delay = router.redirected(ex.redirect, error, time.monotonic())
                    else:
                        delay = router.failed(ex.retry_error, time.monotonic())
                    ex.resume()
                    time.sleep(delay)
                    continue
                address = router.address
                answered = ex.answered
                try:
                    if self._conn is None or self._conn.address != address:
                        self.close()
                        self._conn = _Connection(address, self.timeout)
                    self._pump(self._conn, ex)
                    error = None
                except TimeoutError:
                    error = ClientTimeout(f"{_describe(address)}: no answer within {self.timeout} s")
                except (OSError, _BrokenStream) as exc:
                    error = ClientConnectionError(f"{_describe(address)}: {exc}")
                except BaseException:
                    # Interrupted (KeyboardInterrupt): answers may still be
                    # due on this connection; a later call must not read them.
                    self.close()
                    raise
                if ex.answered > answered:
                    router.begin()
                if error is not None:
                    self.close()
                    ex.connection_lost()
                    time.sleep(router.failed(error, time.monotonic()))
            return ex.results

    def _pump(self, conn: _Connection, ex: _Exchange) -> None:
        """Send and receive on `conn` until the exchange is finished, or
        halted with nothing in flight. Raises OSError, TimeoutError,
        _BrokenStream."""
        sock = conn.sock
        out = memoryview(ex.take())
        while True:
            if not out:
                out = memoryview(ex.take())
                if not out and ex.idle:
                    return
            readable, writable, _ = select.select([sock], [sock] if out else [], [], self.timeout)
            if not readable and not writable:
                raise TimeoutError
            if writable:
                out = out[sock.send(out):]
            if readable:
                data = sock.recv(RECV_SIZE)
                if not data:
                    raise ConnectionError("connection closed by the node")
                for response in conn.lines.feed(data):
                    ex.feed(response)


class Delivery:
    """A consumed message whose fate the `with` block decides: confirmed
    when the block ends normally, left to the server's retry when it raises.
    `with delivery as msg:` gives the `Message`."""

    __slots__ = ("client", "message")

    def __init__(self, client: Client, message: Message) -> None:
        self.client = client
        self.message = message

    def __enter__(self) -> Message:
        return self.message

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.client.confirm(self.message.queue, self.message.msg_id)


# -- the asyncio client ------------------------------------------------------


class _AsyncConnection:
    def __init__(self, address: Address, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.address = address
        self.reader = reader
        self.writer = writer
        self.lines = _Lines()

    @classmethod
    async def open(cls, address: Address, timeout_s: float) -> _AsyncConnection:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(*address), timeout_s)
        return cls(address, reader, writer)

    def close(self) -> None:
        self.writer.close()


class AsyncClient:
    """The asyncio twin of `Client`: the same constructor and methods, as
    coroutines; `async with AsyncClient(...) as c:`; `await c.close()`."""

    def __init__(self, hosts: str | Iterable[str | Address], *, timeout: float = DEFAULT_TIMEOUT_S,
                 retry_for: float = DEFAULT_RETRY_FOR_S) -> None:
        self.timeout = timeout
        self._router = _Router(parse_hosts(hosts), retry_for)
        self._conn: _AsyncConnection | None = None
        self._seqs = itertools.count(1)
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection (a later call opens a new one)."""
        self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @property
    def address(self) -> Address:
        """The node the client talks to (or will try next)."""
        return self._router.address

    async def request(self, obj: dict) -> dict:
        """As `Client.request`."""
        obj, user_seq = _raw_request(obj)
        return _raw_answer((await self._exchange([obj], 1, stop_on_error=True))[0], user_seq)

    async def _call(self, obj: dict) -> dict:
        return _checked((await self._exchange([obj], 1, stop_on_error=True))[0])

    async def produce(self, queue: str, data: str, *, delay: object = None, ttl: object = None,
                      retry: object = 0) -> int:
        """As `Client.produce`."""
        return (await self._call(produce_request(queue, data, delay, ttl, retry)))["msg_id"]

    async def produce_ids(self, queue: str, data: str, *, delay: object = None,
                          ttl: object = None, retry: object = 0) -> dict[str, int]:
        """As `Client.produce_ids`."""
        response = await self._call(produce_request(queue, data, delay, ttl, retry))
        return _produced_ids(queue, response)

    async def produce_many(self, items: Iterable[dict], *,
                           window: int = DEFAULT_WINDOW) -> list[int]:
        """As `Client.produce_many`."""
        if window < 1:
            raise InvalidArgument("window must be at least 1")
        now = time.time()
        requests = [_item_request(item, i, now) for i, item in enumerate(items)]
        if not requests:
            return []
        results = await self._exchange(requests, window, stop_on_error=True)
        return _produce_many_ids(results)

    async def consume(self, queue: str) -> Message | None:
        """As `Client.consume`."""
        return _message(queue, await self._call({"action": 2, "queue": queue}))

    async def confirm(self, queue: str, msg_id: int) -> None:
        """As `Client.confirm`."""
        await self._call({"action": 3, "queue": queue, "msg_id": msg_id})

    async def monitor(self, queue: str | None = None, *, local: bool = False) -> dict:
        """As `Client.monitor`."""
        return _result_fields(await self._call(_monitor_request(queue, local)))

    async def list(self, pattern: str = "") -> list[dict]:
        """As `Client.list`."""
        return (await self._call({"action": 7, "pattern": pattern}))["queue_list"]

    async def leader(self) -> dict:
        """As `Client.leader`."""
        return _leader_fields(await self._call({"action": 8}))

    @asynccontextmanager
    async def process(self, queue: str, *, wait: float = 0.0) -> AsyncIterator[Message | None]:
        """As `Client.process`: `async with client.process(q) as msg:`."""
        message = await self._wait_consume(queue, wait)
        yield message
        if message is not None:
            await self.confirm(message.queue, message.msg_id)

    async def messages(self, queue: str, *,
                       stop_when_empty: bool = False) -> AsyncIterator[AsyncDelivery]:
        """As `Client.messages`: `async for d in client.messages(q):` then
        `async with d as msg:`."""
        pause = POLL_MIN_S
        while True:
            message = await self.consume(queue)
            if message is not None:
                pause = POLL_MIN_S
                yield AsyncDelivery(self, message)
            elif stop_when_empty:
                return
            else:
                await asyncio.sleep(pause)
                pause = min(pause * 2, POLL_MAX_S)

    async def _wait_consume(self, queue: str, wait: float) -> Message | None:
        end = time.monotonic() + wait
        pause = POLL_MIN_S
        while True:
            message = await self.consume(queue)
            left = end - time.monotonic()
            if message is not None or left <= 0:
                return message
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_S)

    async def _exchange(self, requests: Sequence[dict], window: int, *,
                        stop_on_error: bool) -> list:
        async with self._lock:
            ex = _Exchange(requests, window, self._seqs, stop_on_error=stop_on_error)
            router = self._router
            router.begin()
            while not ex.finished:
                if ex.halted:
                    self._drop()
                    if ex.redirect is not None:
                        error = ServerError(-2, f"too many redirects (last to "
                                                f"{_describe(ex.redirect)})")
                        delay = router.redirected(ex.redirect, error, time.monotonic())
                    else:
                        delay = router.failed(ex.retry_error, time.monotonic())
                    ex.resume()
                    await asyncio.sleep(delay)
                    continue
                address = router.address
                answered = ex.answered
                try:
                    if self._conn is None or self._conn.address != address:
                        self._drop()
                        self._conn = await _AsyncConnection.open(address, self.timeout)
                    await self._pump(self._conn, ex)
                    error = None
                except (TimeoutError, asyncio.TimeoutError):
                    error = ClientTimeout(f"{_describe(address)}: no answer within {self.timeout} s")
                except (OSError, _BrokenStream) as exc:
                    error = ClientConnectionError(f"{_describe(address)}: {exc}")
                except BaseException:
                    # Cancelled: answers may still be due on this connection;
                    # a later call must not read them.
                    self._drop()
                    raise
                if ex.answered > answered:
                    router.begin()
                if error is not None:
                    self._drop()
                    ex.connection_lost()
                    await asyncio.sleep(router.failed(error, time.monotonic()))
            return ex.results

    async def _pump(self, conn: _AsyncConnection, ex: _Exchange) -> None:
        """As `Client._pump`: writes go to the transport's buffer (bounded by
        the window), reads wait at most `timeout`."""
        while True:
            out = ex.take()
            if out:
                conn.writer.write(out)
            elif ex.idle:
                return
            data = await asyncio.wait_for(conn.reader.read(RECV_SIZE), self.timeout)
            if not data:
                raise ConnectionError("connection closed by the node")
            for response in conn.lines.feed(data):
                ex.feed(response)


class AsyncDelivery:
    """As `Delivery`, for `async with`."""

    __slots__ = ("client", "message")

    def __init__(self, client: AsyncClient, message: Message) -> None:
        self.client = client
        self.message = message

    async def __aenter__(self) -> Message:
        return self.message

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            await self.client.confirm(self.message.queue, self.message.msg_id)
