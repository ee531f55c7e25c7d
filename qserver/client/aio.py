"""The asyncio client: `AsyncClient` (asyncio streams) and its
`AsyncDelivery`, the twins of `sync.Client` and `sync.Delivery`; the
exchange, retry and long-poll logic are `core`'s.

Tasks share one connection (`_Pipeline`), not one at a time as the blocking
client's threads do: a call writes its requests at once, whatever the
other tasks have in flight, and waits for its answers. A node answers a
connection's requests in the order they came (protocol: pipelining), so
one reader task per connection hands each answer to the exchange at the
head of the connection's queue of senders (`_Pipeline._owners`), whose
`_Exchange.feed` checks the `seq` echoed. Rules:
- a request is queued as its bytes are written, in the same step (no await
  between): the queue's order is the wire's;
- a connection that fails (closed, reset, silent for `timeout` with
  requests in flight, an answer out of order) fails every exchange on it,
  and each retries on its own (`core._Router`, one per call); one that is
  replaced (a call went to another node) takes no new requests and closes
  once its answers are in;
- a call cancelled with requests in flight leaves them queued, marked
  abandoned: their answers are read and dropped, so the next call on the
  connection reads its own;
- long polls keep connections of their own (`_AsyncLane`), as in the
  blocking client: a consume the node holds for `wait` would hold up every
  answer behind it.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import os
import random
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
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


class _AsyncConnection:
    def __init__(self, address: Address, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.address = address
        self.reader = reader
        self.writer = writer
        self.lines = _Lines()
        self.auth_pending = False  # the answer to our action 0 is the next one to read

    @classmethod
    async def open(cls, address: Address, timeout_s: float,
                   secure: Security | None = None) -> _AsyncConnection:
        context = secure.ssl_context if secure is not None else None
        # asyncio.timeout, not wait_for: on Python 3.11 a wait_for whose
        # inner call finishes as the caller is cancelled can swallow the
        # cancellation (the caller then runs on to the end).
        try:
            async with asyncio.timeout(timeout_s):
                if context is None:
                    reader, writer = await asyncio.open_connection(*address)
                else:
                    assert secure is not None
                    reader, writer = await asyncio.open_connection(
                        *address, ssl=context, server_hostname=secure.hostname(address))
        except ssl.SSLCertVerificationError as exc:
            raise _untrusted(address, exc) from None
        conn = cls(address, reader, writer)
        if secure is not None and secure.token is not None:
            # Ahead of the first requests; its answer comes first.
            writer.write(secure.auth_bytes)
            conn.auth_pending = True
        return conn

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        """Close at once: nothing more is sent (a TLS connection does not
        wait for the node's close_notify)."""
        self.writer.transport.abort()

    async def wait_closed(self) -> None:
        """Once closed: until its socket is (see `_closed`)."""
        await _closed(asyncio.ensure_future(self.writer.wait_closed()),
                      self.writer.transport.abort)


class _Turn:
    """One call's exchange running on a `_Pipeline`."""

    __slots__ = ("ex", "waiter", "abandoned")

    def __init__(self, ex: _Exchange) -> None:
        self.ex = ex
        # What the call awaits: done when an answer of its came in, or the
        # connection failed (None while the call is not waiting).
        self.waiter: asyncio.Future[None] | None = None
        self.abandoned = False  # the call is gone: its answers still due are dropped

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Pipeline(asyncio.Protocol):
    """A connection shared by the calls of every task of an `AsyncClient`
    (see the module docstring for the rules). An asyncio Protocol, not
    streams: the event loop hands it the bytes, and it wakes the calls
    whose answers they hold, one task switch per call (streams would add
    a reader task's)."""

    def __init__(self, address: Address, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        # Set once, when the connection is done for (what broke it, or a
        # ConnectionError once closed): every exchange on it raises it.
        self.error: BaseException | None = None
        self.retired = False  # replaced: takes no new exchange, closes once answered
        self.auth_pending = False  # the answer to our action 0 is the next one
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._lines = _Lines()
        self._owners: deque[_Turn] = deque()  # the sender of each request in flight, in order
        self._turns: set[_Turn] = set()  # the exchanges running on it
        # The node is lost when silent for timeout_s with answers due: the
        # time it last sent something (or answers fell due), and a timer
        # that checks, moved on lazily rather than at every read.
        self._progress = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._writable: asyncio.Future[None] | None = None  # while the transport is paused
        self._lost: asyncio.Future[None] = self._loop.create_future()  # done: socket closed

    @classmethod
    async def open(cls, address: Address, timeout_s: float,
                   secure: Security | None) -> _Pipeline:
        """A new connection to `address` (TimeoutError after `timeout_s`;
        ClientConnectionError for a certificate not trusted)."""
        loop = asyncio.get_running_loop()
        context = secure.ssl_context if secure is not None else None
        hostname = secure.hostname(address) if secure is not None and context else None
        try:
            async with asyncio.timeout(timeout_s):  # see _AsyncConnection.open
                _, pipe = await loop.create_connection(
                    lambda: cls(address, timeout_s), *address, ssl=context,
                    server_hostname=hostname)
        except ssl.SSLCertVerificationError as exc:
            raise _untrusted(address, exc) from None
        if secure is not None and secure.token is not None:
            # Ahead of the first requests; its answer comes first.
            pipe.auth_pending = True
            pipe._write(secure.auth_bytes)
        return pipe

    @property
    def usable(self) -> bool:
        return self.error is None and not self.retired

    @property
    def closed(self) -> bool:
        """Its socket is closed (not only closing)."""
        return self._lost.done()

    async def run(self, ex: _Exchange) -> None:
        """Send `ex`'s requests and take their answers until it is finished,
        or halted with nothing in flight. Raises what broke the connection:
        OSError, TimeoutError (silent for `timeout_s`), _BrokenStream,
        Unauthorized."""
        turn = _Turn(ex)
        self._turns.add(turn)
        try:
            while True:
                if self.error is not None:
                    raise self.error
                before = ex.in_flight
                out = ex.take()
                if out:
                    if not self._owners:
                        self._arm()
                    # Queued in the step that writes them: the wire's order.
                    self._owners.extend(itertools.repeat(turn, ex.in_flight - before))
                    self._write(out)
                    if self._writable is not None:  # the node stopped reading
                        await asyncio.shield(self._writable)
                        continue
                elif ex.idle:
                    return
                turn.waiter = self._loop.create_future()
                try:
                    await turn.waiter
                finally:
                    turn.waiter = None
        finally:
            self._turns.discard(turn)
            if not ex.idle:
                turn.abandoned = True
            self._maybe_close()

    def _write(self, data: bytes) -> None:
        assert self._transport is not None  # set before open() returns
        self._transport.write(data)

    # -- the timeout -----------------------------------------------------------

    def _arm(self) -> None:
        """Answers fall due on a quiet connection: the node has timeout_s."""
        self._progress = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._progress + self.timeout_s, self._check)

    def _check(self) -> None:
        self._timer = None
        if not self._owners or self.error is not None:
            return
        due = self._progress + self.timeout_s
        if self._loop.time() >= due:
            self._fail(TimeoutError())
        else:
            self._timer = self._loop.call_at(due, self._check)

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        if self.error is not None:
            return
        self._progress = self._loop.time()
        try:
            for response in self._lines.feed(data):
                if self.auth_pending:
                    self.auth_pending = False
                    check_auth(response)  # raises Unauthorized
                    continue
                if not self._owners:
                    raise _BrokenStream("an answer to no request")
                turn = self._owners.popleft()
                if not turn.abandoned:
                    turn.ex.feed(response)
                    turn.wake()
        except Exception as exc:  # handed to every exchange on the connection
            self._fail(exc)
            return
        self._maybe_close()

    def eof_received(self) -> bool:
        self._fail(ConnectionError("connection closed by the node"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost.set_result(None)  # first: the transport is gone, not to be closed again
        self._fail(exc if exc is not None else ConnectionError("connection closed by the node"))

    def pause_writing(self) -> None:
        self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    # -- the end -----------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._owners.clear()
        transport = self._transport
        # Closed once: a second close() of a TLS transport (CPython's) cuts
        # it from its connection, and a later abort() would do nothing.
        if transport is not None and not self._lost.done() and not transport.is_closing():
            # Requests still buffered (a node that stopped reading, calls
            # cancelled mid-write) are dropped with the connection: close()
            # would keep the socket open until they were sent, past the end
            # of the event loop. A silent node would not answer a TLS
            # close_notify either.
            if isinstance(error, TimeoutError) or transport.get_write_buffer_size():
                transport.abort()
            else:
                transport.close()
        self.resume_writing()
        for turn in self._turns:
            turn.wake()

    def retire(self) -> None:
        """Take no new exchange; close once the answers due are in."""
        self.retired = True
        self._maybe_close()

    def _maybe_close(self) -> None:
        """Close a retired connection once no exchange runs on it."""
        if self.retired and self.error is None and not self._owners and not self._turns:
            self.close()

    def close(self) -> None:
        self._fail(ConnectionError("connection closed by the client"))

    async def wait_closed(self) -> None:
        """Once closed (or failed): until its socket is (see `_closed`)."""
        assert self._transport is not None  # set before open() returns
        await _closed(self._lost, self._transport.abort)


# How long closing a connection may take before it is aborted: a TLS
# connection's socket stays open until the node's close_notify answers
# ours (asyncio would wait 30 s for it).
CLOSE_WAIT_S = 1.0


async def _closed(lost: asyncio.Future, abort: Callable[[], None]) -> None:
    """Wait for a closing connection's socket to be closed (`lost` done),
    aborting it after CLOSE_WAIT_S: a close that returned before would
    leave the socket to the end of the event loop, or past it (a TLS
    connection closes its socket only once the node answered the
    close_notify, some loop turns later)."""
    for give_up in (abort, None):
        try:
            async with asyncio.timeout(CLOSE_WAIT_S):
                await asyncio.shield(lost)
            return
        except TimeoutError:
            if give_up is not None:
                give_up()
        except asyncio.CancelledError:  # no more waiting: closed at once
            abort()
            raise
        except Exception:  # closed by a failure: closed all the same
            return


def _untrusted(address: Address, exc: ssl.SSLCertVerificationError) -> ClientConnectionError:
    # The same on every node: asking the next will not help.
    return ClientConnectionError(f"{_describe(address)}: TLS: the node's certificate is not "
                                 f"trusted: {exc.verify_message or exc}")


class _AsyncLane:
    """As `sync._Lane`: a connection and the router that picks its node (a
    long poll's)."""

    __slots__ = ("conn", "router", "generation")

    def __init__(self, router: _Router, conn: _AsyncConnection | None = None,
                 generation: int = 0) -> None:
        self.conn = conn
        self.router = router
        self.generation = generation

    def drop(self) -> None:
        """Let the connection go (a call cancelled or failed on it, or moving
        to another node): aborted, as answers still due on it are of no use."""
        if self.conn is not None:
            self.conn.abort()
            self.conn = None


class AsyncClient:
    """The asyncio twin of `Client`: the same constructor and methods, as
    coroutines; `async with AsyncClient(...) as c:`; `await c.close()`.
    Tasks of one event loop share one connection, pipelined: a call of one
    task does not wait for another's to finish (see the module docstring);
    long polls run on connections of their own."""

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
        self._rng = random.Random()  # as Client._rng
        addresses = list(settings.addresses)
        if shuffle:
            self._rng.shuffle(addresses)
        self._addresses = addresses
        self._retry_for_s = settings.retry_for_s
        # Where the next call starts: the node that served (or that a call
        # moved to) last. Each call has a router of its own from there.
        self._home: Address = addresses[0]
        self._pipe: _Pipeline | None = None  # the connection calls share (None: not open)
        self._pipes: set[_Pipeline] = set()  # every one not closed, replaced ones too
        self._opening: dict[Address, asyncio.Future[_Pipeline]] = {}
        self._seqs = itertools.count(1)
        self._batches = True  # as Client._batches
        self._idle_polls: list[_AsyncConnection] = []
        self._poll_home: Address | None = None  # as Client._poll_home
        self._generation = 0  # as Client._generation

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connections (a later call opens a new one) and wait
        until their sockets are closed (at most CLOSE_WAIT_S, then they are
        aborted); a long poll under way in another task closes its own
        when it ends; a call under way on the shared connection goes on
        on a new one."""
        pipes, self._pipes, self._pipe = self._pipes, set(), None
        for pipe in pipes:
            pipe.close()
        self._generation += 1
        idle, self._idle_polls = self._idle_polls, []
        for conn in idle:
            conn.close()
        await asyncio.gather(*(pipe.wait_closed() for pipe in pipes),
                             *(conn.wait_closed() for conn in idle))

    @property
    def address(self) -> Address:
        """The node the client talks to (or will try next)."""
        return self._home

    async def request(self, obj: dict) -> dict:
        """As `Client.request`."""
        obj, user_seq = _raw_request(obj)
        return _raw_answer(await self._one(obj), user_seq)

    async def _call(self, obj: dict) -> dict:
        return _checked(await self._one(obj))

    async def _one(self, obj: dict) -> dict:
        answer = (await self._exchange([obj], 1, stop_on_error=True,
                                       wait_s=request_wait_s(obj),
                                       home=obj.get("action") in HELD_ACTION_S))[0]
        assert answer is not None  # a lone request is answered once the exchange finishes
        return answer

    async def produce(self, queue: str, data: str, *, delay: object = None, ttl: object = None,
                      retry: object = None, priority: int | None = None,
                      dedup_id: str | None = None) -> int:
        """As `Client.produce`."""
        request = produce_request(queue, data, delay, ttl, retry, priority=priority,
                                  dedup_id=dedup_id)
        return (await self._call(request))["msg_id"]

    async def produce_ids(self, queue: str, data: str, *, delay: object = None,
                          ttl: object = None, retry: object = None, priority: int | None = None,
                          dedup_id: str | None = None) -> dict[str, int]:
        """As `Client.produce_ids`."""
        request = produce_request(queue, data, delay, ttl, retry, priority=priority,
                                  dedup_id=dedup_id)
        return _produced_ids(queue, await self._call(request))

    async def produce_batch(self, queue: str, items: Iterable[str | dict], *,
                            delay: object = None, ttl: object = None, retry: object = None,
                            priority: int | None = None, window: int = BATCH_WINDOW,
                            max_request_bytes: int = BATCH_MAX_BYTES) -> builtins.list:
        """As `Client.produce_batch`."""
        result = await self.produce_batch_result(queue, items, delay=delay, ttl=ttl,
                                                 retry=retry, priority=priority, window=window,
                                                 max_request_bytes=max_request_bytes)
        return result.msg_ids

    async def produce_batch_result(self, queue: str, items: Iterable[str | dict], *,
                                   delay: object = None, ttl: object = None,
                                   retry: object = None, priority: int | None = None,
                                   window: int = BATCH_WINDOW,
                                   max_request_bytes: int = BATCH_MAX_BYTES) -> BatchResult:
        """As `Client.produce_batch_result`."""
        _batch_limits(window, max_request_bytes)
        plan = _ProducePlan.batch(queue, items, delay, ttl, retry, priority, time.time(),
                                  max_request_bytes)
        if plan.requests:
            plan.settle_batch(await self._exchange(plan.requests, window, stop_on_error=True))
        return plan.result()

    async def produce_many(self, items: Iterable[dict], *, window: int = DEFAULT_WINDOW,
                           max_request_bytes: int = BATCH_MAX_BYTES) -> builtins.list[int]:
        """As `Client.produce_many`."""
        _batch_limits(window, max_request_bytes)
        plan = _ProducePlan.many(items, time.time(), max_request_bytes, self._batches)
        while plan.requests:
            results = await self._exchange(plan.requests, window, stop_on_error=True,
                                           batch_window=BATCH_WINDOW)
            if plan.settle_many(results):
                break
            if plan.old_server:
                self._batches = False
        return plan.first_ids()

    @overload
    async def consume(self, queue: str | None = None, *, queues: Sequence[str] | None = None,
                      count: None = None, wait: object = None,
                      lease: object = None) -> AsyncDelivery | None: ...
    @overload
    async def consume(self, queue: str | None = None, *, queues: Sequence[str] | None = None,
                      count: int, wait: object = None,
                      lease: object = None) -> builtins.list[AsyncDelivery]: ...

    async def consume(self, queue: str | None = None, *, queues: Sequence[str] | None = None,
                      count: int | None = None, wait: object = None,
                      lease: object = None) -> AsyncDelivery | None | builtins.list[AsyncDelivery]:
        """As `Client.consume`: an `AsyncDelivery` or None, or with `count`
        a list of them."""
        request = consume_request(queue, queues=queues, count=count, wait=wait, lease=lease)
        deliveries = await self._deliveries(request)
        if count is not None:
            return deliveries
        return deliveries[0] if deliveries else None

    async def _deliveries(self, request: dict) -> builtins.list[AsyncDelivery]:
        response = await self._one(request)
        return [AsyncDelivery(client=self, **fields) for fields in _consumed(request, response)]

    async def confirm(self, queue: str, msg_id: int, *, receipt: str | None = None) -> bool:
        """As `Client.confirm`."""
        return _found(await self._call(confirm_request(queue, msg_id, receipt)))

    async def nack(self, queue: str, msg_id: int, *, receipt: str | None = None,
                   delay: object = None) -> dict:
        """As `Client.nack`."""
        request = nack_request(queue, msg_id, receipt, delay)
        return _new_fields(request, await self._one(request))

    async def touch(self, queue: str, msg_id: int, *, receipt: str | None = None,
                    lease: object = None) -> float:
        """As `Client.touch`."""
        response = await self._call(touch_request(queue, msg_id, receipt, lease))
        return float(response["retry_at"])

    async def show(self, queue: str, msg_id: int) -> dict | None:
        """As `Client.show`."""
        return _shown(await self._one(show_request(queue, msg_id)))

    async def peek(self, queue: str, count: int = 1) -> builtins.list[dict]:
        """As `Client.peek`."""
        return (await self._call(peek_request(queue, count)))["messages"]

    async def config(self, queue: str) -> dict:
        """As `Client.config`."""
        return (await self._call(config_request(queue)))["config"]

    async def set_config(self, queue: str, **settings: object) -> dict:
        """As `Client.set_config`."""
        if not settings:
            raise InvalidArgument("set_config needs at least one setting")
        return (await self._call(config_request(queue, settings)))["config"]

    async def pause(self, queue: str, what: str = "all") -> dict:
        """As `Client.pause`."""
        return (await self._call(pause_request(queue, what)))["config"]

    async def resume(self, queue: str) -> dict:
        """As `Client.resume`."""
        return (await self._call(config_request(queue, {"paused": "none"})))["config"]

    async def clear(self, queue: str) -> int:
        """As `Client.clear`."""
        return _cleared(await self._call(clear_request(queue)))

    async def monitor(self, queue: str | None = None, *, local: bool = False) -> dict:
        """As `Client.monitor`."""
        return _result_fields(await self._call(_monitor_request(queue, local)))

    async def list(self, pattern: str = "") -> builtins.list[dict]:
        """As `Client.list`."""
        return (await self._call({"action": 7, "pattern": pattern}))["queue_list"]

    async def leader(self) -> dict:
        """As `Client.leader`."""
        return _leader_fields(await self._call({"action": 8}))

    async def health(self) -> dict:
        """As `Client.health`."""
        return _result_fields(await self._call({"action": 109}))

    async def drain(self, undo: bool = False) -> dict:
        """As `Client.drain`."""
        request = drain_request(undo)
        return _new_fields(request, await self._call(request))

    async def transfer_leader(self, node_id: int) -> int:
        """As `Client.transfer_leader`."""
        return (await self._call(transfer_leader_request(node_id)))["leader_node_id"]

    @asynccontextmanager
    async def process(self, queue: str | None = None, *, queues: Sequence[str] | None = None,
                      wait: float = 0.0,
                      lease: object = None) -> AsyncIterator[AsyncDelivery | None]:
        """As `Client.process`: `async with client.process(q) as msg:`."""
        request = consume_request(queue, queues=queues, lease=lease)
        got = await self._wait_deliveries(request, wait)
        delivery = got[0] if got else None
        yield delivery
        if delivery is not None:
            await delivery.confirm()

    async def messages(self, queue: str | None = None, *, queues: Sequence[str] | None = None,
                       count: int | None = None, lease: object = None,
                       stop_when_empty: bool = False) -> AsyncIterator[AsyncDelivery]:
        """As `Client.messages`: `async for d in client.messages(q):` then
        `async with d as msg:`."""
        request = consume_request(queue, queues=queues, count=count, lease=lease)
        polling = _Polling()
        while True:
            if stop_when_empty:
                got = await self._deliveries(request)
                if not got:
                    return
            else:
                got = await self._long_poll(request, self.long_poll, polling)
            for delivery in got:
                yield delivery

    async def _long_poll(self, request: dict, wait_s: float,
                         polling: _Polling) -> builtins.list[AsyncDelivery]:
        """As `Client._long_poll`."""
        while True:
            wait_s = min(wait_s, self.long_poll)
            asked = dict(request, wait=wait_s) if wait_s > 0 else request
            start = time.monotonic()
            try:
                got = await self._deliveries(asked)
            except ServerError as exc:
                shorter = shorter_long_poll(wait_s, exc)
                if shorter is None:
                    raise
                self.long_poll = min(self.long_poll, shorter)
                continue
            pause = polling.pause_after(bool(got), wait_s, time.monotonic() - start)
            if pause:
                await asyncio.sleep(pause)
            return got

    async def _wait_deliveries(self, request: dict,
                               wait: float) -> builtins.list[AsyncDelivery]:
        end = time.monotonic() + wait
        polling = _Polling()
        while True:
            got = await self._long_poll(request, max(0.0, end - time.monotonic()), polling)
            if got or time.monotonic() >= end:
                return got

    async def _exchange(self, requests: Sequence[dict], window: int, *, stop_on_error: bool,
                        wait_s: float = 0.0, home: bool = False,
                        batch_window: int | None = None) -> builtins.list[dict | None]:
        # (builtins.list: in this class, `list` is the method.)
        if not wait_s:
            router = _Router(self._addresses, self._retry_for_s, self._home, rng=self._rng)
            return await self._run(router, None, requests, window, stop_on_error, 0.0,
                                   batch_window)
        # A request the node holds (a long poll; a transfer or drain, to
        # the node the client talks to: `home`) goes on a lane of its own.
        lane = self._poll_lane(self._home if home else None)
        try:
            results = await self._run(lane.router, lane, requests, window, stop_on_error,
                                      wait_s, None)
            if not home:
                self._poll_home = lane.router.address
            return results
        finally:
            await self._end_poll(lane)

    def _poll_lane(self, address: Address | None = None) -> _AsyncLane:
        """As `Client._poll_lane`."""
        address = address or self._poll_home or self._home
        conns = self._idle_polls
        i = next((i for i, c in enumerate(conns) if c.address == address), None)
        conn = conns.pop(i) if i is not None else None
        router = _Router(self._addresses, self._retry_for_s, address, rng=self._rng)
        return _AsyncLane(router, conn, self._generation)

    async def _end_poll(self, lane: _AsyncLane) -> None:
        """As `Client._end_poll`; a connection not kept (the client was
        closed meanwhile, or enough are kept) is closed before the call
        returns: aborted, every answer is in, so that this takes one loop
        turn (a task cancelled then loses its call's answer)."""
        conn, lane.conn = lane.conn, None
        if conn is None:
            return
        if (lane.generation == self._generation
                and len(self._idle_polls) < MAX_IDLE_POLL_CONNECTIONS):
            self._idle_polls.append(conn)
        else:
            conn.abort()
            await conn.wait_closed()

    async def _pipeline(self, address: Address) -> _Pipeline:
        """The shared connection to `address`: the one open, else a new one
        (one opening per address, whoever asks meanwhile waits for it),
        which replaces the one open."""
        while True:
            pipe = self._pipe
            if pipe is not None and pipe.address == address and pipe.usable:
                return pipe
            opening = self._opening.get(address)
            if opening is None:
                opening = asyncio.ensure_future(self._open_pipeline(address, self._generation))
                opening.add_done_callback(_retrieved)
                self._opening[address] = opening
            # shield: a caller cancelled meanwhile leaves the opening to the others
            pipe = await asyncio.shield(opening)
            # Replaced meanwhile, it still serves this call; failed, the call
            # sees why (a failure, counted). Only one replaced and already
            # closed (nothing was due on it) is opened again.
            if pipe.error is None or not pipe.retired:
                return pipe

    async def _open_pipeline(self, address: Address, generation: int) -> _Pipeline:
        """A new shared connection to `address`, asked for while the client
        was in `generation` (taken when asked: this may start later)."""
        try:
            pipe = await _Pipeline.open(address, self.timeout, self._security)
        finally:
            del self._opening[address]
        if generation != self._generation:
            # close() came while it opened: it serves the calls that wait
            # for it, then closes itself; the client holds nothing open
            pipe.retire()
            return pipe
        old, self._pipe = self._pipe, pipe
        self._pipes = {p for p in self._pipes if not p.closed}  # forget the closed ones
        self._pipes.add(pipe)
        if old is not None:
            old.retire()  # closes itself once its answers are in
        return pipe

    async def _run(self, router: _Router, lane: _AsyncLane | None, requests: Sequence[dict],
                   window: int, stop_on_error: bool, wait_s: float,
                   batch_window: int | None) -> builtins.list[dict | None]:
        """An exchange of `requests`, on the shared connection (`lane` None)
        or on a long poll's lane, moving as `router` says."""
        ex = _Exchange(requests, window, self._seqs, stop_on_error=stop_on_error,
                       batch_window=batch_window)
        error: Exception | None
        while not ex.finished:
            if ex.halted:
                if lane is not None:
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
                self._moved(router, lane)
                await asyncio.sleep(delay)
                continue
            address = router.address
            answered = ex.answered
            timeout_s = self.timeout + wait_s
            try:
                if lane is None:
                    await (await self._pipeline(address)).run(ex)
                else:
                    if lane.conn is None or lane.conn.address != address:
                        lane.drop()
                        lane.conn = await _AsyncConnection.open(address, self.timeout,
                                                                self._security)
                    await self._pump(lane.conn, ex, timeout_s)
                error = None
            except TimeoutError:
                error = ClientTimeout(f"{_describe(address)}: no answer within {timeout_s} s")
            except (OSError, _BrokenStream) as exc:
                error = ClientConnectionError(f"{_describe(address)}: {exc}")
            except BaseException:
                # Cancelled: answers may still be due on this connection; a
                # later call must not read them (the shared one drops them).
                if lane is not None:
                    lane.drop()
                raise
            if ex.answered > answered:
                router.begin()
            if error is not None:
                if lane is not None:
                    lane.drop()
                ex.connection_lost()
                delay = router.failed(error, time.monotonic())
                self._moved(router, lane)
                await asyncio.sleep(delay)
        self._moved(router, lane)
        return ex.results

    def _moved(self, router: _Router, lane: _AsyncLane | None) -> None:
        """The next call on the shared connection starts where this one is."""
        if lane is None:
            self._home = router.address

    async def _pump(self, conn: _AsyncConnection, ex: _Exchange, timeout_s: float) -> None:
        """As `Client._pump`: writes go to the transport's buffer (bounded by
        the window), reads wait at most `timeout_s`."""
        while True:
            out = ex.take()
            if out:
                conn.writer.write(out)
            elif ex.idle:
                return
            async with asyncio.timeout(timeout_s):  # see _AsyncConnection.open
                data = await conn.reader.read(RECV_SIZE)
            if not data:
                raise ConnectionError("connection closed by the node")
            for response in conn.lines.feed(data):
                if conn.auth_pending:
                    conn.auth_pending = False
                    check_auth(response)  # raises Unauthorized
                    continue
                ex.feed(response)


def _retrieved(future: asyncio.Future) -> None:
    """An opening's outcome is read even when every caller was cancelled
    (asyncio would log "exception never retrieved")."""
    if not future.cancelled():
        future.exception()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class AsyncDelivery(Message):
    """As `Delivery`, with coroutines: `await d.confirm()`, `await
    d.nack(delay)`, `await d.touch(lease)`, and `async with d as msg:`."""

    client: AsyncClient = field(repr=False)

    @property
    def message(self) -> Message:
        """The delivery itself (it is a `Message`); kept for older code."""
        return self

    async def confirm(self) -> bool:
        """As `Delivery.confirm`."""
        return await self.client.confirm(self.queue, self.msg_id, receipt=self.receipt)

    async def nack(self, delay: object = None) -> dict:
        """As `Delivery.nack`."""
        return await self.client.nack(self.queue, self.msg_id, receipt=self.receipt,
                                      delay=delay)

    async def touch(self, lease: object = None) -> float:
        """As `Delivery.touch`."""
        return await self.client.touch(self.queue, self.msg_id, receipt=self.receipt,
                                       lease=lease)

    async def __aenter__(self) -> AsyncDelivery:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: object,
                        tb: object) -> None:
        if exc_type is None:
            await self.confirm()
