"""A no-op server that speaks qserver's client protocol: the throughput floor.

    python bench/noop_server.py --port P [--host 127.0.0.1]

It listens for TCP and UDP on one port, as qserver does, and answers every
request by echoing it with "code": 0. It stores nothing. bench/run_bench.py
measures it and qserver under the same load generator in the same run, so
that qserver's throughput can be read as a fraction of what the event loop,
the sockets and the JSON codec alone allow on this machine.

To make the floor cost what qserver's transport costs, the framing is
qserver's own: TCP bytes go through `qserver.wire.codec.StreamDecoder` (several
requests per read, requests split across reads, error answers for bad
input), datagrams through `decode_datagram`, and every answer through
`encode_response` (orjson, newline-terminated). What the floor leaves out is
exactly qserver's own work: request validation, the store, the log and the
engine.

One difference from a pure echo, so that the load generator sends the same
request mix to both servers: a consume (action 2) is answered with a
constant `msg_id` and `data`, as a non-empty consume from qserver is, so that
the generator's consume+confirm mode follows each consume with a confirm.

Prints "noop server ready on HOST:PORT" on stdout once both sockets are
bound; exits on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

try:
    import qserver.wire.codec  # noqa: F401
except ImportError:  # run from a checkout without installing qserver
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvloop

from qserver.errors import BadRequest, ProtocolError
from qserver.wire.codec import (
    DEFAULT_MAX_REQUEST_SIZE,
    MAX_UDP_PAYLOAD,
    StreamDecoder,
    decode_datagram,
    encode_response,
    error_response,
)

# What a non-empty consume answers with. The data is as long as the load
# generator's default message (bench/loadgen.py DEFAULT_DATA), so that the
# answer is as big as qserver's.
CONSUME_MSG_ID = 1
CONSUME_DATA = "x" * 40


def answer(obj: object) -> bytes:
    """The encoded answer to one decoded request."""
    if type(obj) is not dict:
        return encode_response(error_response("request must be a JSON object"))
    obj["code"] = 0
    if obj.get("action") == 2:
        obj["msg_id"] = CONSUME_MSG_ID
        obj["data"] = CONSUME_DATA
    return encode_response(obj)


class NoopTcp(asyncio.Protocol):
    """One connection: every request answered in order, one write per read."""

    __slots__ = ("transport", "decoder")

    def __init__(self, max_size: int) -> None:
        self.transport: asyncio.Transport | None = None
        self.decoder = StreamDecoder(max_size)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        items = self.decoder.feed(data)
        if not items:
            return
        transport = self.transport
        if len(items) == 1 and type(items[0]) is dict:  # the common case
            transport.write(answer(items[0]))
            return
        out = []
        close = False
        for item in items:
            kind = type(item)
            if kind is ProtocolError:
                out.append(encode_response(error_response(item.reason)))
                close = True
                break
            if kind is BadRequest:
                out.append(encode_response(error_response(item.reason)))
                continue
            out.append(answer(item))
        transport.write(b"".join(out))
        if close:
            transport.close()


class NoopUdp(asyncio.DatagramProtocol):
    """One answer datagram per request datagram."""

    def __init__(self, max_size: int) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self.max_size = max_size

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr) -> None:
        obj = decode_datagram(data, self.max_size)
        if type(obj) is BadRequest:
            payload = encode_response(error_response(obj.reason))
        else:
            payload = answer(obj)
        self.transport.sendto(payload, addr)

    def error_received(self, exc: Exception) -> None:
        pass  # a client went away; nothing to do


async def serve(host: str, port: int, max_size: int = DEFAULT_MAX_REQUEST_SIZE) -> None:
    """Serve until SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    tcp = await loop.create_server(lambda: NoopTcp(max_size), host, port,
                                   reuse_address=True, backlog=1024)
    host, port = tcp.sockets[0].getsockname()[:2]
    udp, _ = await loop.create_datagram_endpoint(
        lambda: NoopUdp(min(max_size, MAX_UDP_PAYLOAD)), local_addr=(host, port))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"noop server ready on {host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        udp.close()
        tcp.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="no-op server speaking qserver's client protocol")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="TCP and UDP port (0: any free one)")
    p.add_argument("--max-request-size", type=int, default=DEFAULT_MAX_REQUEST_SIZE)
    args = p.parse_args(argv)
    uvloop.run(serve(args.host, args.port, args.max_request_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
