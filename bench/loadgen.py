"""A closed-loop load generator for qserver's client protocol.

    python bench/loadgen.py --port P [--proto tcp|udp] [--mode produce|consume_confirm|list]
                            [-c 8] [-n REQUESTS | --duration SECONDS] [--prefill N]

Like queue_server's own benchmark (test/bench_queue.py: 8 concurrent
clients, each sending its next request when the answer to the previous one
arrives), every client has exactly one request in flight. Throughput is
therefore bounded by latency x concurrency, which is what a client of a
queue sees.

Modes
- produce: action 1 into queue "bench", with queue_server's bench fields
  (delay = now, ttl = now + 300, retry = 30) and a 40-byte message.
- consume_confirm: action 2 on the same queue "bench"; each consume that
  returns a msg_id is followed by a confirm (action 3) of that id. Each of
  the two counts as one request. The queue must hold enough messages: a
  prior produce run leaves them, and `--prefill N` produces N more first
  (pipelined over TCP, not measured); a consume
  that finds the queue empty is counted in `empty` and followed by the next
  consume, so a run that ran dry shows it.
- list: action 7 with pattern "bench".
- empty_consume: action 2 on queue "bench-empty", which nothing produces to:
  every answer is the empty consume (an answer that appends no entry).
- confirm_unknown: action 3 of msg_id 1 on queue "bench-empty": every
  answer is queue_server's code 0 for an unknown id (no entry either).
  These two measure the read index (design.md: answers that append no entry
  wait until the state they were read from is committed).

Every request carries a `seq` (the server echoes it), so that a late UDP
answer to a request already given up on is recognised and dropped.

Cost: this process shares the machine's CPUs with the server it measures,
so it is built to be cheap: uvloop, asyncio Protocol callbacks rather than
streams or a coroutine per request, request bytes made by concatenating
precomputed parts (no JSON encoding on the send path), orjson for answers,
one timer for all UDP timeouts rather than one per request.

Library use: `await run_load(host, port, ...)` returns a `LoadResult`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass

import orjson
import uvloop

__all__ = ["LoadResult", "run_load", "prefill", "queue_size", "MODES", "PROTOS",
           "PRODUCE_QUEUE", "CONSUME_QUEUE", "DEFAULT_DATA"]

MODES = ("produce", "consume_confirm", "list", "empty_consume", "confirm_unknown")
PROTOS = ("tcp", "udp")

# One queue for both modes, so that the consume_confirm runs consume what
# the produce runs made (as queue_server's bench did) and the queue does not
# grow without bound over a long benchmark.
PRODUCE_QUEUE = "bench"
CONSUME_QUEUE = PRODUCE_QUEUE
LIST_PATTERN = "bench"
EMPTY_QUEUE = "bench-empty"  # never produced to: reads that find nothing

# queue_server's bench sent about this much data per message.
DEFAULT_DATA = "x" * 40

# queue_server's bench: ttl 300 s after the delay, retry after 30 s.
TTL_S = 300
RETRY_S = 30

# A UDP request unanswered for this long is counted as lost (an error) and
# the client moves on: loopback answers take well under a millisecond, so
# this only trips on real loss.
DEFAULT_UDP_TIMEOUT_S = 1.0

# After the last request of a run is sent, how long to wait for stragglers
# (TCP) before the run is abandoned as hung.
HANG_GRACE_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    """The figures of one run. Latencies are of successful requests."""

    proto: str
    mode: str
    concurrency: int
    requests: int  # requests finished: answered, or given up on (UDP timeout)
    errors: int  # answers with code != 0, lost datagrams, broken connections
    empty: int  # consumes answered "nothing ready" (the queue ran dry)
    elapsed_s: float  # from the first request sent to the last answer
    p50_ms: float
    p99_ms: float
    max_ms: float

    @property
    def ok(self) -> int:
        return self.requests - self.errors

    @property
    def throughput(self) -> float:
        """Successful requests per second."""
        return self.ok / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> str:
        return (f"{self.proto} {self.mode} c={self.concurrency}: requests={self.requests} "
                f"errors={self.errors} empty={self.empty} elapsed={self.elapsed_s:.3f}s "
                f"throughput={self.throughput:.0f} req/s p50={self.p50_ms:.3f}ms "
                f"p99={self.p99_ms:.3f}ms max={self.max_ms:.3f}ms")


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(int(q * len(sorted_values) + 0.999999) - 1, 0)
    return sorted_values[min(rank, len(sorted_values) - 1)]


class _Requests:
    """Precomputed request bytes; each request is parts joined with its seq."""

    def __init__(self, mode: str, data: str, now_s: int) -> None:
        self.mode = mode
        if mode == "produce":
            body = orjson.dumps({"action": 1, "queue": PRODUCE_QUEUE, "delay": now_s,
                                 "ttl": now_s + TTL_S, "retry": RETRY_S, "data": data})
        elif mode == "consume_confirm":
            body = orjson.dumps({"action": 2, "queue": CONSUME_QUEUE})
        elif mode == "list":
            body = orjson.dumps({"action": 7, "pattern": LIST_PATTERN})
        elif mode == "empty_consume":
            body = orjson.dumps({"action": 2, "queue": EMPTY_QUEUE})
        elif mode == "confirm_unknown":
            body = orjson.dumps({"action": 3, "queue": EMPTY_QUEUE, "msg_id": 1})
        else:
            raise ValueError(f"unknown mode {mode!r}")
        # b'{...}' -> b'{...,"seq":' + seq + b'}'
        self.head = body[:-1] + b',"seq":'
        self.confirm_head = orjson.dumps({"action": 3, "queue": CONSUME_QUEUE})[:-1] + b',"msg_id":'

    def main(self, seq: int) -> bytes:
        return b"%s%d}" % (self.head, seq)

    def confirm(self, msg_id: int, seq: int) -> bytes:
        return b'%s%d,"seq":%d}' % (self.confirm_head, msg_id, seq)


class _Run:
    """What the clients of one run share."""

    def __init__(self, *, requests: _Requests, per_client: int | None, deadline: float | None,
                 clients: int) -> None:
        self.requests = requests
        self.per_client = per_client  # requests each client sends, or None
        self.deadline = deadline  # perf_counter() after which no request starts, or None
        self.running = clients
        self.done = asyncio.get_running_loop().create_future()
        self.last_answer = 0.0

    def client_finished(self) -> None:
        self.running -= 1
        if self.running == 0 and not self.done.done():
            self.done.set_result(None)


class _Client:
    """One closed-loop client: send, wait for the answer, send the next.

    Subclasses provide `_write(bytes)` and call `_answered(bytes)` for each
    answer. `outstanding` is the seq awaited, 0 when none.
    """

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.seq = 0
        self.outstanding = 0
        self.sent_at = 0.0
        self.sent = 0
        self.latencies: list[float] = []
        self.errors = 0
        self.empty = 0
        self.finished = False
        self.started = False

    def start(self) -> None:
        self.started = True
        self._next(time.perf_counter())

    def _next(self, now: float, confirm_id: int = 0) -> None:
        run = self.run
        if not confirm_id:  # a delivered message is always confirmed
            if (run.deadline is not None and now >= run.deadline) or (
                    run.per_client is not None and self.sent >= run.per_client):
                self._finish()
                return
        self.seq += 1
        seq = self.seq
        if confirm_id:
            payload = run.requests.confirm(confirm_id, seq)
        else:
            payload = run.requests.main(seq)
        self.outstanding = seq
        self.sent += 1
        self.sent_at = time.perf_counter()
        self._write(payload)

    def _answered(self, line: bytes) -> None:
        now = time.perf_counter()
        if not self.outstanding:
            return  # finished, or a late answer after a UDP timeout
        try:
            obj = orjson.loads(line)
            seq = obj.get("seq")
        except (orjson.JSONDecodeError, AttributeError):
            self._failed(now)  # not a JSON object: count it and go on
            return
        if seq != self.outstanding:
            if seq is None and obj.get("code") != 0:
                self._failed(now)  # an error answer that could not echo our request
            return  # a late answer to a request already given up on
        self.outstanding = 0
        self.run.last_answer = now
        if obj.get("code") != 0:
            self.errors += 1
            self._next(now)
            return
        self.latencies.append(now - self.sent_at)
        confirm_id = 0
        if obj.get("action") == 2:
            msg_id = obj.get("msg_id")
            if msg_id is None:
                self.empty += 1
            else:
                confirm_id = int(msg_id)
        self._next(now, confirm_id)

    def _failed(self, now: float) -> None:
        """The outstanding request is lost: count it and send the next."""
        self.outstanding = 0
        self.errors += 1
        self.run.last_answer = now
        self._next(now)

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.outstanding = 0
            self.run.client_finished()

    def _write(self, payload: bytes) -> None:
        raise NotImplementedError


class _TcpClient(_Client, asyncio.Protocol):
    def __init__(self, run: _Run) -> None:
        super().__init__(run)
        self.transport: asyncio.Transport | None = None
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def _write(self, payload: bytes) -> None:
        self.transport.write(payload)

    def data_received(self, data: bytes) -> None:
        if self.buf:
            data = self.buf + data
            self.buf = b""
        if data[-1] == 10 and data.count(b"\n") == 1:  # one whole answer: the usual read
            self._answered(data)
            return
        *lines, self.buf = data.split(b"\n")
        for line in lines:
            if line:
                self._answered(line)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.outstanding:
            self.errors += 1
        if self.started:
            self._finish()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _UdpClient(_Client, asyncio.DatagramProtocol):
    def __init__(self, run: _Run) -> None:
        super().__init__(run)
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def _write(self, payload: bytes) -> None:
        self.transport.sendto(payload)

    def datagram_received(self, data: bytes, addr) -> None:
        self._answered(data)

    def error_received(self, exc: Exception) -> None:
        # e.g. ECONNREFUSED (nothing listens): the request is lost.
        if self.outstanding:
            self._failed(time.perf_counter())

    def check_timeout(self, now: float, timeout_s: float) -> None:
        if self.outstanding and now - self.sent_at > timeout_s:
            self._failed(now)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def run_load(host: str, port: int, *, proto: str = "tcp", mode: str = "produce",
                   concurrency: int = 8, requests: int | None = None,
                   duration: float | None = None, data: str = DEFAULT_DATA,
                   udp_timeout_s: float = DEFAULT_UDP_TIMEOUT_S) -> LoadResult:
    """Run `concurrency` closed-loop clients against host:port.

    Each client sends `requests` requests, or keeps going for `duration`
    seconds (exactly one of the two). Connections are made before the clock
    starts. Raises OSError if the server cannot be reached over TCP, and
    TimeoutError if a run hangs past its deadline.
    """
    if proto not in PROTOS:
        raise ValueError(f"unknown proto {proto!r}")
    if (requests is None) == (duration is None):
        raise ValueError("give exactly one of requests and duration")
    loop = asyncio.get_running_loop()
    reqs = _Requests(mode, data, int(time.time()))
    run = _Run(requests=reqs, per_client=requests, deadline=None, clients=concurrency)
    clients: list = []
    watchdog = None
    try:
        for _ in range(concurrency):
            if proto == "tcp":
                _, client = await loop.create_connection(lambda: _TcpClient(run), host, port)
            else:
                _, client = await loop.create_datagram_endpoint(lambda: _UdpClient(run),
                                                                remote_addr=(host, port))
            clients.append(client)

        if proto == "udp":
            interval = max(udp_timeout_s / 4, 0.01)

            def check() -> None:
                nonlocal watchdog
                now = time.perf_counter()
                for c in clients:
                    c.check_timeout(now, udp_timeout_s)
                if not run.done.done():
                    watchdog = loop.call_later(interval, check)

            watchdog = loop.call_later(interval, check)

        start = time.perf_counter()
        if duration is not None:
            run.deadline = start + duration
            limit = duration + HANG_GRACE_S
        else:
            limit = None  # a count-bounded run ends when the answers do
        run.last_answer = start
        for c in clients:
            c.start()
        if limit is None:
            await run.done
        else:
            await asyncio.wait_for(run.done, limit)
        elapsed = run.last_answer - start
    finally:
        if watchdog is not None:
            watchdog.cancel()
        for c in clients:
            c.close()

    latencies = sorted(lat for c in clients for lat in c.latencies)
    return LoadResult(
        proto=proto, mode=mode, concurrency=concurrency,
        requests=sum(c.sent for c in clients),
        errors=sum(c.errors for c in clients),
        empty=sum(c.empty for c in clients),
        elapsed_s=elapsed,
        p50_ms=_percentile(latencies, 0.50) * 1000,
        p99_ms=_percentile(latencies, 0.99) * 1000,
        max_ms=(latencies[-1] * 1000 if latencies else 0.0),
    )


class _Pipeline(asyncio.Protocol):
    """Counts newline-terminated answers and how many had code 0."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.waiting = 0
        self.ok = 0
        self.answers: list[dict] = []
        self.keep = False
        self.batch_done: asyncio.Future | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        *lines, self.buf = (self.buf + data).split(b"\n")
        for line in lines:
            if not line:
                continue
            obj = orjson.loads(line)
            if obj.get("code") == 0:
                self.ok += 1
            if self.keep:
                self.answers.append(obj)
            self.waiting -= 1
        if self.waiting <= 0 and self.batch_done and not self.batch_done.done():
            self.batch_done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.batch_done and not self.batch_done.done():
            self.batch_done.set_exception(ConnectionError("connection lost"))

    async def send(self, payload: bytes, count: int, timeout_s: float) -> None:
        self.waiting = count
        self.batch_done = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        await asyncio.wait_for(self.batch_done, timeout_s)


async def prefill(host: str, port: int, count: int, *, queue: str = CONSUME_QUEUE,
                  data: str = DEFAULT_DATA, batch: int = 1000, timeout_s: float = 30.0) -> int:
    """Produce `count` messages into `queue`, pipelined `batch` at a time over
    one TCP connection (setup for consume_confirm, not a measurement).
    Returns how many were produced."""
    loop = asyncio.get_running_loop()
    _, p = await loop.create_connection(_Pipeline, host, port)
    now_s = int(time.time())
    one = orjson.dumps({"action": 1, "queue": queue, "delay": now_s, "ttl": now_s + TTL_S,
                        "retry": RETRY_S, "data": data})
    try:
        left = count
        while left > 0:
            n = min(batch, left)
            await p.send(one * n, n, timeout_s)
            left -= n
    finally:
        p.transport.close()
    return p.ok


async def queue_size(host: str, port: int, queue: str = CONSUME_QUEUE,
                     timeout_s: float = 10.0) -> int | None:
    """The `size` that monitor (action 4) reports for `queue`, or None when
    the server does not report one (the no-op server)."""
    loop = asyncio.get_running_loop()
    _, p = await loop.create_connection(_Pipeline, host, port)
    p.keep = True
    try:
        await p.send(orjson.dumps({"action": 4, "queue": queue}), 1, timeout_s)
    finally:
        p.transport.close()
    size = p.answers[0].get("size") if p.answers else None
    return size if type(size) is int else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="closed-loop load generator for qserver's protocol")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1111)
    p.add_argument("--proto", choices=PROTOS, default="tcp")
    p.add_argument("--mode", choices=MODES, default="produce")
    p.add_argument("-c", "--concurrency", type=int, default=8, help="clients (default 8)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("-n", "--requests", type=int, help="requests per client (default 10000)")
    g.add_argument("--duration", type=float, help="seconds to run instead of -n")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help=f"first produce N messages into {CONSUME_QUEUE!r} (consume_confirm)")
    p.add_argument("--udp-timeout", type=float, default=DEFAULT_UDP_TIMEOUT_S, metavar="S")
    return p


async def _main(args: argparse.Namespace) -> int:
    if args.prefill:
        made = await prefill(args.host, args.port, args.prefill)
        print(f"prefilled {made} messages into {CONSUME_QUEUE!r}")
    requests = args.requests if args.duration is None and args.requests else None
    if requests is None and args.duration is None:
        requests = 10_000
    result = await run_load(args.host, args.port, proto=args.proto, mode=args.mode,
                            concurrency=args.concurrency, requests=requests,
                            duration=args.duration, udp_timeout_s=args.udp_timeout)
    print(result.summary())
    return 0 if result.errors == 0 else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return uvloop.run(_main(args))
    except (OSError, TimeoutError) as exc:
        print(f"loadgen: {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
