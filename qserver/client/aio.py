"""The asyncio client: `AsyncClient` (asyncio streams) and its
`AsyncDelivery`, the twins of `sync.Client` and `sync.Delivery`; the
exchange, retry and long-poll logic are `core`'s."""

from __future__ import annotations

import asyncio
import builtins
import itertools
import ssl
import time
from collections.abc import AsyncIterator, Iterable, Sequence
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
    DEFAULT_RETRY_FOR_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WINDOW,
    LONG_POLL_S,
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
    _long_poll_s,
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
    config_request,
    confirm_request,
    consume_request,
    drain_request,
    nack_request,
    parse_hosts,
    pause_request,
    peek_request,
    produce_request,
    request_wait_s,
    security,
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
            # The same on every node: asking the next will not help.
            raise ClientConnectionError(
                f"{_describe(address)}: TLS: the node's certificate is not trusted: "
                f"{exc.verify_message or exc}") from None
        conn = cls(address, reader, writer)
        if secure is not None and secure.token is not None:
            # Ahead of the first requests; its answer comes first.
            writer.write(secure.auth_bytes)
            conn.auth_pending = True
        return conn

    def close(self) -> None:
        self.writer.close()


class _AsyncLane:
    """As `sync._Lane`: a connection and the router that picks its node."""

    __slots__ = ("conn", "router", "generation")

    def __init__(self, router: _Router, conn: _AsyncConnection | None = None,
                 generation: int = 0) -> None:
        self.conn = conn
        self.router = router
        self.generation = generation

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class AsyncClient:
    """The asyncio twin of `Client`: the same constructor and methods, as
    coroutines; `async with AsyncClient(...) as c:`; `await c.close()`.
    Calls of several tasks are serialized on one connection, except long
    polls, which run on connections of their own."""

    def __init__(self, hosts: str | Iterable[str | Address], *, timeout: float = DEFAULT_TIMEOUT_S,
                 retry_for: float = DEFAULT_RETRY_FOR_S, long_poll: float = LONG_POLL_S,
                 token: str | None = None, tls: bool = False, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_hostname: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.timeout = timeout
        self.long_poll = _long_poll_s(long_poll)
        self._security = security(token, tls, tls_ca, tls_cert, tls_key, tls_server_hostname,
                                  ssl_context)
        self._main = _AsyncLane(_Router(parse_hosts(hosts), retry_for))
        self._seqs = itertools.count(1)
        self._batches = True  # as Client._batches
        self._lock = asyncio.Lock()  # the main lane: one exchange at a time
        self._idle_polls: list[_AsyncConnection] = []
        self._poll_home: Address | None = None  # as Client._poll_home
        self._generation = 0  # as Client._generation

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connections (a later call opens a new one); a long poll
        under way in another task closes its own when it ends."""
        self._main.drop()
        self._generation += 1
        idle, self._idle_polls = self._idle_polls, []
        for conn in idle:
            conn.close()

    @property
    def address(self) -> Address:
        """The node the client talks to (or will try next)."""
        return self._main.router.address

    async def request(self, obj: dict) -> dict:
        """As `Client.request`."""
        obj, user_seq = _raw_request(obj)
        return _raw_answer(await self._one(obj), user_seq)

    async def _call(self, obj: dict) -> dict:
        return _checked(await self._one(obj))

    async def _one(self, obj: dict) -> dict:
        answer = (await self._exchange([obj], 1, stop_on_error=True,
                                       wait_s=request_wait_s(obj)))[0]
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
                        wait_s: float = 0.0,
                        batch_window: int | None = None) -> builtins.list[dict | None]:
        # (builtins.list: in this class, `list` is the method.)
        if not wait_s:
            async with self._lock:
                return await self._run(self._main, requests, window, stop_on_error, 0.0,
                                       batch_window)
        lane = self._poll_lane()
        try:
            results = await self._run(lane, requests, window, stop_on_error, wait_s, None)
            self._poll_home = lane.router.address
            return results
        finally:
            self._end_poll(lane)

    def _poll_lane(self) -> _AsyncLane:
        """As `Client._poll_lane`."""
        address = self._poll_home or self._main.router.address
        conns = self._idle_polls
        i = next((i for i, c in enumerate(conns) if c.address == address), None)
        conn = conns.pop(i) if i is not None else None
        router = _Router(self._main.router.addresses, self._main.router.retry_for_s, address)
        return _AsyncLane(router, conn, self._generation)

    def _end_poll(self, lane: _AsyncLane) -> None:
        """As `Client._end_poll`."""
        conn, lane.conn = lane.conn, None
        if conn is None:
            return
        if (lane.generation == self._generation
                and len(self._idle_polls) < MAX_IDLE_POLL_CONNECTIONS):
            self._idle_polls.append(conn)
        else:
            conn.close()

    async def _run(self, lane: _AsyncLane, requests: Sequence[dict], window: int,
                   stop_on_error: bool, wait_s: float,
                   batch_window: int | None) -> builtins.list[dict | None]:
        ex = _Exchange(requests, window, self._seqs, stop_on_error=stop_on_error,
                       batch_window=batch_window)
        router = lane.router
        router.begin()
        error: Exception | None
        while not ex.finished:
            if ex.halted:
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
                await asyncio.sleep(delay)
                continue
            address = router.address
            answered = ex.answered
            timeout_s = self.timeout + wait_s
            try:
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
                # Cancelled: answers may still be due on this connection;
                # a later call must not read them.
                lane.drop()
                raise
            if ex.answered > answered:
                router.begin()
            if error is not None:
                lane.drop()
                ex.connection_lost()
                await asyncio.sleep(router.failed(error, time.monotonic()))
        return ex.results

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
