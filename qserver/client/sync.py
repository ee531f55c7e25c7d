"""The blocking client: `Client` (one socket, driven with `select`) and
its `Delivery`; the exchange and retry logic are `core`'s."""

from __future__ import annotations

import builtins
import itertools
import select
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from ..errors import (
    ClientConnectionError,
    ClientTimeout,
    InvalidArgument,
    ServerError,
)
from .core import (
    DEFAULT_RETRY_FOR_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WINDOW,
    POLL_MAX_S,
    POLL_MIN_S,
    RECV_SIZE,
    Address,
    Message,
    _BrokenStream,
    _checked,
    _describe,
    _Exchange,
    _item_request,
    _leader_fields,
    _Lines,
    _message,
    _monitor_request,
    _produce_many_ids,
    _produced_ids,
    _raw_answer,
    _raw_request,
    _result_fields,
    _Router,
    parse_hosts,
    produce_request,
)


class _Connection:
    def __init__(self, address: Address, timeout_s: float) -> None:
        self.address = address
        self.sock = socket.create_connection(address, timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lines = _Lines()

    def close(self) -> None:
        self.sock.close()


class Client:
    """A blocking qserver client over TCP (see the package docstring).

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
        return _raw_answer(self._one(obj), user_seq)

    def _call(self, obj: dict) -> dict:
        return _checked(self._one(obj))

    def _one(self, obj: dict) -> dict:
        answer = self._exchange([obj], 1, stop_on_error=True)[0]
        assert answer is not None  # a lone request is answered once the exchange finishes
        return answer

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
        items again on another node (at-least-once, see the package
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

    def _exchange(self, requests: Sequence[dict], window: int, *,
                  stop_on_error: bool) -> builtins.list[dict | None]:
        # (builtins.list: in this class, `list` is the method.)
        with self._lock:
            ex = _Exchange(requests, window, self._seqs, stop_on_error=stop_on_error)
            router = self._router
            router.begin()
            error: Exception | None
            while not ex.finished:
                if ex.halted:  # drained after a redirect or a retriable refusal
                    self.close()
                    if ex.redirect is not None:
                        error = ServerError(-2, f"too many redirects (last to "
                                                f"{_describe(ex.redirect)})")
                        delay = router.redirected(ex.redirect, error, time.monotonic())
                    else:
                        # Halted but not finished: no refusal stopped the
                        # exchange (it would be finished once idle), so a
                        # retriable refusal halted it.
                        assert ex.retry_error is not None
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
                    error = ClientTimeout(
                        f"{_describe(address)}: no answer within {self.timeout} s")
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

