"""A no-op three-node cluster that speaks qserver's client protocol: the
throughput floor of issue 16's cluster goals.

    python bench/floor_cluster.py --role master --mode async|quorum --port P
                                  --internal-port I [--slaves 2]
    python bench/floor_cluster.py --role slave --port P --master HOST:I

bench/noop_server.py is the floor of one node: the event loop, the sockets
and the JSON codec, with none of qserver's work. This is the same for a
cluster: three processes that move requests between them as qserver's
native engine does, and do nothing else. It tells what any Python node built
this way (uvloop, orjson, msgpack on the internal links, one process per
node) can reach on this machine, against which qserver's cluster figures and
the C++ cluster's can be read (bench/cluster_bench.py --parts floor-cluster).

What it does, each step as cheaply as qserver does it or more cheaply:
- The master answers every request as the no-op server does
  (noop_server.answer: the request echoed with "code": 0). The request's
  bytes (or, relayed, its answer's) stand for its log record: the records
  go to the slaves in pushes, several records a push (a length-prefixed
  msgpack frame, as engines.peers frames its messages), and a slave
  acknowledges each push with one small frame.
- async (queue_server's mode): answers leave in the turn that read the
  requests; pushes go out to both slaves every ASYNC_PUSH_INTERVAL_S
  (qserver's native engine coalesces its async pushes every 2 ms).
- quorum: a turn's answers wait for the first slave's acknowledgement of the
  push that carries their records (a majority of three: the master and one
  slave). As qserver's native engine in quorum mode does (its spare
  pushes), one slave gets a push every loop turn that read requests, the
  other the records pushed since every SPARE_PUSH_INTERVAL_S; only the
  former's acknowledgements release answers (it is the one that has them
  first).
- A slave decodes its clients' requests (qserver's framing:
  codec.StreamDecoder, decode_datagram) and relays them to the master as
  they are, all of a turn's requests in one frame (as a qserver slave
  relays a ForwardBatch); the master answers them in one frame per frame it
  got; the slave writes each answer to its client, one write per client
  connection per frame. A request the slave cannot frame is answered by it.

Nothing is stored, nothing is fsynced, nobody is elected: the roles are
fixed. Prints "floor_cluster ready on HOST:PORT" on stdout once its client
sockets are bound and, for the master, once every slave has connected (a
slave: once it is connected to the master). Exits on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import struct
import sys

try:
    import qserver.wire.codec  # noqa: F401
except ImportError:  # run from a checkout without installing qserver
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import msgpack
import uvloop

from noop_server import answer
from qserver.errors import BadRequest, ProtocolError
from qserver.wire.codec import (
    DEFAULT_MAX_REQUEST_SIZE,
    MAX_UDP_PAYLOAD,
    StreamDecoder,
    decode_datagram,
    encode_response,
    error_response,
)

ASYNC_PUSH_INTERVAL_S = 0.002  # engines.native.driver.ASYNC_PUSH_INTERVAL_MS
SPARE_PUSH_INTERVAL_S = 0.010  # engines.native.core.SPARE_PUSH_MS
_LEN = struct.Struct(">I")
_pack = msgpack.Packer().pack
# Internal message kinds: the first element of each frame's list.
FORWARD = 1  # slave -> master: [FORWARD, [[client id, request bytes], ...]]
REPLIES = 2  # master -> slave: [REPLIES, [[client id, answer bytes], ...]]
PUSH = 3  # master -> slave: [PUSH, seq, [record bytes, ...]]
ACK = 4  # slave -> master: [ACK, seq]


def frame(message: list) -> bytes:
    payload = _pack(message)
    return _LEN.pack(len(payload)) + payload


class FrameReader:
    """Length-prefixed msgpack frames out of a byte stream."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list:
        buf = self.buf + data if self.buf else data
        out = []
        at = 0
        while len(buf) - at >= 4:
            (size,) = _LEN.unpack_from(buf, at)
            if len(buf) - at - 4 < size:
                break
            out.append(msgpack.unpackb(buf[at + 4:at + 4 + size]))
            at += 4 + size
        self.buf = buf[at:]
        return out


def _release(held: list, seq: int) -> list:
    """Take out of `held` (in push order) the entries whose push is `seq`
    or earlier."""
    i = 0
    while i < len(held) and held[i][0] <= seq:
        i += 1
    out = held[:i]
    del held[:i]
    return out


def _answer_bad_datagram(transport, reason: str, addr) -> None:
    transport.sendto(encode_response(error_response(reason)), addr)


# -- the master ---------------------------------------------------------------


class Master:
    """Answers requests (its own clients' and those its slaves relay) and
    pushes their records to the slaves."""

    def __init__(self, mode: str, slaves: int) -> None:
        self.quorum = mode == "quorum"
        self.expected_slaves = slaves
        self.links: list[asyncio.Transport] = []
        self.records: list[bytes] = []  # not yet pushed
        self.spare_records: list[bytes] = []  # quorum: pushed to the first slave only
        self.seq = 0  # pushes so far
        self.acked = 0  # highest push seq a slave acknowledged
        # quorum: answers held until `acked` reaches their seq:
        # (seq, transport, bytes) for a client; (seq, link, frame) for a slave
        self.held: list[tuple[int, asyncio.BaseTransport, bytes]] = []
        self.udp_held: list[tuple[int, tuple, bytes]] = []
        self.udp: asyncio.DatagramTransport | None = None
        self.flush_scheduled = False
        self.ready = asyncio.get_running_loop().create_future()
        self.loop = asyncio.get_running_loop()

    def start(self) -> None:
        if self.quorum:
            self.loop.call_later(SPARE_PUSH_INTERVAL_S, self._spare_push)
        else:
            self.loop.call_later(ASYNC_PUSH_INTERVAL_S, self._timed_push)

    def _timed_push(self) -> None:
        self.push()
        self.loop.call_later(ASYNC_PUSH_INTERVAL_S, self._timed_push)

    def push(self) -> None:
        """One push of every record not yet pushed: to every slave (async),
        or to the first one, the others' records kept for the spare push
        (quorum)."""
        self.flush_scheduled = False
        if not self.records or not self.links:
            return
        self.seq += 1
        data = frame([PUSH, self.seq, self.records])
        if self.quorum:
            self.links[0].write(data)
            if len(self.links) > 1:
                self.spare_records += self.records
        else:
            for link in self.links:
                link.write(data)
        self.records = []

    def _spare_push(self) -> None:
        """Quorum: the records pushed to the first slave since the last
        spare push, to the others (their acknowledgements release
        nothing)."""
        if self.spare_records:
            data = frame([PUSH, 0, self.spare_records])
            self.spare_records = []
            for link in self.links[1:]:
                link.write(data)
        self.loop.call_later(SPARE_PUSH_INTERVAL_S, self._spare_push)

    def after_turn(self) -> None:
        """Quorum: push this turn's records at its end."""
        if self.quorum and not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.push)

    def send(self, transport: asyncio.BaseTransport, data: bytes) -> None:
        if self.quorum:
            self.held.append((self.seq + 1, transport, data))
        else:
            transport.write(data)  # type: ignore[attr-defined]

    def send_to(self, data: bytes, addr: tuple) -> None:
        if self.quorum:
            self.udp_held.append((self.seq + 1, addr, data))
        else:
            self.udp.sendto(data, addr)  # type: ignore[union-attr]

    def on_ack(self, seq: int) -> None:
        if seq <= self.acked:
            return
        self.acked = seq
        for _, transport, data in _release(self.held, seq):
            transport.write(data)  # type: ignore[attr-defined]
        for _, addr, data in _release(self.udp_held, seq):
            self.udp.sendto(data, addr)  # type: ignore[union-attr]


class MasterClient(asyncio.Protocol):
    __slots__ = ("master", "transport", "decoder")

    def __init__(self, master: Master) -> None:
        self.master = master
        self.decoder = StreamDecoder(DEFAULT_MAX_REQUEST_SIZE)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        out = []
        for item in self.decoder.feed(data):
            if type(item) is ProtocolError or type(item) is BadRequest:
                out.append(encode_response(error_response(item.reason)))
                continue
            out.append(answer(item))
        if out:
            # What was read stands for the records of its requests.
            self.master.records.append(data)
            self.master.send(self.transport, b"".join(out))
            self.master.after_turn()


class MasterUdp(asyncio.DatagramProtocol):
    def __init__(self, master: Master) -> None:
        self.master = master

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.master.udp = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr) -> None:
        obj = decode_datagram(data, MAX_UDP_PAYLOAD)
        if type(obj) is BadRequest:
            _answer_bad_datagram(self.master.udp, obj.reason, addr)
            return
        self.master.records.append(data)
        self.master.send_to(answer(obj), addr)
        self.master.after_turn()

    def error_received(self, exc: Exception) -> None:
        pass


class MasterLink(asyncio.Protocol):
    """The master's end of one slave's link."""

    def __init__(self, master: Master) -> None:
        self.master = master
        self.reader = FrameReader()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.master.links.append(transport)  # type: ignore[arg-type]
        if len(self.master.links) == self.master.expected_slaves and not self.master.ready.done():
            self.master.ready.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport in self.master.links:
            self.master.links.remove(self.transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        master = self.master
        for message in self.reader.feed(data):
            kind = message[0]
            if kind == ACK:
                master.on_ack(message[1])
            elif kind == FORWARD:
                replies = []
                records = master.records
                for cid, obj in message[1]:
                    encoded = answer(obj)
                    records.append(encoded)  # (the request's fields and "code")
                    replies.append([cid, encoded])
                master.send(self.transport, frame([REPLIES, replies]))
                master.after_turn()


# -- a slave ----------------------------------------------------------------------


class Slave:
    """Acknowledges pushes; relays its clients' requests to the master."""

    def __init__(self) -> None:
        self.link: asyncio.Transport | None = None
        self.pending: list[list] = []  # [client id, request] not yet relayed
        self.clients: dict[int, object] = {}  # id -> transport (TCP) or address (UDP)
        self.next_id = 1
        self.udp: asyncio.DatagramTransport | None = None
        self.flush_scheduled = False
        self.loop = asyncio.get_running_loop()

    def relay(self, cid: int, request: object) -> None:
        self.pending.append([cid, request])
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.pending and self.link is not None:
            self.link.write(frame([FORWARD, self.pending]))
        self.pending = []

    def on_replies(self, replies: list) -> None:
        by_client: dict[int, list[bytes]] = {}
        for cid, data in replies:
            by_client.setdefault(cid, []).append(data)
        clients = self.clients
        for cid, parts in by_client.items():
            dest = clients.get(cid)
            if type(dest) is tuple:  # a UDP client's address: one datagram an answer
                clients.pop(cid, None)
                for part in parts:
                    self.udp.sendto(part, dest)  # type: ignore[union-attr]
            elif dest is not None:
                dest.write(b"".join(parts))  # type: ignore[attr-defined]


class SlaveClient(asyncio.Protocol):
    __slots__ = ("slave", "cid", "decoder", "transport")

    def __init__(self, slave: Slave) -> None:
        self.slave = slave
        self.cid = slave.next_id
        slave.next_id += 1
        self.decoder = StreamDecoder(DEFAULT_MAX_REQUEST_SIZE)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.slave.clients[self.cid] = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.slave.clients.pop(self.cid, None)

    def data_received(self, data: bytes) -> None:
        relay = self.slave.relay
        cid = self.cid
        for item in self.decoder.feed(data):
            if type(item) is ProtocolError or type(item) is BadRequest:
                self.transport.write(encode_response(error_response(item.reason)))
                continue
            relay(cid, item)


class SlaveUdp(asyncio.DatagramProtocol):
    def __init__(self, slave: Slave) -> None:
        self.slave = slave

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.slave.udp = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr) -> None:
        obj = decode_datagram(data, MAX_UDP_PAYLOAD)
        if type(obj) is BadRequest:
            _answer_bad_datagram(self.slave.udp, obj.reason, addr)
            return
        slave = self.slave
        cid = slave.next_id
        slave.next_id += 1
        slave.clients[cid] = addr
        slave.relay(cid, obj)

    def error_received(self, exc: Exception) -> None:
        pass


class SlaveLink(asyncio.Protocol):
    """A slave's end of its link to the master."""

    def __init__(self, slave: Slave) -> None:
        self.slave = slave
        self.reader = FrameReader()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.slave.link = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        # No master, no answers: the slave stops rather than leave its
        # clients waiting (the bench sees it gone).
        print(f"floor_cluster: link to the master lost ({exc})", file=sys.stderr, flush=True)
        os._exit(1)

    def data_received(self, data: bytes) -> None:
        acks = []
        for message in self.reader.feed(data):
            kind = message[0]
            if kind == PUSH:
                acks.append(message[1])  # the records themselves are dropped
            elif kind == REPLIES:
                self.slave.on_replies(message[1])
        if acks:
            self.transport.write(frame([ACK, max(acks)]))


# -- main ---------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    host = args.host
    if args.role == "master":
        master = Master(args.mode, args.slaves)
        await loop.create_server(lambda: MasterLink(master), host, args.internal_port,
                                 reuse_address=True)
        tcp = await loop.create_server(lambda: MasterClient(master), host, args.port,
                                       reuse_address=True, backlog=1024)
        port = tcp.sockets[0].getsockname()[1]
        await loop.create_datagram_endpoint(lambda: MasterUdp(master), local_addr=(host, port))
        await master.ready
        master.start()
    else:
        slave = Slave()
        mhost, mport = args.master.rsplit(":", 1)
        for _ in range(600):  # the master may still be starting: up to 60 s
            try:
                await loop.create_connection(lambda: SlaveLink(slave), mhost, int(mport))
                break
            except OSError:
                await asyncio.sleep(0.1)
        else:
            raise SystemExit(f"slave: no master at {args.master}")
        tcp = await loop.create_server(lambda: SlaveClient(slave), host, args.port,
                                       reuse_address=True, backlog=1024)
        port = tcp.sockets[0].getsockname()[1]
        await loop.create_datagram_endpoint(
            lambda: SlaveUdp(slave), local_addr=(host, port))
    print(f"floor_cluster ready on {host}:{port}", flush=True)
    await stop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("master", "slave"), required=True)
    p.add_argument("--mode", choices=("async", "quorum"), default="async")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--internal-port", type=int, default=0, help="master: where slaves connect")
    p.add_argument("--slaves", type=int, default=2, help="master: how many slaves connect")
    p.add_argument("--master", help="slave: HOST:PORT of the master's internal port")
    args = p.parse_args(argv)
    if args.role == "slave" and not args.master:
        p.error("--master is required for a slave")
    uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
