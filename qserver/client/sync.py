"""The blocking client: `Client` (sockets driven with `selectors`) and its
`Delivery`; the exchange, retry and long-poll logic are `core`'s."""

from __future__ import annotations

import builtins
import itertools
import os
import random
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import overload

from ..errors import (
    ClientConnectionError,
    ClientTimeout,
    InvalidArgument,
    ServerError,
)
from .core import (
    BATCH_MAX_BYTES,
    BATCH_WINDOW,
    DEFAULT_WINDOW,
    HELD_ACTION_S,
    MAX_IDLE_POLL_CONNECTIONS,
    RECV_SIZE,
    Address,
    BatchResult,
    Message,
    Security,
    _batch_limits,
    _BrokenStream,
    _checked,
    _cleared,
    _consumed,
    _describe,
    _Exchange,
    _found,
    _leader_fields,
    _Lines,
    _monitor_request,
    _new_fields,
    _Polling,
    _produced_ids,
    _ProducePlan,
    _raw_answer,
    _raw_request,
    _result_fields,
    _Router,
    _shown,
    check_auth,
    clear_request,
    client_settings,
    config_request,
    confirm_request,
    consume_request,
    drain_request,
    nack_request,
    pause_request,
    peek_request,
    produce_request,
    request_wait_s,
    shorter_long_poll,
    show_request,
    touch_request,
    transfer_leader_request,
)


class _Connection:
    """A socket to one node, and the selector `Client._pump` waits on.

    `selectors.DefaultSelector` (epoll, kqueue, else poll), not
    `select.select`: select() refuses descriptors >= FD_SETSIZE (1024),
    which a process with many files or sockets open (a Spark executor, a web
    server) hands out. One selector per connection, kept with it: `_pump`
    only changes whether it waits to write."""

    def __init__(self, address: Address, timeout_s: float,
                 secure: Security | None = None) -> None:
        self.address = address
        sock = socket.create_connection(address, timeout=timeout_s)
        # An SSLSocket, non-blocking once set up: the selector may say readable
        # for a record that holds no answer (a TLS 1.3 session ticket), on
        # which a blocking recv would wait for the timeout; and it may hold
        # decrypted bytes the selector does not see (see Client._pump).
        self.tls = False
        self.auth_pending = False  # the answer to our action 0 is the next one to read
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if secure is not None:
                if secure.ssl_context is not None:
                    try:
                        sock = secure.ssl_context.wrap_socket(
                            sock, server_hostname=secure.hostname(address))
                    except ssl.SSLCertVerificationError as exc:
                        # The same on every node: asking the next will not help.
                        raise ClientConnectionError(
                            f"{_describe(address)}: TLS: the node's certificate is not "
                            f"trusted: {exc.verify_message or exc}") from None
                    self.tls = True
                if secure.token is not None:
                    # Sent ahead of the first requests; its answer comes first.
                    sock.sendall(secure.auth_bytes)
                    self.auth_pending = True
                if self.tls:
                    sock.setblocking(False)
            selector = selectors.DefaultSelector()
            try:
                selector.register(sock, selectors.EVENT_READ)
            except BaseException:
                selector.close()
                raise
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.selector = selector
        self.events = selectors.EVENT_READ  # what the selector waits for now
        self.lines = _Lines()

    def wait(self, write: bool, timeout_s: float) -> tuple[bool, bool]:
        """Wait until the socket is readable, or writable if `write`, for
        at most `timeout_s`; returns (readable, writable)."""
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        if events != self.events:
            self.selector.modify(self.sock, events)
            self.events = events
        ready = 0
        for _, mask in self.selector.select(timeout_s):
            ready |= mask
        return bool(ready & selectors.EVENT_READ), bool(ready & selectors.EVENT_WRITE)

    def close(self) -> None:
        self.selector.close()
        self.sock.close()


class _Lane:
    """A connection (None until opened, or after a failure) and the router
    that picks its node: the client's main lane, or one long poll's."""

    __slots__ = ("conn", "router", "generation")

    def __init__(self, router: _Router, conn: _Connection | None = None,
                 generation: int = 0) -> None:
        self.conn = conn
        self.router = router
        self.generation = generation

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class Client:
    """A blocking qserver client over TCP (see the package docstring).

    `hosts`: "host:port" strings or (host, port) tuples, one
    comma-separated string, or a URL `qserver://host:port,host:port/?
    timeout=5&token=...` (`qservers://` for TLS; see `parse_target`); any
    node of the cluster will do, several let the client survive the loss of
    one. None: `$QSERVER_SERVERS`, in any of these forms. The client starts
    at a node picked at random (the list is shuffled once per client, so
    that clients spread over the nodes) unless `shuffle=False`, which keeps
    the order given (a preferred node first). `timeout`: seconds one node
    may stay silent (a long poll's `wait` is added to it; default: the
    URL's, else `$QSERVER_TIMEOUT`, else 5). `retry_for`: seconds of
    retrying (other nodes, no leader) before raising (default 10).
    `long_poll`: the wait of each long poll of `messages` and `process`
    (default 20; lowered by the client if a node's max_wait is lower).
    Arguments given win over the URL's settings. Connects on first use.

    Nodes with `<security>` and `<tls>` (see "Authentication and TLS" in
    the package docstring): `token` is sent as action 0 first thing on
    every connection; `tls=True` speaks TLS, checking the node's
    certificate against `tls_ca` (default: the system's CAs) for
    `tls_server_hostname` (default: the host dialed); `tls_cert` and
    `tls_key` are the client's certificate for nodes that ask for one;
    `ssl_context` replaces the `tls_*` arguments. Raises `InvalidArgument`
    for a file that cannot be used, `Unauthorized` when a node refuses the
    token; `InvalidArgument` for a bad address, URL or environment
    variable, naming it.
    """

    def __init__(self, hosts: str | Iterable[str | Address] | None = None, *,
                 timeout: float | None = None, retry_for: float | None = None,
                 long_poll: float | None = None, shuffle: bool = True,
                 token: str | None = None, tls: bool = False, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_hostname: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        settings = client_settings(
            hosts, os.environ, timeout=timeout, retry_for=retry_for, long_poll=long_poll,
            token=token, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
            tls_server_hostname=tls_server_hostname, ssl_context=ssl_context)
        self.timeout = settings.timeout_s
        self.long_poll = settings.long_poll_s
        self._security = settings.security
        # The start node and the backoff's jitter (seeded from the OS).
        self._rng = random.Random()
        addresses = list(settings.addresses)
        if shuffle:
            self._rng.shuffle(addresses)
        self._main = _Lane(_Router(addresses, settings.retry_for_s, rng=self._rng))
        self._seqs = itertools.count(1)
        # produce_many sends batch produces until a node refuses one as a
        # node without them does.
        self._batches = True
        self._lock = threading.Lock()  # the main lane: one exchange at a time
        self._polls_lock = threading.Lock()  # _idle_polls and _generation
        self._idle_polls: list[_Connection] = []
        # The node that answered the last long poll, where the next one
        # starts (with forward_request="0", a slave's redirect is followed
        # once, not by every long poll).
        self._poll_home: Address | None = None
        # close() counts up: a long poll's connection opened before it is
        # closed when the poll ends, not kept.
        self._generation = 0

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections (a later call opens a new one); a long poll
        under way in another thread closes its own when it ends."""
        self._main.drop()
        with self._polls_lock:
            self._generation += 1
            idle, self._idle_polls = self._idle_polls, []
        for conn in idle:
            conn.close()

    @property
    def address(self) -> Address:
        """The node the client talks to (or will try next)."""
        return self._main.router.address

    # -- requests --------------------------------------------------------

    def request(self, obj: dict) -> dict:
        """Send one raw request (the wire's fields) and return the answer as
        is, code -1 included, except the answers that are retried as for
        every call (redirects, "no leader", "outcome unknown", lost
        connections): those raise `NoLeader`, `ServerError`,
        `ClientConnectionError` or `ClientTimeout` once the retry time is
        up. A `seq` in `obj` comes back in the answer (the client uses its
        own on the wire). A consume with `wait` is a long poll (see
        `consume`)."""
        obj, user_seq = _raw_request(obj)
        return _raw_answer(self._one(obj), user_seq)

    def _call(self, obj: dict) -> dict:
        return _checked(self._one(obj))

    def _one(self, obj: dict) -> dict:
        answer = self._exchange([obj], 1, stop_on_error=True, wait_s=request_wait_s(obj),
                                home=obj.get("action") in HELD_ACTION_S)[0]
        assert answer is not None  # a lone request is answered once the exchange finishes
        return answer

    def produce(self, queue: str, data: str, *, delay: object = None, ttl: object = None,
                retry: object = None, priority: int | None = None,
                dedup_id: str | None = None) -> int:
        """Produce one message; returns its msg_id. For a virtual queue, the
        msg_id in its first real queue (see `produce_ids`).

        `priority` (0 to 2^31-1, default 1024): lower is delivered first
        among deliverable messages. `dedup_id` (1 to 128 characters): if the
        queue accepted a produce with this id within its dedup_window (300 s
        by default), nothing is stored and the first produce's msg_id comes
        back; a resend after a lost answer or a failover stores nothing
        twice (`produce_batch_result` also says which were duplicates).
        Raises `QueueFull`, `QueuePaused` (the queue is paused for
        producers), `ServerError` with the server's reason for a bad value,
        `InvalidArgument` for a wrong type (nothing sent).
        """
        request = produce_request(queue, data, delay, ttl, retry, priority=priority,
                                  dedup_id=dedup_id)
        return self._call(request)["msg_id"]

    def produce_ids(self, queue: str, data: str, *, delay: object = None, ttl: object = None,
                    retry: object = None, priority: int | None = None,
                    dedup_id: str | None = None) -> dict[str, int]:
        """Produce one message (as `produce`); returns {real queue: msg_id}
        for every message created: one entry for a plain queue, one per real
        queue for a virtual queue."""
        request = produce_request(queue, data, delay, ttl, retry, priority=priority,
                                  dedup_id=dedup_id)
        return _produced_ids(queue, self._call(request))

    def produce_batch(self, queue: str, items: Iterable[str | dict], *, delay: object = None,
                      ttl: object = None, retry: object = None, priority: int | None = None,
                      window: int = BATCH_WINDOW,
                      max_request_bytes: int = BATCH_MAX_BYTES) -> builtins.list:
        """Produce many messages into `queue` with batch produces; returns
        their msg_ids in the order of `items` (ints; for a virtual queue
        {real_queue: msg_id} dicts, every message created).

        Each item is the data (a str), or a dict with `data` and optional
        `delay`, `ttl`, `retry`, `priority`, `dedup_id` (as `produce`);
        `delay`, `ttl`, `retry`, `priority` given here apply to every item
        without its own. One request (one log entry, all or nothing) per up
        to 1,000 items, fewer when the encoded request would pass
        `max_request_bytes` (keep it under the nodes' max_request_size);
        up to `window` requests in flight on one connection.

        Every item is checked before anything is sent (`InvalidArgument`).
        A refused request raises `ServerError` (`QueueFull`, `QueuePaused`)
        with the server's reason ("messages[3]: ..." counts within that
        request) and `index`, the input index of the message named, else of
        the request's first item: the requests before it were stored (and
        maybe some sent with it), none of its items were. A request resent
        after a lost connection may be stored twice unless its items carry
        a `dedup_id`.
        """
        return self.produce_batch_result(queue, items, delay=delay, ttl=ttl, retry=retry,
                                         priority=priority, window=window,
                                         max_request_bytes=max_request_bytes).msg_ids

    def produce_batch_result(self, queue: str, items: Iterable[str | dict], *,
                             delay: object = None, ttl: object = None, retry: object = None,
                             priority: int | None = None, window: int = BATCH_WINDOW,
                             max_request_bytes: int = BATCH_MAX_BYTES) -> BatchResult:
        """As `produce_batch`; returns a `BatchResult`: `msg_ids`, and
        `duplicates`, the indexes of the items whose `dedup_id` the queue
        had seen within its dedup_window (nothing stored for them; their
        msg_id is the first produce's)."""
        _batch_limits(window, max_request_bytes)
        plan = _ProducePlan.batch(queue, items, delay, ttl, retry, priority, time.time(),
                                  max_request_bytes)
        if plan.requests:
            plan.settle_batch(self._exchange(plan.requests, window, stop_on_error=True))
        return plan.result()

    def produce_many(self, items: Iterable[dict], *, window: int = DEFAULT_WINDOW,
                     max_request_bytes: int = BATCH_MAX_BYTES) -> builtins.list[int]:
        """Produce many messages, pipelined on one connection; returns their
        msg_ids in the order of `items` (for a virtual queue, the msg_id in
        its first real queue).

        Each item is a dict with `queue`, `data` and optional `delay`, `ttl`,
        `retry`, `priority`, `dedup_id` (as `produce`). Consecutive items of
        one queue go as batch produces (as `produce_batch`: up to 1,000 per
        request and `max_request_bytes`), a lone item as a single produce;
        up to `window` requests in flight (of them at most BATCH_WINDOW
        batches). Every item is checked before anything is sent
        (`InvalidArgument`). A refusal stops the call: `ServerError` (or
        `QueueFull`, `QueuePaused`) with `index` set to the item refused.
        When a batch is refused, its items (which it did not store) and
        every item not yet produced are sent again one by one, so that, as
        without batches, the items before `index` that the queue took are
        stored (some sent after it may be too); a node that predates batch
        produce gets single produces from then on. A lost connection sends
        the unanswered requests again on another node (at-least-once, see
        the package docstring, unless the items carry a `dedup_id`).
        """
        _batch_limits(window, max_request_bytes)
        plan = _ProducePlan.many(items, time.time(), max_request_bytes, self._batches)
        while plan.requests:
            results = self._exchange(plan.requests, window, stop_on_error=True,
                                     batch_window=BATCH_WINDOW)
            if plan.settle_many(results):
                break
            if plan.old_server:
                self._batches = False
        return plan.first_ids()

    @overload
    def consume(self, queue: str | None = None, *, queues: Sequence[str] | None = None,
                count: None = None, wait: object = None,
                lease: object = None) -> Delivery | None: ...
    @overload
    def consume(self, queue: str | None = None, *, queues: Sequence[str] | None = None,
                count: int, wait: object = None,
                lease: object = None) -> builtins.list[Delivery]: ...

    def consume(self, queue: str | None = None, *, queues: Sequence[str] | None = None,
                count: int | None = None, wait: object = None,
                lease: object = None) -> Delivery | None | builtins.list[Delivery]:
        """Take the next deliverable message of `queue`, or of the first of
        `queues` (names, in order) that has one.

        Without `count`: the `Delivery` (a `Message` that can confirm, nack
        and touch itself), or None when nothing is deliverable. With
        `count`: a list of up to `count` deliveries, in delivery order,
        empty when nothing is deliverable.

        `wait` (seconds or a timedelta, at most the node's max_wait, 30 s by
        default): a long poll; the node answers as soon as something is
        deliverable, or empty after `wait`. It runs on a connection of its
        own, so other threads' calls on this client go on meanwhile; the
        client waits `timeout` + `wait` for the answer. `lease` (seconds >
        0): an unconfirmed at-least-once delivery comes back after `lease`
        instead of the message's retry.

        Raises `InvalidArgument` (nothing sent), `ServerError` ("wait out of
        range", a virtual queue, bad names...) and the connection errors.
        """
        request = consume_request(queue, queues=queues, count=count, wait=wait, lease=lease)
        deliveries = self._deliveries(request)
        if count is not None:
            return deliveries
        return deliveries[0] if deliveries else None

    def _deliveries(self, request: dict) -> builtins.list[Delivery]:
        response = self._one(request)
        return [Delivery(client=self, **fields) for fields in _consumed(request, response)]

    def confirm(self, queue: str, msg_id: int, *, receipt: str | None = None) -> bool:
        """Confirm a message so that it is not delivered again; returns
        whether a message was deleted (True from a server that does not
        say). Without `receipt`: by id, wherever the message is, and an
        unknown id is not an error (queue_server's rule). With the
        `receipt` of a delivery: only while that delivery is the message's
        current one; else `StaleReceipt` (the lease ran out and the message
        was delivered again, or it was confirmed already)."""
        return _found(self._call(confirm_request(queue, msg_id, receipt)))

    def nack(self, queue: str, msg_id: int, *, receipt: str | None = None,
             delay: object = None) -> dict:
        """Give a delivered message back: deliverable again after `delay`
        (seconds from now, a timedelta, a datetime or an absolute unix time;
        default 0). Returns what the node answered: {"ready_at": unix
        seconds}, or, when the nack made the message leave the queue (its
        max_deliveries reached, or its ttl), {"dead_lettered": True,
        "dead_letter": queue} or {"deleted": True}. Raises `NotInFlight`
        (not delivered, or its lease ran out) and `StaleReceipt`."""
        request = nack_request(queue, msg_id, receipt, delay)
        return _new_fields(request, self._one(request))

    def touch(self, queue: str, msg_id: int, *, receipt: str | None = None,
              lease: object = None) -> float:
        """Extend a delivery: it comes back `lease` seconds from now
        (default: the message's retry; never past its ttl) unless
        confirmed. Returns the new time (`retry_at`, unix seconds). Raises
        `NotInFlight` and `StaleReceipt`, as `nack`."""
        return float(self._call(touch_request(queue, msg_id, receipt, lease))["retry_at"])

    def show(self, queue: str, msg_id: int) -> dict | None:
        """A message as the node holds it, or None when there is no such
        message (consumed for good, confirmed, expired, never produced):
        {msg_id, state ("delayed", "ready" or "in_flight"), data, priority,
        ready_at, ttl, retry, retry_at, deliveries, nacks}, and for a dead
        letter origin_queue, origin_msg_id and dead_letter_reason. Changes
        nothing."""
        return _shown(self._one(show_request(queue, msg_id)))

    def peek(self, queue: str, count: int = 1) -> builtins.list[dict]:
        """The next `count` messages a consume would deliver now, in that
        order, as `show` gives them (each with its `queue`). Changes
        nothing."""
        return self._call(peek_request(queue, count))["messages"]

    def config(self, queue: str) -> dict:
        """The settings of `queue` in force: {max_deliveries, dead_letter,
        max_size, dedup_window, paused} (see `set_config`; a server before
        issue 15 gives the first two only)."""
        return self._call(config_request(queue))["config"]

    def set_config(self, queue: str, **settings: object) -> dict:
        """Change settings of `queue`; returns all its settings after the
        change. The change is replicated as a write, and survives restarts
        and failovers. Settings: `max_deliveries` (0: unlimited),
        `dead_letter` (a queue name; None: none), `max_size` (the most
        messages the queue holds; 0: back to the node's queue_size),
        `dedup_window` (seconds a `dedup_id` is remembered, up to 7 days; 0:
        off), `paused` ("none", "in", "out", "all": see `pause`). Raises
        `ServerError` for an unknown setting or a bad value (the server's
        reason)."""
        if not settings:
            raise InvalidArgument("set_config needs at least one setting")
        return self._call(config_request(queue, settings))["config"]

    def pause(self, queue: str, what: str = "all") -> dict:
        """Pause `queue`: "in" refuses produces (`QueuePaused`), "out"
        delivers nothing (consumes answer empty; long polls keep waiting and
        are served on `resume`), "all" both. Confirm, nack, touch and show
        work as usual. Returns the queue's settings after the change."""
        return self._call(pause_request(queue, what))["config"]

    def resume(self, queue: str) -> dict:
        """Undo `pause` (paused "none"); returns the queue's settings."""
        return self._call(config_request(queue, {"paused": "none"}))["config"]

    def clear(self, queue: str) -> int:
        """Remove every message of `queue`, in flight included (one log
        entry); returns how many. Its settings, its dedup table and its ids
        stay (ids never repeat). An unknown queue gives 0; a virtual queue
        is refused (`ServerError`)."""
        return _cleared(self._call(clear_request(queue)))

    def monitor(self, queue: str | None = None, *, local: bool = False) -> dict:
        """The master's view of the cluster (and of `queue`, if given): the
        fields of action 4 in the README. `local=True`: the view of the node
        the client talks to (action 104), never forwarded."""
        return _result_fields(self._call(_monitor_request(queue, local)))

    def list(self, pattern: str = "") -> builtins.list[dict]:
        """The queues whose names contain `pattern`: [{name, size,
        wait_status}], sorted by name."""
        return self._call({"action": 7, "pattern": pattern})["queue_list"]

    def leader(self) -> dict:
        """The master as the node sees it: {leader_node_id, leader_host,
        leader_port}. Raises `NoLeader` when none is elected in time."""
        return _leader_fields(self._call({"action": 8}))

    # -- operations ---------------------------------------------------------

    def health(self) -> dict:
        """Whether the node the client talks to is ready for clients (action
        109, answered by that node): {ready, reasons, role, leader_node_id,
        applied_id, commit_id, ...}; `reasons` lists what is wrong in words
        (empty when ready)."""
        return _result_fields(self._call({"action": 109}))

    def drain(self, undo: bool = False) -> dict:
        """Take the node the client talks to out of client work (action 108;
        `undo=True` puts it back): {draining, leader_node_id}. A master
        first hands its role to its most up-to-date slave; when it cannot,
        raises `ServerError` with the reason (the node drains anyway: its
        answer, in the exception's `response`, says `draining`)."""
        request = drain_request(undo)
        return _new_fields(request, self._call(request))

    def transfer_leader(self, node_id: int) -> int:
        """Hand the master role to node `node_id` (action 20, sent on to the
        master); returns the new master's node id once it has taken over.
        Raises `ServerError` ("no such node", "node not caught up",
        "transfer timed out", ...)."""
        return self._call(transfer_leader_request(node_id))["leader_node_id"]

    # -- consumer helpers -------------------------------------------------

    @contextmanager
    def process(self, queue: str | None = None, *, queues: Sequence[str] | None = None,
                wait: float = 0.0, lease: object = None) -> Iterator[Delivery | None]:
        """Consume one message for the `with` block: it is confirmed (with
        its receipt) when the block ends normally and left to the server's
        retry (not confirmed) when the block raises. Gives None when nothing
        became deliverable within `wait` seconds (long polls, however long
        `wait` is). Only retry > 0 messages come back; retry = 0 ones are
        gone once consumed."""
        request = consume_request(queue, queues=queues, lease=lease)
        got = self._wait_deliveries(request, wait)
        delivery = got[0] if got else None
        yield delivery
        if delivery is not None:
            delivery.confirm()

    def messages(self, queue: str | None = None, *, queues: Sequence[str] | None = None,
                 count: int | None = None, lease: object = None,
                 stop_when_empty: bool = False) -> Iterator[Delivery]:
        """Deliveries from `queue` (or `queues`), one per message, for use as

            for delivery in client.messages("orders"):
                with delivery as msg:
                    handle(msg)        # confirmed unless this raises

        Waits for new messages with long polls of `long_poll` seconds
        (nothing is sent meanwhile, and a message produced is delivered at
        once) unless `stop_when_empty`, which ends at the first empty
        consume. `count`: take up to that many per request; their leases
        all run from the request, so a slow handler may see later ones come
        back (use `lease`, or `delivery.touch()`)."""
        request = consume_request(queue, queues=queues, count=count, lease=lease)
        polling = _Polling()
        while True:
            if stop_when_empty:
                got = self._deliveries(request)
                if not got:
                    return
            else:
                got = self._long_poll(request, self.long_poll, polling)
            yield from got

    def _long_poll(self, request: dict, wait_s: float,
                   polling: _Polling) -> builtins.list[Delivery]:
        """One long poll of at most `wait_s` (cut to the client's
        `long_poll`, which a node's "wait out of range" lowers); pauses
        afterwards as `polling` says."""
        while True:
            wait_s = min(wait_s, self.long_poll)
            asked = dict(request, wait=wait_s) if wait_s > 0 else request
            start = time.monotonic()
            try:
                got = self._deliveries(asked)
            except ServerError as exc:
                shorter = shorter_long_poll(wait_s, exc)
                if shorter is None:
                    raise
                self.long_poll = min(self.long_poll, shorter)
                continue
            pause = polling.pause_after(bool(got), wait_s, time.monotonic() - start)
            if pause:
                time.sleep(pause)
            return got

    def _wait_deliveries(self, request: dict, wait: float) -> builtins.list[Delivery]:
        """Long polls until something is delivered or `wait` seconds pass."""
        end = time.monotonic() + wait
        polling = _Polling()
        while True:
            got = self._long_poll(request, max(0.0, end - time.monotonic()), polling)
            if got or time.monotonic() >= end:
                return got

    # -- the driver ---------------------------------------------------------

    def _exchange(self, requests: Sequence[dict], window: int, *, stop_on_error: bool,
                  wait_s: float = 0.0, home: bool = False,
                  batch_window: int | None = None) -> builtins.list[dict | None]:
        # (builtins.list: in this class, `list` is the method.)
        if not wait_s:
            with self._lock:
                return self._run(self._main, requests, window, stop_on_error, 0.0,
                                 batch_window)
        # A request the node holds (a long poll; a transfer or drain, to
        # the node the client talks to: `home`) goes on a lane of its own.
        lane = self._poll_lane(self._main.router.address if home else None)
        try:
            results = self._run(lane, requests, window, stop_on_error, wait_s, None)
            if not home:
                self._poll_home = lane.router.address
            return results
        finally:
            self._end_poll(lane)

    def _poll_lane(self, address: Address | None = None) -> _Lane:
        """A lane for a long poll: a router that starts at `address`, else
        where the last long poll was answered, else at the main lane's
        node; and an idle poll connection to that node if there is one."""
        address = address or self._poll_home or self._main.router.address
        with self._polls_lock:
            conns = self._idle_polls
            i = next((i for i, c in enumerate(conns) if c.address == address), None)
            conn = conns.pop(i) if i is not None else None
            generation = self._generation
        router = _Router(self._main.router.addresses, self._main.router.retry_for_s, address,
                         rng=self._rng)
        return _Lane(router, conn, generation)

    def _end_poll(self, lane: _Lane) -> None:
        """Keep a long poll's connection for the next (it is idle: every
        answer read), unless the client was closed meanwhile or keeps
        enough."""
        conn, lane.conn = lane.conn, None
        if conn is None:
            return
        with self._polls_lock:
            if (lane.generation == self._generation
                    and len(self._idle_polls) < MAX_IDLE_POLL_CONNECTIONS):
                self._idle_polls.append(conn)
                return
        conn.close()

    def _run(self, lane: _Lane, requests: Sequence[dict], window: int, stop_on_error: bool,
             wait_s: float, batch_window: int | None) -> builtins.list[dict | None]:
        ex = _Exchange(requests, window, self._seqs, stop_on_error=stop_on_error,
                       batch_window=batch_window)
        router = lane.router
        router.begin()
        error: Exception | None
        while not ex.finished:
            if ex.halted:  # drained after a redirect or a retriable refusal
                lane.drop()
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
            timeout_s = self.timeout + wait_s
            try:
                if lane.conn is None or lane.conn.address != address:
                    lane.drop()
                    lane.conn = _Connection(address, self.timeout, self._security)
                self._pump(lane.conn, ex, timeout_s)
                error = None
            except TimeoutError:
                error = ClientTimeout(f"{_describe(address)}: no answer within {timeout_s} s")
            except (OSError, _BrokenStream) as exc:
                error = ClientConnectionError(f"{_describe(address)}: {exc}")
            except BaseException:
                # Interrupted (KeyboardInterrupt): answers may still be
                # due on this connection; a later call must not read them.
                lane.drop()
                raise
            if ex.answered > answered:
                router.begin()
            if error is not None:
                lane.drop()
                ex.connection_lost()
                time.sleep(router.failed(error, time.monotonic()))
        return ex.results

    def _pump(self, conn: _Connection, ex: _Exchange, timeout_s: float) -> None:
        """Send and receive on `conn` until the exchange is finished, or
        halted with nothing in flight; `timeout_s` of silence at most.
        Raises OSError, TimeoutError, _BrokenStream."""
        sock = conn.sock
        out = memoryview(ex.take())
        while True:
            if not out:
                out = memoryview(ex.take())
                if not out and ex.idle:
                    return
            readable, writable = conn.wait(bool(out), timeout_s)
            if not readable and not writable:
                raise TimeoutError
            if writable:
                try:
                    out = out[sock.send(out):]
                except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    pass  # TLS (non-blocking): the same bytes again once the selector says so
            if readable:
                try:
                    data = sock.recv(RECV_SIZE)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    continue  # TLS: a record without application data
                if not data:
                    raise ConnectionError("connection closed by the node")
                if conn.tls:  # the rest of a TLS record: decrypted, not in the socket
                    while pending := sock.pending():  # type: ignore[attr-defined]
                        data += sock.recv(pending)
                for response in conn.lines.feed(data):
                    if conn.auth_pending:
                        conn.auth_pending = False
                        check_auth(response)  # raises Unauthorized
                        continue
                    ex.feed(response)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Delivery(Message):
    """A consumed message (a `Message`: queue, msg_id, data, deliveries,
    receipt) that can settle itself with its receipt: `confirm()`,
    `nack(delay)`, `touch(lease)`. As a context manager, the `with` block
    decides: confirmed when it ends normally, left to the server's retry
    when it raises; `with delivery as msg:` gives the delivery itself."""

    client: Client = field(repr=False)

    @property
    def message(self) -> Message:
        """The delivery itself (it is a `Message`); kept for older code."""
        return self

    def confirm(self) -> bool:
        """As `Client.confirm` with this delivery's receipt: raises
        `StaleReceipt` if the lease ran out and the message was delivered
        again (or confirmed) since. Without a receipt (an at-most-once
        message, a last delivery, an older server): by id."""
        return self.client.confirm(self.queue, self.msg_id, receipt=self.receipt)

    def nack(self, delay: object = None) -> dict:
        """As `Client.nack` with this delivery's receipt."""
        return self.client.nack(self.queue, self.msg_id, receipt=self.receipt, delay=delay)

    def touch(self, lease: object = None) -> float:
        """As `Client.touch` with this delivery's receipt."""
        return self.client.touch(self.queue, self.msg_id, receipt=self.receipt, lease=lease)

    def __enter__(self) -> Delivery:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        if exc_type is None:
            self.confirm()

