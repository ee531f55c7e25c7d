"""The asyncio client: `AsyncClient` (asyncio streams) and its
`AsyncDelivery`, the twin of `sync.Client`; the exchange and retry logic are
`core`'s."""

from __future__ import annotations

import asyncio
import builtins
import itertools
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager

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


class _AsyncConnection:
    def __init__(self, address: Address, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.address = address
        self.reader = reader
        self.writer = writer
        self.lines = _Lines()

    @classmethod
    async def open(cls, address: Address, timeout_s: float) -> _AsyncConnection:
        # asyncio.timeout, not wait_for: on Python 3.11 a wait_for whose
        # inner call finishes as the caller is cancelled can swallow the
        # cancellation (the caller then runs on to the end).
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(*address)
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
        return _raw_answer(await self._one(obj), user_seq)

    async def _call(self, obj: dict) -> dict:
        return _checked(await self._one(obj))

    async def _one(self, obj: dict) -> dict:
        answer = (await self._exchange([obj], 1, stop_on_error=True))[0]
        assert answer is not None  # a lone request is answered once the exchange finishes
        return answer

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
                        stop_on_error: bool) -> builtins.list[dict | None]:
        # (builtins.list: in this class, `list` is the method.)
        async with self._lock:
            ex = _Exchange(requests, window, self._seqs, stop_on_error=stop_on_error)
            router = self._router
            router.begin()
            error: Exception | None
            while not ex.finished:
                if ex.halted:
                    self._drop()
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
                try:
                    if self._conn is None or self._conn.address != address:
                        self._drop()
                        self._conn = await _AsyncConnection.open(address, self.timeout)
                    await self._pump(self._conn, ex)
                    error = None
                except TimeoutError:
                    error = ClientTimeout(
                        f"{_describe(address)}: no answer within {self.timeout} s")
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
            async with asyncio.timeout(self.timeout):  # see _AsyncConnection.open
                data = await conn.reader.read(RECV_SIZE)
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
